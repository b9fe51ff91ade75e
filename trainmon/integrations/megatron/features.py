"""The model features (docs/features.md) of Megatron-Core chunks: the core attention read from its inputs, the
tensor-parallel partitions of the weights combined over the TP group."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from trainmon.collect.hooks import HookRegistry
from trainmon.integrations.megatron.collect import GroupLayout

if TYPE_CHECKING:
    from trainmon.base.types import MegatronParameter
    from trainmon.collect.context import Collector, StepContext
    from trainmon.config import MonitorConfig

__all__ = ["megatron_features"]

logger = logging.getLogger("trainmon")


def megatron_features(ctx: StepContext, config: MonitorConfig, modules: list[tuple[str, torch.nn.Module, int]],
                      aliases: dict[str, list[str]], params: list[tuple[str, MegatronParameter, int]],
                      param_aliases: dict[str, list[str]], registry: HookRegistry, layout: GroupLayout
                      ) -> list[Collector]:
    """The model features (docs/features.md) of Megatron-Core chunks: the core attention of each attention layer
    read from its inputs (``[s, b, h, d]``, its softmax scale and mask type; global head indices under tensor
    parallelism), tensor-parallel partitions of the weights combined over the TP group."""
    from dataclasses import replace

    from trainmon.collect.attention import AttentionSource
    from trainmon.integrations.features import FeatureLayout, feature_collectors

    tp_rank, tp_size = layout.tp_rank, layout.tp_size
    if config.features.attention.enabled:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized() and ps.get_context_parallel_world_size() > 1:
            logger.warning("trainmon: features.attention under context parallelism: each rank's attn rows score its "
                           "own queries against its own block of keys only")

    def attention(source: AttentionSource) -> AttentionSource:
        module = source.module
        heads = getattr(module, "num_attention_heads_per_partition", None)
        if heads is None:
            heads = getattr(getattr(module, "config", None), "num_attention_heads", 0) // max(tp_size, 1)
        source = replace(source, head_offset=tp_rank * int(heads))
        if source.name.rpartition(".")[2] == "core_attention":
            source = replace(source, inputs="sbhd", megatron=True)
        return source

    def split(param: torch.nn.Parameter) -> tuple[int, Any] | None:
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            return int(getattr(param, "partition_dim", 0)), layout.tp_group
        return None

    features = FeatureLayout(attention=attention, split=split,
                             is_attention=lambda name, module: name.rpartition(".")[2] == "core_attention",
                             embedding=lambda module: type(module).__name__ == "VocabParallelEmbedding")
    return feature_collectors(ctx, config, modules, aliases, params, param_aliases, registry, features)
