"""Heatmap rows of ``trainmon report``: row names parsed into layer and block, ordered and labelled (framework-free).

A row name such as ``model.layers.12.self_attn.q_proj.weight`` is a *stack* (``model.layers``), a *layer index*
(12), a *block* (``self_attn``) and the rest (``q_proj.weight``): the first dotted component that is a number is the
layer index (Hugging Face ``model.layers.N``, GPT-2 ``transformer.h.N``, Megatron ``decoder.layers.N``, an
``nn.Sequential``'s ``N``). Rows are ordered as the model runs forward: the rows before the stack (the
embeddings), the layers by index, each layer's blocks in execution order, then the rows after it (the final
norm, the head). The execution order comes from the data (``order`` of the store, the first appearance in a CSV
file); a family recorded in the backward pass (last layer first) is turned around, so that every family of a run
reads top-down in the same order.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("attention", "mlp", "norm", "embedding", "head", "other")
"""Block kinds, coloured in the strip beside the row labels."""
_TOKENS = re.compile(r"[._]")
_FC = re.compile(r"^(c_)?fc\d*$")
_LN = re.compile(r"^ln(\d*|f)$")


@dataclass(frozen=True)
class RowName:
    """One row name, parsed.

    Attributes:
        name: the name as written.
        stack: the path before the layer index (``model.layers``); None when the name has no layer index.
        layer: the layer index; None without one.
        block: the first component after the layer index when more follow (``self_attn``), else ``""``.
        rest: what follows the layer index (``self_attn.q_proj.weight``); the whole name without a layer index.
    """

    name: str
    stack: str | None
    layer: int | None
    block: str
    rest: str

    @property
    def kind(self) -> str:
        """One of :data:`KINDS`, from the block (a layered row) or the whole name.

        Example:
            >>> names = ("model.layers.3.self_attn.q_proj.weight", "lm_head.weight",
            ...          "model.layers.3.post_attention_layernorm.weight", "h.0.mlp.c_fc.weight")
            >>> [parse_name(name).kind for name in names]
            ['attention', 'head', 'norm', 'mlp']
        """
        text = (self.block or self.rest).lower() if self.layer is not None else self.name.lower()
        tokens = _TOKENS.split(text)
        if "norm" in text or any(_LN.match(token) for token in tokens):
            return "norm"
        if "attn" in text or "attention" in text:
            return "attention"
        if any(word in text for word in ("mlp", "ffn", "feed_forward", "moe", "expert")) or any(
                _FC.match(token) for token in tokens):
            return "mlp"
        if "embed" in text or {"wte", "wpe"} & set(tokens):
            return "embedding"
        if "lm_head" in text or "output_layer" in text or {"head", "classifier"} & set(tokens):
            return "head"
        return "other"


def parse_name(name: str) -> RowName:
    """Split a row name at its first numeric component.

    Example:
        >>> row = parse_name("model.layers.12.mlp.down_proj.weight")
        >>> row.stack, row.layer, row.block, row.rest
        ('model.layers', 12, 'mlp', 'mlp.down_proj.weight')
        >>> parse_name("model.norm.weight").layer is None
        True
    """
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit() and len(part) <= 9:
            rest = parts[i + 1:]
            return RowName(name, ".".join(parts[:i]), int(part), rest[0] if len(rest) > 1 else "", ".".join(rest))
    return RowName(name, None, None, "", name)


@dataclass(frozen=True)
class RowSet:
    """The ordered rows of a family and their labels (sent to the page as :meth:`to_json`).

    Attributes:
        keys: ``(vpp_stage, name)`` of each row, in display order.
        groups: the label of each group of rows (a layer: ``model.layers.12``; a row without a layer: its name).
        group_of: the group index of each row.
        blocks: the block of each row (``""`` when none).
        kinds: the :data:`KINDS` index of each row.
    """

    keys: tuple[tuple[int, str], ...]
    groups: tuple[str, ...]
    group_of: tuple[int, ...]
    blocks: tuple[str, ...]
    kinds: tuple[int, ...]

    def index(self) -> dict[tuple[int, str], int]:
        """``key -> display position``."""
        return {key: i for i, key in enumerate(self.keys)}

    def to_json(self) -> dict[str, Any]:
        """``{"names", "groups", "group", "block", "kind"}``: names as labelled (``name (vpp v)`` beyond stage 0)."""
        return {"names": [label(key) for key in self.keys], "groups": list(self.groups), "group": list(self.group_of),
                "block": list(self.blocks), "kind": list(self.kinds)}


def label(key: tuple[int, str]) -> str:
    """A row's label: its name, with its virtual pipeline stage beyond stage 0.

    Example:
        >>> label((0, "w")), label((1, "w"))
        ('w', 'w (vpp 1)')
    """
    return key[1] if key[0] == 0 else f"{key[1]} (vpp {key[0]})"


def order_rows(keys: Sequence[tuple[int, str]], first: Sequence[float]) -> RowSet:
    """The rows in forward order, grouped by layer and block.

    Args:
        keys: ``(vpp_stage, name)`` of each row.
        first: each row's execution position (smaller runs first; any monotone measure: the store's ``order``,
            a CSV row's first appearance).

    Example:
        >>> rows = order_rows([(0, "head"), (0, "b.1.x"), (0, "b.0.x"), (0, "emb")], [0, 1, 2, 3])  # backward
        >>> [name for _, name in rows.keys], rows.groups
        (['emb', 'b.0.x', 'b.1.x', 'head'], ('emb', 'b.0', 'b.1', 'head'))
    """
    parsed = [parse_name(name) for _, name in keys]
    position = [float(x) for x in first]
    if _runs_backward(parsed, position):
        position = [-x for x in position]
    stack_start: dict[tuple[int, str], float] = {}
    block_start: dict[tuple[int, str, int, str], float] = {}
    for (vpp, _), row, at in zip(keys, parsed, position):
        if row.stack is not None and row.layer is not None:
            stack = (vpp, row.stack)
            stack_start[stack] = min(stack_start.get(stack, at), at)
            block = (vpp, row.stack, row.layer, row.block)
            block_start[block] = min(block_start.get(block, at), at)

    def sort_key(i: int) -> tuple[Any, ...]:
        (vpp, name), row, at = keys[i], parsed[i], position[i]
        if row.stack is None or row.layer is None:
            return (vpp, at, 0, 0.0, at, name)
        return (vpp, stack_start[(vpp, row.stack)], row.layer, block_start[(vpp, row.stack, row.layer, row.block)],
                at, name)

    ordered = sorted(range(len(keys)), key=sort_key)
    groups: list[str] = []
    group_of: list[int] = []
    for i in ordered:
        row, vpp = parsed[i], keys[i][0]
        text = row.name if row.layer is None else f"{row.stack}.{row.layer}" if row.stack else str(row.layer)
        text = text if vpp == 0 else f"{text} (vpp {vpp})"
        if not groups or groups[-1] != text:
            groups.append(text)
        group_of.append(len(groups) - 1)
    return RowSet(tuple(keys[i] for i in ordered), tuple(groups), tuple(group_of),
                  tuple(parsed[i].block for i in ordered), tuple(KINDS.index(parsed[i].kind) for i in ordered))


def _runs_backward(parsed: list[RowName], position: list[float]) -> bool:
    """Whether the lowest layer of the largest stack runs after its highest layer (a backward-pass family)."""
    stacks: dict[str, dict[int, float]] = {}
    for row, at in zip(parsed, position):
        if row.stack is not None and row.layer is not None:
            layers = stacks.setdefault(row.stack, {})
            layers[row.layer] = min(layers.get(row.layer, at), at)
    if not stacks:
        return False
    layers = max(stacks.values(), key=len)
    return len(layers) > 1 and layers[min(layers)] > layers[max(layers)]


__all__ = ["KINDS", "RowName", "RowSet", "label", "order_rows", "parse_name"]
