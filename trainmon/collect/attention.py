"""Per-head attention features (family ``attn``): the largest logit and the mean softmax entropy of sampled query rows.

Where the query and key are read (one :class:`AttentionSource` per module):

- the **attention function** the module calls (``inputs`` None): a :class:`torch.overrides.TorchFunctionMode`,
  pushed by the module's forward pre-hook and popped by its forward hook (``always_call``: also when the forward
  raises), sees the first call of ``torch.nn.functional.scaled_dot_product_attention`` (its query, key, mask,
  ``is_causal``, scale, grouped heads) or of a softmax over 4-D ``[batch, heads, queries, keys]`` scores (HF's eager
  attention: the scores with the mask added, where ``finfo.min`` marks a masked entry) in each call of the module.
  A public torch API, scoped to that module's forward on collected steps: nothing is patched.
- the module's **inputs** (``inputs`` ``sbhd`` / ``bshd``): its first two positional inputs are the query and key
  (msprobe's ``attention_hook`` with ``sa_order``; Megatron-Core's core attention, ``[s, b, h, d]``, with its own
  scale and mask type).

The rows: ``query_rows`` (query position, sequence) pairs, the same every step (:func:`sample_rows`), each scored
against all keys in float32 on the tensors' device; no host sync. Rows ``{module}.head{h}`` (``h`` + ``head_offset``:
the global head under tensor parallelism), ``{module}.call{k}.head{h}`` for a module's k-th call in a micro-step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from trainmon.base.partials import PARTIAL_SLOTS
from trainmon.base.records import RowKey, module_call
from trainmon.collect.attention_scores import Logits, ScoreChain, argument
from trainmon.collect.context import in_backward
from trainmon.collect.hooks import HookedCollector, HookRegistry

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext

logger = logging.getLogger("trainmon")

FAMILY = "attn"
_SOFTMAXES = frozenset({F.softmax, torch.softmax, torch.Tensor.softmax})
_Rows = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class AttentionSource:
    """One attention module and how its query and key are read.

    Attributes:
        name: the module's row name.
        module: the module.
        vpp_stage: its virtual-pipeline chunk.
        inputs: None (the attention function it calls), ``sbhd`` or ``bshd`` (its first two positional inputs).
        causal: with ``inputs``: a query sees the keys at or before its position only.
        head_offset: added to the local head index (tensor parallelism: this rank's first global head).
        megatron: a Megatron-Core core attention: its ``softmax_scale`` (times the softmax's layer scaling), its
            ``attn_mask_type`` (argument or attribute) and its boolean ``attention_mask`` (True: masked out).
    """

    name: str
    module: torch.nn.Module
    vpp_stage: int = 0
    inputs: str | None = None
    causal: bool = True
    head_offset: int = 0
    megatron: bool = False


def sample_rows(batch: int, queries: int, wanted: int, device: torch.device) -> _Rows:
    """The sampled ``(sequences, positions)``: at most ``wanted`` sequences, evenly spaced from the first, and
    ``ceil(wanted / sequences)`` positions evenly spaced up to the last, the same in each (device index tensors, made
    on the device: no copy from the host).

    Example:
        >>> [t.tolist() for t in sample_rows(2, 8, 4, torch.device("cpu"))]
        [[0, 1], [3, 7]]
    """
    sequences = min(batch, wanted)
    positions = min(queries, -(-wanted // sequences))
    batch_index = torch.arange(sequences, device=device) * batch // sequences
    position = torch.arange(1, positions + 1, device=device) * queries // positions - 1
    return batch_index, position


def features_from_scores(logits: torch.Tensor, visible: torch.Tensor | None, raw: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """``[heads, 8]`` partial rows from sampled scores ``[sequences, heads, rows, columns]`` (float32, what the
    softmax sees): slot 0 the largest visible logit, slot 1 the mean entropy (nats) of the rows that see a key (a NaN
    anywhere stays NaN). ``raw``: the logits ``q.k * scale`` of the first ``keys`` columns, ``[sequences, heads, rows,
    keys]``, when the scores are not them (capped, a bias added, sink columns after the keys): the largest logit is
    then theirs, where the scores are visible.

    Example:
        >>> out = features_from_scores(torch.tensor([[[[0.0, 0.0], [5.0, -1.0]]]]), None)
        >>> round(float(out[0, 0]), 3), round(float(out[0, 1]), 3)
        (5.0, 0.355)
    """
    if visible is not None:
        logits = logits.masked_fill(~visible, -math.inf)
    row_max = logits.amax(dim=-1)  # -inf: a row that sees no key (left out below); NaN stays NaN
    seen = row_max != -math.inf
    if raw is not None:
        keys = raw.shape[-1]
        shown = raw if visible is None else raw.masked_fill(~visible[..., :keys], -math.inf)
        row_max = torch.where(seen, shown.amax(dim=-1), row_max)
    probs = torch.softmax(logits, dim=-1)
    entropy = -torch.special.xlogy(probs, probs).sum(dim=-1)  # p log p is 0 where p is 0
    entropy = torch.where(seen, entropy, torch.zeros((), dtype=entropy.dtype, device=entropy.device))
    mean_entropy = entropy.sum(dim=(0, 2)) / seen.sum(dim=(0, 2))
    values = torch.stack([row_max.amax(dim=(0, 2)), mean_entropy], dim=1)
    return F.pad(values, (0, PARTIAL_SLOTS - 2))


def features_from_qk(query: torch.Tensor, key: torch.Tensor, rows: _Rows, *, scale: float | None = None,
                     causal: bool = False, mask: torch.Tensor | None = None, mask_keeps: bool = True) -> torch.Tensor:
    """``[heads, 8]`` partial rows (:func:`features_from_scores`) of the sampled query rows against all keys.

    Args:
        query: ``[batch, heads, queries, head size]``.
        key: ``[batch, key heads, keys, head size]``; ``heads`` a multiple of ``key heads`` (grouped-query
            attention: query head ``h`` reads key head ``h // (heads / key heads)``).
        rows: :func:`sample_rows` of ``(batch, queries)``.
        scale: the logits' scale (None: ``1 / sqrt(head size)``).
        causal: query ``i`` sees keys ``j <= i`` only (top-left aligned, as torch's ``is_causal``).
        mask: broadcastable to ``[batch, heads, queries, keys]``: boolean (see ``mask_keeps``) or added to the logits
            (an entry at or below half of ``finfo.min`` masks its key, as -inf does).
        mask_keeps: a boolean mask's True means "takes part" (torch); False: "masked out" (Megatron-Core).
    """
    batch, heads, queries, size = query.shape
    key_heads, keys = key.shape[1], key.shape[2]
    batch_index, position = rows
    sequences, per = len(batch_index), len(position)
    sampled = query.index_select(0, batch_index).index_select(2, position).float()
    keys_of = (key if sequences == batch else key.index_select(0, batch_index)).float()
    group = heads // key_heads
    logits = torch.matmul(sampled.reshape(sequences, key_heads, group * per, size), keys_of.transpose(-1, -2))
    logits = logits.view(sequences, heads, per, keys) * (1.0 / math.sqrt(size) if scale is None else scale)
    visible: torch.Tensor | None = None
    raw: torch.Tensor | None = None
    if causal:
        visible = torch.arange(keys, device=query.device) <= position[:, None]
    if mask is not None:
        picked = mask.expand(batch, heads, queries, keys).index_select(0, batch_index).index_select(2, position)
        if picked.dtype == torch.bool:
            keep = picked if mask_keeps else ~picked
        else:  # added to the logits; at or below half of finfo.min (HF's masked value) counts as masked, as -inf
            raw, logits = logits, logits + picked.float()  # a position bias (ALiBi) is in the scores, not the logit
            keep = picked > torch.finfo(picked.dtype).min / 2
        visible = keep if visible is None else visible & keep
    return features_from_scores(logits, visible, raw)


def features_from_softmax_input(scores: torch.Tensor, rows: _Rows, logits: Logits | None = None) -> torch.Tensor:
    """``[heads, 8]`` partial rows from the ``[batch, heads, queries, columns]`` scores a softmax is given (the mask
    already added: an entry at or below half of ``finfo.min`` counts as masked, as HF's eager attention marks it);
    ``logits``: where the largest logit is read (:class:`~trainmon.collect.attention_scores.Logits`), else the
    scores."""
    batch_index, position = rows
    sampled = scores.index_select(0, batch_index).index_select(2, position)
    floor = torch.finfo(scores.dtype).min / 2 if scores.is_floating_point() else -math.inf
    raw = logits.sampled(scores, batch_index, position) if logits is not None else None
    return features_from_scores(sampled.float(), sampled > floor, raw)


class _AttentionMode(TorchFunctionMode):
    """Sees the first attention function a module's forward calls (see the module docstring) and hands it on, with
    the :class:`ScoreChain` of the functions before it."""

    def __init__(self, on_call: Callable[[Any, tuple[Any, ...], dict[str, Any], ScoreChain], bool]) -> None:
        super().__init__()
        self.on_call = on_call
        self.done = False
        self.chain = ScoreChain()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self.done:
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention or func in _SOFTMAXES:
            self.done = bool(self.on_call(func, args, kwargs, self.chain))
            return func(*args, **kwargs)  # the user's op, outside the guard
        result = func(*args, **kwargs)  # the user's op, outside the guard
        try:
            self.chain.follow(func, args, kwargs, result)
        except Exception:  # trainmon's own bookkeeping never reaches the user's forward
            self.chain.refused = "trainmon could not follow the scores"
            logger.debug("trainmon: following attention scores failed", exc_info=True)
        return result


class AttentionFeatures(HookedCollector):
    """Family ``attn`` for the modules of ``sources`` (see the module docstring); hooks on collected steps only.

    Args:
        ctx: the monitor's step context.
        sources: the attention modules.
        query_rows: rows sampled per call (``features.attention.query_rows``).
        registry: where the hook handles live.
        select: given the sources, those that may be hooked now (modules inside compiled code are left out).
    """

    HOOK_GROUP = "attention_features"
    HOOK_GROUPS = (HOOK_GROUP,)
    PART = "attention_features"

    def __init__(self, ctx: StepContext, sources: list[AttentionSource], query_rows: int, registry: HookRegistry,
                 select: Callable[[list[AttentionSource]], list[AttentionSource]] | None = None) -> None:
        super().__init__(ctx, registry)
        self.sources = sources
        self.query_rows = query_rows
        self.select = select
        self._rows: dict[tuple[int, int, str], _Rows] = {}
        self._modes: dict[int, list[_AttentionMode | None]] = {}
        self._calls: dict[tuple[str, int], int] = {}
        self._calls_at: tuple[int, int, int] = (-1, -1, -1)
        self._silent: dict[str, bool] = {}  # module -> it ran and no attention was read (warned once)
        self._refused: set[str] = set()  # modules whose logits cannot be read: warned once, never a row

    def install_hooks(self) -> None:
        if FAMILY not in self.ctx.specs:
            return
        for source in self.select(self.sources) if self.select is not None else self.sources:
            module = source.module
            pre = module.register_forward_pre_hook(self.guarded(self._pre_hook(source)), with_kwargs=True)
            self.registry.add(self.HOOK_GROUP, pre)
            if source.inputs is None:
                post = module.register_forward_hook(self.guarded(self._post_hook(source)), always_call=True)
                self.registry.add(self.HOOK_GROUP, post)

    def reset(self) -> None:
        self._pop_all()
        self._calls.clear()
        self._calls_at = (-1, -1, -1)

    def before_transfer(self) -> None:
        self._pop_all()
        for name, silent in self._silent.items():
            if silent:
                logger.warning("trainmon: features.attention: module %s called no attention function trainmon "
                               "reads (scaled_dot_product_attention, or a softmax over [batch, heads, queries, keys] "
                               "scores); it gets no attn rows (set features.attention.inputs if its inputs are q and "
                               "k)", name)
            self._silent[name] = False
        self._calls.clear()

    # ------------------------------------------------------------------ hooks
    def _next_call(self, source: AttentionSource) -> int:
        ctx = self.ctx
        at = (ctx.step, ctx.micro_step, ctx.forwards)
        if at != self._calls_at:
            self._calls.clear()
            self._calls_at = at
        key = (source.name, source.vpp_stage)
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        return call

    def _pre_hook(self, source: AttentionSource) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], None]:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            # a forward re-run inside a backward pass (activation checkpointing) was measured in its first run
            active = self.ctx.collecting and not in_backward() and source.name not in self._refused
            stack = self._modes.setdefault(id(module), [])
            if not active:
                if source.inputs is None:
                    stack.append(None)
                return
            call = self._next_call(source)
            if source.inputs is not None:
                self._from_inputs(source, call, args, kwargs)
                return
            self._silent.setdefault(source.name, True)
            mode = _AttentionMode(self.guarded(lambda func, a, k, chain: self._from_function(source, call, func, a, k,
                                                                                              chain)))
            mode.__enter__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            stack.append(mode)

        return hook

    def _post_hook(self, source: AttentionSource) -> Callable[[Any, tuple[Any, ...], Any], None]:
        def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
            stack = self._modes.get(id(module))
            if stack:
                _pop(stack.pop())

        return hook

    def _pop_all(self) -> None:
        for stack in self._modes.values():
            while stack:
                _pop(stack.pop())
        self._modes.clear()

    # ------------------------------------------------------------------ reading q and k
    def _from_function(self, source: AttentionSource, call: int, func: Any, args: tuple[Any, ...],
                       kwargs: dict[str, Any], chain: ScoreChain) -> bool:
        """The first attention function call of a module call: True when it was read (or refused)."""
        if func is F.scaled_dot_product_attention:
            query, key = argument(args, kwargs, 0, "query"), argument(args, kwargs, 1, "key")
            if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == 4
                    and key.dim() == 4 and query.shape[1] % key.shape[1] == 0):
                return False
            rows = self._sample(query)
            block = features_from_qk(query.detach(), key.detach(), rows, scale=kwargs.get("scale"),
                                     causal=bool(argument(args, kwargs, 5, "is_causal", False)),
                                     mask=_detached(argument(args, kwargs, 3, "attn_mask")))
        else:
            scores = argument(args, kwargs, 0, "input")
            dim = argument(args, kwargs, 1, "dim")
            if not (isinstance(scores, torch.Tensor) and scores.dim() == 4 and dim in (-1, 3)):
                return False
            logits = chain.logits_of(scores)
            if logits is not None and logits.refused:
                self._refuse(source, logits.refused)
                return True
            block = features_from_softmax_input(scores.detach(), self._sample(scores), logits)
        self._add(source, call, block)
        return True

    def _from_inputs(self, source: AttentionSource, call: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if len(args) < 2 or not all(isinstance(a, torch.Tensor) and a.dim() == 4 for a in args[:2]):
            return
        order = (1, 2, 0, 3) if source.inputs == "sbhd" else (0, 2, 1, 3)
        query, key = (args[i].detach().permute(*order) for i in (0, 1))
        if query.shape[1] % key.shape[1]:
            return
        scale, causal, mask = None, source.causal, None
        if source.megatron:
            scale, causal, mask = _megatron_attention(source.module, args, kwargs, query.shape[-1])
        self._add(source, call, features_from_qk(query, key, self._sample(query), scale=scale, causal=causal,
                                                 mask=mask, mask_keeps=not source.megatron))

    def _sample(self, query: torch.Tensor) -> _Rows:
        key = (query.shape[0], query.shape[2], str(query.device))
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = sample_rows(query.shape[0], query.shape[2], self.query_rows, query.device)
        return rows

    def _refuse(self, source: AttentionSource, why: str) -> None:
        self._silent[source.name] = False
        if source.name not in self._refused:
            self._refused.add(source.name)
            logger.warning("trainmon: features.attention: module %s: %s; it gets no attn rows (docs/features.md)",
                           source.name, why)

    def _add(self, source: AttentionSource, call: int, block: torch.Tensor) -> None:
        self._silent[source.name] = False
        if source.name in self._refused:
            return
        buffer = self.ctx.buffer
        heads = block.shape[0]
        first = buffer.reserve_orders(heads) if hasattr(buffer, "reserve_orders") else buffer.next_order()
        prefix = module_call(source.name, call)
        micro = self.ctx.micro_step
        keys = [RowKey(FAMILY, f"{prefix}.head{source.head_offset + h}", micro, source.vpp_stage, first + h)
                for h in range(heads)]
        add_block = getattr(buffer, "add_block", None)
        if add_block is not None:
            add_block(keys, block.reshape(-1))
        else:
            for h, key in enumerate(keys):
                buffer.add(key, block[h])


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else None


def _pop(mode: _AttentionMode | None) -> None:
    """Pop ``mode`` from torch's function-mode stack when it is on top (it is, unless a forward left another one)."""
    if mode is None:
        return
    from torch.overrides import _get_current_function_mode

    if _get_current_function_mode() is mode:  # type: ignore[no-untyped-call]
        mode.__exit__(None, None, None)
    else:
        logger.debug("trainmon: an attention mode was not on top of torch's function-mode stack; left in place")


def _megatron_attention(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], size: int
                        ) -> tuple[float, bool, torch.Tensor | None]:
    """``(scale, causal, mask)`` of a Megatron-Core core attention call: its softmax scale (a layer-scaling
    coefficient applied in its softmax cancels the one in its scale), its mask type, its boolean mask."""
    scale = getattr(module, "softmax_scale", None)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(size)
    coefficient = getattr(getattr(module, "scale_mask_softmax", None), "scale", None)
    if coefficient:
        scale *= float(coefficient)
    mask_type = argument(args, kwargs, 4, "attn_mask_type") or getattr(module, "attn_mask_type", None)
    causal = getattr(mask_type, "name", str(mask_type)) == "causal"
    mask = argument(args, kwargs, 3, "attention_mask")
    return scale, causal, mask.detach() if isinstance(mask, torch.Tensor) and mask.dim() == 4 else None
