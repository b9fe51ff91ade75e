"""Where each user parameter's rank-local shard lives under DeepSpeed ZeRO 0/1/2/3.

A *layout* answers, for one parameter (by the user's ``engine.module.named_parameters()``
name, never a flat-buffer index), which local tensors hold its reduced gradient, its fp32
master copy and its optimizer states on this rank. Only DeepSpeed's public accessors are
used: ``safe_get_local_grad`` / ``safe_get_local_fp32_param`` /
``safe_get_local_optimizer_state`` under ZeRO-3, the fragment mapping ``param._hp_mapping``
under ZeRO 1/2 (and DeepSpeed's BF16 optimizer), and the plain torch objects under ZeRO-0.
Every returned tensor holds only this rank's *valid* elements (ZeRO-3 partition padding is
cut off), so partial statistics of the shards combine exactly to the whole parameter's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from trainmon.base import process_groups
from trainmon.probe.shards import ShardSpec

if TYPE_CHECKING:
    from trainmon.base.types import DeepSpeedParameter


def _inner_optimizer(engine: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer that DeepSpeed's wrapper (ZeRO, FP16/BF16) steps."""
    optimizer = engine.optimizer
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


class ShardLayout:
    """Base layout: the local shard accessors of one engine.

    Attributes:
        replicated: True when every data-parallel rank holds whole tensors (ZeRO-0): the
            statistics need no combination across ranks.
    """

    replicated = False

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.optimizer = _inner_optimizer(engine)

    def grad(self, param: DeepSpeedParameter) -> torch.Tensor | None:
        """The local shard of the reduced gradient (valid between backward and step)."""
        raise NotImplementedError

    def spec(self, param: DeepSpeedParameter) -> ShardSpec:
        """Which elements of the whole parameter :meth:`grad` holds on this rank (static)."""
        raise NotImplementedError

    def master(self, param: DeepSpeedParameter) -> torch.Tensor | None:
        """The local shard of the fp32 master parameter."""
        raise NotImplementedError

    def state(self, param: DeepSpeedParameter, key: str) -> torch.Tensor | None:
        """The local shard of optimizer state ``key`` (None before the first step)."""
        raise NotImplementedError

    def adam_context(self) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
        """``storage pointer of exp_avg -> (optimizer state, param group)`` of the inner optimizer.

        A state shard is a view of its flat state tensor, so its storage finds the step count
        and hyper-parameters (betas, eps) that ``update`` needs, for any layout.
        """
        out: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        if self.optimizer is None:
            return out
        groups = self.optimizer.param_groups
        group_of = {id(flat): group for group in groups for flat in group["params"]}
        # ZeRO-3 empties the inner param groups outside its step; Adam's update needs only betas
        # and eps, so any group serves when all groups agree on them (groups usually differ in
        # weight decay only).
        shared = groups[0] if groups and all(
            (g.get("betas"), g.get("eps")) == (groups[0].get("betas"), groups[0].get("eps")) for g in groups) else None
        for flat, state in self.optimizer.state.items():
            group = group_of.get(id(flat), shared)
            if group is not None and state and isinstance(state.get("exp_avg"), torch.Tensor):
                out[state["exp_avg"].untyped_storage().data_ptr()] = (state, group)
        return out


class Zero3Layout(ShardLayout):
    """ZeRO-3: ``safe_get_local_*``; each parameter is split evenly (padded) over the dp group."""

    def _valid(self, param: DeepSpeedParameter, local: torch.Tensor | None) -> torch.Tensor | None:
        if local is None:
            return None
        local = local.reshape(-1)
        part = local.numel()
        index = process_groups.group_rank(param.ds_process_group)
        valid = max(0, min(part, param.ds_numel - index * part))
        return local.narrow(0, 0, valid)

    def spec(self, param: DeepSpeedParameter) -> ShardSpec:
        part = param.ds_tensor.ds_numel  # the (padded) partition size, equal on every rank
        index = process_groups.group_rank(param.ds_process_group)
        valid = max(0, min(part, param.ds_numel - index * part))
        return ShardSpec.flat(tuple(param.ds_shape), index * part if valid else 0, valid)

    def grad(self, param: DeepSpeedParameter) -> torch.Tensor | None:
        from deepspeed.utils import safe_get_local_grad

        return self._valid(param, safe_get_local_grad(param))

    def master(self, param: DeepSpeedParameter) -> torch.Tensor | None:
        from deepspeed.utils import safe_get_local_fp32_param

        return self._valid(param, safe_get_local_fp32_param(param))

    def state(self, param: DeepSpeedParameter, key: str) -> torch.Tensor | None:
        from deepspeed.utils import safe_get_local_optimizer_state

        try:
            return self._valid(param, safe_get_local_optimizer_state(param, key))
        except KeyError:  # no state before the first step
            return None


class FragmentLayout(ShardLayout):
    """ZeRO 1/2 and DeepSpeed's BF16 optimizer: the fragment mapping ``param._hp_mapping``.

    ``_hp_mapping`` is None on a rank that holds no element of the parameter.
    """

    def grad(self, param: DeepSpeedParameter) -> torch.Tensor | None:
        mapping = param._hp_mapping
        if mapping is None:
            return None
        try:
            fragment: torch.Tensor = mapping.get_lp_grad_fragment(param._index_in_param_group)
        except ValueError:  # DeepSpeed: "only available immediately after backward and before engine step"
            return None
        fragment = fragment.reshape(-1)
        address = mapping.lp_fragment_address
        if fragment.numel() != address.numel:
            # Some optimizers keep the whole gradient on every rank; this rank owns only its fragment.
            fragment = fragment.narrow(0, address.start, address.numel)
        return fragment

    def spec(self, param: DeepSpeedParameter) -> ShardSpec:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return ShardSpec.flat(tuple(param.shape), 0, 0)
        address = mapping.lp_fragment_address  # the fragment's offset in the flattened parameter
        return ShardSpec.flat(tuple(param.shape), address.start, address.numel)

    def master(self, param: DeepSpeedParameter) -> torch.Tensor | None:
        mapping = param._hp_mapping
        master: torch.Tensor | None = None if mapping is None else mapping.get_hp_fragment()
        return master

    def state(self, param: DeepSpeedParameter, key: str) -> torch.Tensor | None:
        mapping = param._hp_mapping
        if mapping is None or not mapping.optim_fragment or key not in mapping.optim_fragment:
            return None
        state: torch.Tensor = mapping.get_hp_fragment(key)
        return state


class ReplicatedLayout(ShardLayout):
    """ZeRO-0: whole gradients on ``param.grad`` (averaged by the engine at the boundary),
    states on the torch optimizer, keyed by the parameter itself (fp32) or by its fp32 copy
    (DeepSpeed's unfused FP16/BF16 wrapper without ZeRO; the fused one, which keeps flat
    copies, falls back to the low-precision parameter and reports no states)."""

    replicated = True

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self._master: dict[int, torch.Tensor] = {}
        wrapper = engine.optimizer
        low = getattr(wrapper, "fp16_groups", None)
        if low is not None and getattr(wrapper, "fp32_groups", None) is not None:
            for low_group, high_group in zip(low, wrapper.fp32_groups):
                self._master.update((id(p), q) for p, q in zip(low_group, high_group))

    def grad(self, param: DeepSpeedParameter) -> torch.Tensor | None:
        grad: torch.Tensor | None = param.grad
        return grad

    def spec(self, param: DeepSpeedParameter) -> ShardSpec:
        return ShardSpec.flat(tuple(param.shape), 0, param.numel())

    def master(self, param: DeepSpeedParameter) -> torch.Tensor:
        master = self._master.get(id(param))
        return param if master is None else master

    def state(self, param: DeepSpeedParameter, key: str) -> torch.Tensor | None:
        if self.optimizer is None:
            return None
        state = self.optimizer.state.get(self.master(param))
        value = state.get(key) if state else None
        return value if isinstance(value, torch.Tensor) else None


def layout_for(engine: Any, params: Iterable[DeepSpeedParameter]) -> ShardLayout:
    """Pick the layout from the parameters and the engine's optimizer.

    Raises:
        TypeError: the engine has no optimizer (nothing to read gradients from).
    """
    if engine.optimizer is None:
        raise TypeError("the DeepSpeed engine has no optimizer; trainmon needs one for weight gradients")
    params = list(params)
    if any(hasattr(p, "ds_id") for p in params):
        return Zero3Layout(engine)
    if any(hasattr(p, "_hp_mapping") for p in params):
        return FragmentLayout(engine)
    return ReplicatedLayout(engine)
