"""Mixture-of-experts router features (families ``router`` and ``expert_load``), from the router's own outputs.

A forward hook on each router module reads, in every micro-step of a collected step:

- HF routers (``MixtralTopKRouter``, ``OlmoeTopKRouter``, ``Qwen2MoeTopKRouter``, ``DeepseekV3TopkRouter``, ...)
  return ``(router_logits [tokens, experts], scores, indices [tokens, k])``: the logits and the top-k choice as the
  model computed them;
- Megatron-Core's ``TopKRouter`` returns ``(probs, routing_map [tokens, experts])``: the choice is the routing map,
  the logits are its gating recomputed in float32 from the router's input and weight (without input jitter).

Row ``{router}`` of ``router``: ``imbalance`` (most tokens routed to one expert / mean per expert), ``entropy`` (mean
over tokens of the routing softmax's entropy, nats), ``z_loss`` (mean over tokens of ``logsumexp(logits)^2``, ST-MoE's
z-loss without its coefficient) and ``expert_similarity`` (mean cosine similarity of the experts' weight vectors over
all pairs, every weight of an expert flattened into one vector; computed once per collected step, NaN when the
experts' weights were not found). Rows ``{router}.expert{e}`` of ``expert_load``: ``tokens`` (tokens routed to the
expert: top-k choices, each counted once) and ``share`` (its fraction of all choices). All on the device, no sync.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from trainmon.base.partials import PARTIAL_SLOTS
from trainmon.base.records import RowKey, module_call
from trainmon.collect.buffer import StepBuffer
from trainmon.collect.context import in_backward
from trainmon.collect.hooks import HookedCollector, HookRegistry

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext

ROUTER, LOAD = "router", "expert_load"


@dataclass(frozen=True)
class RouterSource:
    """One router and its experts' weights.

    Attributes:
        name: the router's row name.
        module: the router module.
        vpp_stage: its virtual-pipeline chunk.
        experts: the module holding the experts (the router's sibling ``experts``), or None: not found. Its weights
            are read when the similarity is computed (during the forward: FSDP2 has them unsharded then).
    """

    name: str
    module: torch.nn.Module
    vpp_stage: int = 0
    experts: torch.nn.Module | None = None


def routing_features(logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[imbalance, entropy, z_loss]`` (float32, device) from ``[tokens, experts]`` logits and per-expert counts.

    Example:
        >>> out = routing_features(torch.zeros(4, 2), torch.tensor([3.0, 1.0]))
        >>> [round(float(x), 4) for x in out]
        [1.5, 0.6931, 0.4805]
    """
    logits = logits.float().reshape(-1, logits.shape[-1])
    log_norm = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    entropy = -torch.special.xlogy(probs, probs).sum(dim=-1).mean()
    z_loss = log_norm.square().mean()
    imbalance = counts.max() / counts.mean()
    return torch.stack([imbalance, entropy, z_loss])


def counts_from_indices(indices: torch.Tensor, experts: int) -> torch.Tensor:
    """Tokens per expert (float32) from ``[tokens, k]`` top-k indices (an index outside the experts is dropped)."""
    flat = indices.reshape(-1).long()
    inside = (flat >= 0) & (flat < experts)
    counts = torch.zeros(experts + 1, dtype=torch.float32, device=indices.device)
    counts.scatter_add_(0, torch.where(inside, flat, experts), torch.ones_like(flat, dtype=torch.float32))
    return counts[:experts]


def expert_similarity(experts: Sequence[Sequence[torch.Tensor]], stacked: bool) -> torch.Tensor:
    """The mean cosine similarity over all pairs of experts of their flattened weights (a 0-d float32 tensor): with
    ``u_e`` the unit vectors, ``(||sum_e u_e||^2 - E) / (E (E - 1))``, one pass over the weights.

    Example:
        >>> weights = [torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])]
        >>> round(float(expert_similarity([weights], stacked=True)), 4)
        0.4714
    """
    tiny = torch.finfo(torch.float32).tiny
    if stacked:
        tensors = [t.detach().float() for t in experts[0]]
        count = tensors[0].shape[0]
        squares = torch.stack([t.reshape(count, -1).square().sum(dim=1) for t in tensors]).sum(dim=0)
        inverse = squares.clamp_min(tiny).rsqrt()
        total = torch.stack([(t.reshape(count, -1) * inverse[:, None]).sum(dim=0).square().sum()
                             for t in tensors]).sum()
    else:
        count = len(experts)
        flats = [[t.detach().float().reshape(-1) for t in expert] for expert in experts]
        norms = [torch.stack([f.square().sum() for f in expert]).sum().sqrt().clamp_min(tiny) for expert in flats]
        total = torch.stack([torch.stack([expert[j] / norms[e] for e, expert in enumerate(flats)]).sum(dim=0)
                             .square().sum() for j in range(len(flats[0]))]).sum()
    if count < 2:
        return torch.full((), math.nan)
    return (total - count) / (count * (count - 1))


class RouterFeatures(HookedCollector):
    """Families ``router`` and ``expert_load`` for ``sources`` (see the module docstring).

    Args:
        ctx: the monitor's step context.
        sources: the routers.
        registry: where the hook handles live.
        similarity: compute ``expert_similarity`` (``features.router.expert_similarity``).
    """

    HOOK_GROUP = "router_features"
    HOOK_GROUPS = (HOOK_GROUP,)
    PART = "router_features"

    def __init__(self, ctx: StepContext, sources: list[RouterSource], registry: HookRegistry,
                 similarity: bool = True) -> None:
        super().__init__(ctx, registry)
        self.sources = sources
        self.similarity = similarity
        self._similar: dict[str, torch.Tensor] = {}
        self._calls: dict[tuple[str, int], int] = {}
        self._calls_at: tuple[int, int, int] = (-1, -1, -1)

    def install_hooks(self) -> None:
        if ROUTER not in self.ctx.specs:
            return
        for source in self.sources:
            handle = source.module.register_forward_hook(self.guarded(self._hook(source)), with_kwargs=True)
            self.registry.add(self.HOOK_GROUP, handle)

    def reset(self) -> None:
        self._similar.clear()
        self._calls.clear()
        self._calls_at = (-1, -1, -1)

    def before_transfer(self) -> None:
        self.reset()

    def _hook(self, source: RouterSource) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self.ctx.collecting or in_backward():  # in a backward: activation checkpointing's re-run
                return
            read = _read_router(module, args, kwargs, output)
            if read is not None:
                self._add(source, *read)

        return hook

    def _add(self, source: RouterSource, logits: torch.Tensor, counts: torch.Tensor) -> None:
        ctx = self.ctx
        at = (ctx.step, ctx.micro_step, ctx.forwards)
        if at != self._calls_at:
            self._calls.clear()
            self._calls_at = at
        call = self._calls.get((source.name, source.vpp_stage), 0)
        self._calls[(source.name, source.vpp_stage)] = call + 1
        with torch.no_grad():
            values = routing_features(logits, counts)
            similar = self._similarity(source, values.device)
            row = F.pad(torch.cat([values, similar.reshape(1).to(values.device)]), (0, PARTIAL_SLOTS - 4))
            share = counts / counts.sum().clamp_min(1.0)
            load = F.pad(torch.stack([counts, share], dim=1), (0, PARTIAL_SLOTS - 2))
        name = module_call(source.name, call)
        buffer = ctx.buffer
        assert isinstance(buffer, StepBuffer)  # torch's buffer (MindSpore has no router features)
        experts = counts.shape[0]
        first = buffer.reserve_orders(1 + experts)
        micro = ctx.micro_step
        buffer.add(RowKey(ROUTER, name, micro, source.vpp_stage, first), row)
        keys = [RowKey(LOAD, f"{name}.expert{e}", micro, source.vpp_stage, first + 1 + e) for e in range(experts)]
        buffer.add_block(keys, load.reshape(-1))

    def _similarity(self, source: RouterSource, device: torch.device) -> torch.Tensor:
        """The experts' similarity, once per collected step (their weights change only at the optimizer step)."""
        found = self._similar.get(source.name)
        if found is None:
            weights, stacked = expert_weights(source.experts, source.module) if self.similarity else ([], False)
            found = (expert_similarity(weights, stacked).to(device) if weights
                     else torch.full((), math.nan, device=device))
            self._similar[source.name] = found
        return found


def expert_weights(experts: torch.nn.Module | None, router: torch.nn.Module) -> tuple[list[list[torch.Tensor]], bool]:
    """``(weights, stacked)`` of the experts module as it is now: HF's experts stored together (its own parameters,
    each ``[experts, ...]``: one list, ``stacked``), or one list of parameters per expert (a ``ModuleList`` of experts,
    or Megatron-Core's ``SequentialMLP.local_experts``); ``([], False)`` when neither."""
    if experts is None:
        return [], False
    inner = getattr(experts, "local_experts", experts)
    if isinstance(inner, torch.nn.ModuleList) and len(inner) > 1:
        per_expert: list[list[torch.Tensor]] = [list(expert.parameters()) for expert in inner]
        if all(len(params) == len(per_expert[0]) and params for params in per_expert):
            return per_expert, False
        return [], False
    count = getattr(router, "num_experts", None)
    weight = getattr(router, "weight", None)
    if not isinstance(count, int):
        count = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
    own: list[torch.Tensor] = [p for p in experts.parameters(recurse=False) if p.dim() >= 2]
    if count and own and all(p.shape[0] == count for p in own):
        return [own], True
    return [], False


def _read_router(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(logits [tokens, experts], tokens per expert)`` of one router call, or None when its output is neither
    form (see the module docstring)."""
    if not isinstance(output, (tuple, list)):
        return None
    if len(output) == 3 and all(isinstance(t, torch.Tensor) for t in output) and not output[2].is_floating_point():
        logits = output[0].detach()
        logits = logits.reshape(-1, logits.shape[-1])
        return logits, counts_from_indices(output[2].detach(), logits.shape[-1])
    if len(output) == 2 and isinstance(output[1], torch.Tensor) and output[1].dtype == torch.bool:
        weight = getattr(module, "weight", None)
        hidden = args[0] if args else kwargs.get("input")
        if not isinstance(weight, torch.Tensor) or not isinstance(hidden, torch.Tensor):
            return None
        bias = getattr(module, "bias", None)
        with torch.no_grad():
            logits = F.linear(hidden.detach().float(), weight.detach().float(),
                              bias.detach().float() if isinstance(bias, torch.Tensor) else None)
        routing_map = output[1].detach()
        return logits.reshape(-1, logits.shape[-1]), routing_map.reshape(-1, routing_map.shape[-1]).sum(dim=0).float()
    return None
