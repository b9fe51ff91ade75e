"""The modules an anomaly action can act on: every named module of every model chunk.

A model is one root module (a torch module inside its DDP / DeepSpeed wrapper, a MindSpore cell) or,
for Megatron-Core, the list of model chunks (one per virtual pipeline stage), each unwrapped from
Megatron's ``DistributedDataParallel`` / ``Float16Module``. Modules are keyed by ``(chunk, name)``:
with virtual pipeline parallelism two chunks hold modules of the same name (``decoder.layers.0``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainmon.actions.naming import implicated_module, neighbourhood
from trainmon.base.targets import plain_name, select

if TYPE_CHECKING:
    from trainmon.actions.frameworks import Framework

Key = tuple[int, str]
"""``(chunk index, module name)``; the chunk is the ``vpp_stage`` of rows and events."""


@dataclass(frozen=True)
class Entry:
    """One module of the model."""

    chunk: int
    name: str
    module: Any
    class_name: str


def chunks_of(model: Any, framework: Framework) -> list[Any]:
    """The roots of ``model``: each chunk (a Megatron chunk, say) unwrapped by the framework's adapter."""
    items = list(model) if isinstance(model, (list, tuple)) else [model]
    return [framework.unwrap(item) for item in items]


class ModuleTable:
    """Every named module of every chunk, with the tree and the dump key prefix of each.

    Args:
        model: the root module, or a list of model chunks.
        framework: the adapter that lists modules and their children.

    Example:
        >>> table = ModuleTable(model, TorchFramework())            # doctest: +SKIP
        >>> table.select(["layers.2"], "dump.modules")              # doctest: +SKIP
        [(0, 'layers.2')]
    """

    def __init__(self, model: Any, framework: Framework) -> None:
        self.framework = framework
        self.roots = chunks_of(model, framework)
        self.entries: dict[Key, Entry] = {}
        self.parents: list[dict[str, str | None]] = []
        for chunk, root in enumerate(self.roots):
            named = list(framework.named_modules(root))
            by_module = {id(module): name for name, module in named}
            parents: dict[str, str | None] = {"": None}
            # Keys are the rows' names (plain_name: no compile or checkpoint wrapper level); where a wrapper and
            # the module it wraps get one name, the entry is the wrapped module (the user's class), as in rows.
            for name, module in named:
                plain = plain_name(name)
                for child_name, child in framework.children(module):
                    full = f"{name}.{child_name}" if name else child_name
                    if by_module.get(id(child)) == full and plain_name(full) != plain:
                        parents.setdefault(plain_name(full), plain)
                if plain:
                    self.entries[(chunk, plain)] = Entry(chunk, plain, module, framework.class_name(module))
            self.parents.append(parents)
        self.names = list(dict.fromkeys(name for _, name in self.entries))
        """Every module name, in model order (a name shared by chunks once)."""

    @property
    def multi_chunk(self) -> bool:
        return len(self.roots) > 1

    def prefix(self, key: Key) -> str:
        """``Module.{name}.{Class}`` (``Module.{chunk}.{name}.{Class}`` with several chunks, as msprobe names
        the modules of a list of models); ``Cell.`` for MindSpore."""
        entry = self.entries[key]
        chunk = f"{entry.chunk}." if self.multi_chunk else ""
        return f"{self.framework.module_prefix}.{chunk}{entry.name}.{entry.class_name}"

    def label(self, key: Key) -> str:
        """The module's name for messages: ``name``, or ``name`` (chunk c) with several chunks."""
        return f"{key[1]} (chunk {key[0]})" if self.multi_chunk else key[1]

    def select(self, patterns: Sequence[str], config_key: str) -> list[Key]:
        """The modules whose names match ``patterns`` (names, globs, ``re:``), in every chunk.

        Raises:
            TargetError: a pattern matches no module.
        """
        names = set(select(self.names, list(patterns), config_key))
        return [key for key in self.entries if key[1] in names]

    def keys(self, names: Iterable[str], chunk: int | None = None) -> list[Key]:
        """``(chunk, name)`` of ``names`` in ``chunk`` (every chunk when None), in model order."""
        wanted = set(names)
        return [key for key in self.entries if key[1] in wanted and (chunk is None or key[0] == chunk)]

    def neighbourhood(self, key: Key, depth: int) -> list[Key]:
        """``key`` with its ancestors and descendants up to ``depth`` levels, in the same chunk."""
        chunk = key[0]
        return self.keys(neighbourhood(key[1], self.parents[chunk], depth), chunk)

    def for_events(self, events: Iterable[Any], depth: int) -> list[Key]:
        """The modules to act on for one step's events, given first-origin first.

        The first event that names a module wins (its ``vpp_stage`` is the chunk); its neighbourhood
        of ``depth`` levels is returned. Empty when no event names a module (the loss, a collective).
        """
        for event in events:
            chunk = int(getattr(event, "vpp_stage", 0) or 0)
            if not 0 <= chunk < len(self.parents):
                chunk = 0
            names = {n for n in self.parents[chunk] if n}
            module = implicated_module(str(getattr(event, "name", "")), names, getattr(event, "family", None))
            if module is not None:
                return self.neighbourhood((chunk, module), depth)
        return []

    def parent(self, key: Key) -> Key | None:
        parent = self.parents[key[0]].get(key[1])
        return (key[0], parent) if parent else None
