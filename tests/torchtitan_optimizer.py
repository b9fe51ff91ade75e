"""torchtitan's ``OptimizersContainer``, written out (torchtitan is not installed here).

From ``torchtitan/components/optimizer/optimizer.py`` (pytorch/torchtitan, 2026-08), without its config,
logging and checkpoint plumbing: one optimizer per model part and optimizer type, parameters assigned by
regex (first match wins), ``Optimizer.__init__(self, all_params, {})`` at the end so that step hooks work
(so its own ``param_groups`` is one group without ``lr`` and its own ``state`` stays empty), and
``step()`` steps each inner optimizer.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import torch
from torch import nn


class OptimizersContainer(torch.optim.Optimizer):
    """torchtitan's ``OptimizersContainer`` (``torchtitan/components/optimizer/optimizer.py``, 2026-08),
    without its config, logging and checkpoint plumbing: one optimizer per model part and optimizer type,
    parameters assigned by regex (first match wins), ``Optimizer.__init__(self, all_params, {})`` at the
    end so that step hooks work (its own ``param_groups`` is one group without ``lr``; its ``state`` stays
    empty), ``step()`` steps each inner optimizer."""

    def __init__(self, param_groups: list[dict[str, Any]], model_parts: list[nn.Module]) -> None:
        impl_kwargs = {"fused": False, "foreach": False}  # torchtitan's implementation="for-loop"
        all_params: list[nn.Parameter] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.model_parts = model_parts
        factories = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
        for model in self.model_parts:
            for opt_name, opt_groups in self._build_param_groups(model, param_groups, impl_kwargs).items():
                self.optimizers.append(factories[opt_name](opt_groups))
                for group in opt_groups:
                    all_params.extend(group["params"])
        torch.optim.Optimizer.__init__(self, all_params, {})  # torchtitan's _post_init

    @staticmethod
    def _build_param_groups(model: nn.Module, configs: list[dict[str, Any]], impl_kwargs: dict[str, Any]
                            ) -> dict[str, list[dict[str, Any]]]:
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        claimed: set[str] = set()
        for config in configs:
            pattern = re.compile(config["pattern"])
            params, names = [], []
            for name, param in model.named_parameters():
                if param.requires_grad and name not in claimed and pattern.search(name):
                    params.append(param)
                    names.append(name.replace("_checkpoint_wrapped_module.", ""))  # torchtitan's canonical_fqn
                    claimed.add(name)
            groups[config["optimizer_name"]].append(
                {"params": params, "param_names": names, **impl_kwargs, **config["optimizer_kwargs"]})
        return groups

    def __iter__(self):
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def step(self, closure=None):
        assert closure is None, "OptimizersContainer does not support closures"
        for optimizer in self.optimizers:
            optimizer.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)
