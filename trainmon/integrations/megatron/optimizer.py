"""Megatron-Core's optimizers: the leaves of a ``ChainedOptimizer``, and where each model parameter's fp32 main
parameter and optimizer state live (:class:`~trainmon.integrations.megatron.collect.MainParam`)."""

from __future__ import annotations

from typing import Any

import torch

from trainmon.integrations.megatron.collect import MainParam

__all__ = ["leaf_optimizers", "main_params"]


def leaf_optimizers(optimizer: Any) -> list[Any]:
    """The non-chained Megatron optimizers inside ``optimizer`` (itself when not chained)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return [optimizer]
    return [leaf for child in chained for leaf in leaf_optimizers(child)]


def main_params(optimizer: Any) -> dict[int, MainParam]:
    """Model parameter id -> where its fp32 main parameter and optimizer state live.

    Handles ``FP32Optimizer`` (the parameter itself), ``Float16OptimizerWithFloat16Params``
    (an fp32 copy for 16-bit parameters) and ``DistributedOptimizer`` (this rank's flat shard,
    an empty tensor for a parameter this rank holds no element of), each possibly chained.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    out: dict[int, MainParam] = {}
    for leaf in leaf_optimizers(optimizer):
        inner = getattr(leaf, "optimizer", None)
        if inner is None or getattr(leaf, "is_stub_optimizer", False):
            continue
        if isinstance(leaf, DistributedOptimizer):
            empty = torch.empty(0)
            group = leaf.data_parallel_group
            for buffer in leaf.buffers:
                for param in buffer.params:
                    out[id(param)] = MainParam(inner, empty, sharded=True, dp_group=group, piece=(0, 0))
            pairs = list(zip(leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups)) + list(
                zip(leaf.model_fp32_groups, leaf.shard_fp32_groups))
            for models, shards in pairs:
                for param, shard in zip(models, shards):
                    held = leaf._get_model_param_range_map(param)["param"]  # this rank's range of the parameter
                    out[id(param)] = MainParam(inner, shard, sharded=True, dp_group=group,
                                               piece=(held.start, held.size))
        elif isinstance(leaf, Float16OptimizerWithFloat16Params):
            for models, mains in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
                for param, main in zip(models, mains):
                    out[id(param)] = MainParam(inner, main)
            for group in leaf.fp32_from_fp32_groups:
                for param in group:
                    out[id(param)] = MainParam(inner, param)
        elif isinstance(leaf, FP32Optimizer):
            for group in inner.param_groups:
                for param in group["params"]:
                    out[id(param)] = MainParam(inner, param)
        else:
            raise TypeError(f"unsupported Megatron optimizer {type(leaf).__name__}; supported: FP32Optimizer, "
                            "Float16OptimizerWithFloat16Params, DistributedOptimizer, ChainedOptimizer")
    return out
