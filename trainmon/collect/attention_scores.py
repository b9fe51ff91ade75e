"""How the attention scores a softmax is given came from the query and key (eager attention).

An eager attention computes ``q @ k^T`` (``matmul``, ``@``, ``bmm`` or ``baddbmm``), scales it, and on the way to the
softmax may cap it (Gemma 2's ``cap * tanh(s / cap)``), add a mask and a position bias (ALiBi: Bloom, Falcon), or
append attention-sink columns and subtract the row maximum (GPT-OSS). The softmax's input then holds what the softmax
sees (its entropy), not the logit ``q.k * scale`` (the ``max_logit``). :class:`ScoreChain`, fed every torch function a
monitored module's forward calls on a collected step (by the function mode of :mod:`trainmon.collect.attention`),
follows the tensors from the last ``q @ k^T`` product to the softmax: the product of the Python numbers the scores
were multiplied or divided by along the way (``* scaling``, ``/ cap`` ... ``* cap``) is the scale, the columns a
``cat`` appended after the keys are sinks. Anything it cannot read that way (a scale held in a tensor, columns put
before the keys, a product whose shape does not fit the softmax's input) makes it refuse: the module is warned about
and gets no rows, rather than a plausible wrong value. Nothing here reads a value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_PRODUCTS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm,
                       torch.baddbmm, torch.Tensor.baddbmm})
_ADDMM = frozenset({torch.baddbmm, torch.Tensor.baddbmm})
_MULS = frozenset({torch.mul, torch.multiply, torch.Tensor.mul, torch.Tensor.mul_, torch.Tensor.__mul__,
                   torch.Tensor.__rmul__, torch.Tensor.__imul__})
_DIVS = frozenset({torch.div, torch.divide, torch.true_divide, torch.Tensor.div, torch.Tensor.div_,
                   torch.Tensor.__truediv__, torch.Tensor.__itruediv__})
_CATS = frozenset({torch.cat, torch.concat, torch.concatenate})
_NEW = ("_like", "new_")  # zeros_like(scores), scores.new_empty(...): a new tensor, not the scores


@dataclass
class Logits:
    """The logits of a softmax's input, as :class:`ScoreChain` read them.

    Attributes:
        query: ``[..., queries, head size]`` (``[batch * heads, ...]`` for ``bmm``).
        key_t: the key transposed, ``[..., head size, keys]``.
        scale: the Python numbers the product was multiplied by (``baddbmm``'s ``alpha`` included).
        refused: why the logits cannot be read ("" when they can).
    """

    query: torch.Tensor
    key_t: torch.Tensor
    scale: float
    refused: str = ""

    def sampled(self, scores: torch.Tensor, batch_index: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """``q.k * scale`` (float32) of the sampled rows, ``[sequences, heads, rows, keys]``, for the softmax input
        ``scores`` ``[batch, heads, queries, keys + sinks]``."""
        batch, heads, queries = scores.shape[:3]
        size, keys = self.query.shape[-1], self.key_t.shape[-1]
        query = self.query.reshape(batch, heads, queries, size)
        key_t = self.key_t.reshape(batch, -1, size, keys)
        group = heads // key_t.shape[1]
        query = query.index_select(0, batch_index).index_select(2, position).float()
        sequences, rows = query.shape[0], query.shape[2]
        key_t = key_t.index_select(0, batch_index).float()
        logits = torch.matmul(query.reshape(sequences, key_t.shape[1], group * rows, size), key_t)
        return logits.view(sequences, heads, rows, keys) * self.scale


class ScoreChain:
    """Follows the scores from the last ``q @ k^T`` product of a module's forward to its softmax (module docstring).
    """

    def __init__(self) -> None:
        self.product: tuple[torch.Tensor, torch.Tensor] | None = None
        self.scores: torch.Tensor | None = None  # the latest tensor derived from the product
        self.scale = 1.0
        self.refused = ""

    def follow(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        """Notes one torch function call (its result already computed)."""
        if not isinstance(result, torch.Tensor) or not result.is_floating_point():
            return
        scores = self.scores
        operands = _operands(args, kwargs)
        chained = scores is not None and any(t is scores for t in operands)
        if func in _PRODUCTS and not chained:
            self._product(func, args, kwargs, result)
            return
        if not chained or scores is None or result.numel() < scores.numel():
            return  # not the scores, or a reduction of them (the row maximum): the scores go on unchanged
        name = getattr(func, "__name__", "")
        if any(part in name for part in _NEW):
            return
        if func in _MULS or func in _DIVS:
            other = next((a for a in args[:2] if a is not scores), kwargs.get("other"))
            if isinstance(other, (int, float)) and not isinstance(other, bool) and other != 0:
                self.scale = self.scale * other if func in _MULS else self.scale / other
            elif isinstance(other, torch.Tensor):
                self.refused = self.refused or "the scores are multiplied by a tensor (a scale trainmon cannot read)"
        elif func in _CATS:
            tensors = argument(args, kwargs, 0, "tensors")
            dim = argument(args, kwargs, 1, "dim", 0)
            if not (isinstance(tensors, (list, tuple)) and tensors and tensors[0] is scores and dim in (-1, 3)):
                self.refused = self.refused or "columns are joined to the scores before the keys"
        self.scores = result

    def logits_of(self, softmax_input: torch.Tensor) -> Logits | None:
        """The logits of the softmax's input, or None when it does not come from a ``q @ k^T`` product seen here
        (then the input itself is read). A :class:`Logits` whose ``refused`` says why they cannot be read."""
        if self.product is None or softmax_input is not self.scores:
            return None
        query, key_t = self.product
        batch, heads, queries, columns = softmax_input.shape
        size, keys = query.shape[-1], key_t.shape[-1]
        key_heads = key_t.numel() // max(1, batch * size * keys)
        fits = (query.numel() == batch * heads * queries * size and columns >= keys and key_heads > 0
                and key_t.numel() == batch * key_heads * size * keys and heads % key_heads == 0)
        refused = self.refused or ("" if fits else "the q @ k^T product does not fit the softmax's input")
        return Logits(query, key_t, self.scale, refused)

    def _product(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: torch.Tensor) -> None:
        if func in _ADDMM:
            left, right = argument(args, kwargs, 1, "batch1"), argument(args, kwargs, 2, "batch2")
            alpha = argument(args, kwargs, 4, "alpha", 1.0)
        else:
            left, right, alpha = args[0] if args else None, argument(args, kwargs, 1, "other"), 1.0
        if not (isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor) and left.dim() == right.dim() >= 3
                and left.shape[-1] == right.shape[-2] and isinstance(alpha, (int, float))):
            return
        self.product = (left.detach(), right.detach())
        self.scores = result
        self.scale = float(alpha)
        self.refused = ""


def _operands(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for value in (*args, *kwargs.values()):
        out.extend(value if isinstance(value, (list, tuple)) else (value,))
    return out


def argument(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    """A torch function's argument, given by position ``index`` or by ``name``."""
    return args[index] if len(args) > index else kwargs.get(name, default)
