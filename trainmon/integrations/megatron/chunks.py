"""Megatron-Core's model chunks: the model inside Megatron's wrappers, and the names of every chunk's modules and
parameters with its virtual-pipeline stage."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

__all__ = ["chunks_named", "unwrap"]

_Named = TypeVar("_Named")


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside Megatron's ``DistributedDataParallel`` / ``Float16Module`` wrappers (and torch DDP)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    wrappers = (DistributedDataParallel, Float16Module, torch.nn.parallel.DistributedDataParallel)
    while isinstance(chunk, wrappers):
        chunk = chunk.module
    return chunk


def chunks_named(roots: Sequence[torch.nn.Module],
                 naming: Callable[[torch.nn.Module, int], tuple[list[tuple[str, _Named, int]], dict[str, list[str]]]]
                 ) -> tuple[list[tuple[str, _Named, int]], dict[str, list[str]]]:
    """``naming`` (:func:`named_modules` or :func:`named_parameters`) of every chunk, with its vpp stage; the
    chunks of a virtual pipeline have the same names."""
    named: list[tuple[str, _Named, int]] = []
    aliases: dict[str, list[str]] = {}
    for vpp, root in enumerate(roots):
        chunk, chunk_aliases = naming(root, vpp)
        named += chunk
        for name, others in chunk_aliases.items():
            aliases.setdefault(name, []).extend(alias for alias in others if alias not in aliases.get(name, []))
    return named, aliases
