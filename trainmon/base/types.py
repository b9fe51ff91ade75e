"""Named aliases of the framework objects the core passes along without importing their framework.

The core must not import an optional framework, so the framework objects it passes along untouched (the
user's model and optimizer, process groups, a loss scaler) are named aliases of ``Any``: the name says what is
expected, and the integration that receives the object types it with its framework. The typed seams between
the parts live with the parts: :class:`trainmon.integrations.base.Integration`,
:class:`trainmon.actions.HandOffAction`, :class:`trainmon.tools.command.Subcommand`; the collectors' protocol
is :class:`trainmon.collect.context.Collector`; the anomaly callbacks' types are in :mod:`trainmon.anomaly.engine`.
"""

from __future__ import annotations

from typing import Any, TypeAlias

Model: TypeAlias = Any
"""What ``attach`` takes as the model: a ``torch.nn.Module`` (also under DDP or FSDP2), a ``DeepSpeedEngine``,
a list of Megatron-Core model chunks or a MindSpore ``Cell``; the integration is chosen from its type."""

Optimizer: TypeAlias = Any
"""The optimizer of the model's framework (torch, DeepSpeed's, Megatron-Core's, MindSpore's), or its wrapper."""

ProcessGroup: TypeAlias = Any
"""A process group of the model's framework (``torch.distributed.ProcessGroup``, a MindSpore group name)."""

GradScaler: TypeAlias = Any
"""A ``torch.amp.GradScaler`` (or a duck-typed one with ``get_scale``), given to ``attach`` or found there."""

DeepSpeedParameter: TypeAlias = Any
"""A ``torch.nn.Parameter`` of a DeepSpeed engine, with the attributes DeepSpeed sets on it that torch's
``Parameter`` does not declare: ZeRO-3's ``ds_numel``, ``ds_shape``, ``ds_tensor``, ``ds_process_group``;
ZeRO 1/2's (and the BF16 optimizer's) ``_hp_mapping`` and ``_index_in_param_group``."""

MegatronParameter: TypeAlias = Any
"""A ``torch.nn.Parameter`` of a Megatron-Core model chunk, with the attributes Megatron sets on it that
torch's ``Parameter`` does not declare: ``main_grad`` (the gradient buffer's view), ``partition_dim``
and ``tensor_model_parallel`` (its tensor-parallel split)."""

Scalar: TypeAlias = Any
"""A value given to ``monitor.step()``: a Python number or a 0-d tensor of any framework (read after the
step's one host transfer)."""
