"""Which modules and matrices the model features measure (``features``; docs/features.md), for the torch-based
integrations: the attention modules, the routers and their experts, the weight matrices and how each is split over
ranks. The integration says what only it knows (Megatron-Core's core attention and tensor-parallel partitions,
FSDP2's shard group) through :class:`FeatureLayout`; the measuring is in :mod:`trainmon.collect.attention`,
:mod:`trainmon.collect.spectral` and :mod:`trainmon.collect.router`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainmon.base.targets import select
from trainmon.collect.attention import AttentionFeatures, AttentionSource
from trainmon.collect.router import RouterFeatures, RouterSource
from trainmon.collect.spectral import Matrix, WeightFeatures
from trainmon.integrations.base import select_modules, select_params

if TYPE_CHECKING:
    from trainmon.collect.context import Collector, StepContext
    from trainmon.collect.hooks import HookRegistry
    from trainmon.config import MonitorConfig

logger = logging.getLogger("trainmon")

_Named = Sequence[tuple[str, torch.nn.Module, int]]
_NamedParams = Sequence[tuple[str, torch.nn.Parameter, int]]


@dataclass
class FeatureLayout:
    """What an integration knows about the model's features.

    Attributes:
        attention: given the generic :class:`AttentionSource` of a chosen module, the one to use (Megatron-Core: its
            core attention read its own way, and every head numbered globally under tensor parallelism).
        is_attention: given ``(name, module)``, whether the module is an attention module (None: the generic rule,
            a class name ending in ``Attention``).
        split: given a parameter, ``(split dimension, process group)`` when it is split over ranks, else None.
        select: given attention sources, those that may be hooked now (leaves out modules in compiled code).
        embedding: given ``(name, parameter, module)``, whether it is an embedding table (besides ``nn.Embedding``).
    """

    attention: Callable[[AttentionSource], AttentionSource] | None = None
    is_attention: Callable[[str, torch.nn.Module], bool] | None = None
    split: Callable[[torch.nn.Parameter], tuple[int, Any] | None] | None = None
    select: Callable[[list[AttentionSource]], list[AttentionSource]] | None = None
    embedding: Callable[[torch.nn.Module], bool] | None = None


def feature_collectors(ctx: StepContext, config: MonitorConfig, modules: _Named, module_aliases: Mapping[str, Any],
                       params: _NamedParams, param_aliases: Mapping[str, Any], registry: HookRegistry,
                       layout: FeatureLayout | None = None) -> list[Collector]:
    """The feature collectors ``config.features`` turns on (none when all are off).

    Args:
        ctx: the monitor's step context.
        config: the monitor config.
        modules: every named module (:func:`~trainmon.integrations.base.named_modules`).
        module_aliases: their other names.
        params: every named parameter (:func:`~trainmon.integrations.base.named_parameters`).
        param_aliases: their other names.
        registry: the attachment's hook registry.
        layout: what the integration knows (:class:`FeatureLayout`).

    Raises:
        TargetError: a ``features.*.modules`` or ``features.weights.params`` pattern matches nothing.
    """
    layout = layout or FeatureLayout()
    features = config.features
    collectors: list[Collector] = []
    if features.attention.enabled:
        sources = attention_sources(config, modules, module_aliases, layout)
        collectors.append(AttentionFeatures(ctx, sources, features.attention.query_rows, registry, layout.select))
    if features.router.enabled:
        collectors.append(RouterFeatures(ctx, router_sources(config, modules), registry,
                                         similarity=features.router.expert_similarity))
    if features.weights.enabled:
        collectors.append(WeightFeatures(ctx, matrices(config, modules, params, param_aliases, layout),
                                         features.weights.iterations, registry))
    return collectors


def attention_sources(config: MonitorConfig, modules: _Named, aliases: Mapping[str, Any],
                      layout: FeatureLayout) -> list[AttentionSource]:
    """The attention modules: ``features.attention.modules`` when given, else the innermost target modules that
    ``layout.is_attention`` (or the generic rule) calls attention modules."""
    section = config.features.attention
    if section.modules:
        chosen = set(select([name for name, _, _ in modules if name], section.modules, "features.attention.modules"))
        picked = [item for item in modules if item[0] in chosen]
    else:
        is_attention = layout.is_attention or _named_attention
        candidates = [item for item in select_modules(modules, config, aliases) if is_attention(item[0], item[1])]
        picked = [item for item in candidates if not _holds_candidate(item[1], candidates)]
    sources = []
    for name, module, vpp_stage in picked:
        source = AttentionSource(name, module, vpp_stage, inputs=section.inputs, causal=section.causal)
        sources.append(layout.attention(source) if layout.attention is not None else source)
    if not sources:
        logger.warning("trainmon: features.attention found no attention module (a target module whose class name "
                       "ends in Attention); set features.attention.modules")
    return sources


def _named_attention(name: str, module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")


def _holds_candidate(module: torch.nn.Module, candidates: _Named) -> bool:
    """Whether ``module`` holds another candidate below it (then only the inner one is measured)."""
    ids = {id(m) for m in module.modules() if m is not module}
    return any(id(other) in ids for _, other, _ in candidates)


def router_sources(config: MonitorConfig, modules: _Named) -> list[RouterSource]:
    """The routers: ``features.router.modules`` when given, else every module whose class name ends in ``Router``;
    each with its experts (the ``experts`` module beside it)."""
    section = config.features.router
    by_name = {name: module for name, module, _ in modules}
    if section.modules:
        chosen = set(select([name for name, _, _ in modules if name], section.modules, "features.router.modules"))
        picked = [item for item in modules if item[0] in chosen]
    else:
        picked = [item for item in modules if item[0] and type(item[1]).__name__.endswith("Router")]
    sources = []
    for name, module, vpp_stage in picked:
        parent = by_name.get(name.rpartition(".")[0]) if "." in name else by_name.get("")
        experts = getattr(parent, "experts", None) if parent is not None else None
        sources.append(RouterSource(name, module, vpp_stage,
                                    experts if isinstance(experts, torch.nn.Module) else None))
    if not sources:
        logger.warning("trainmon: features.router found no router (a module whose class name ends in Router); "
                       "set features.router.modules")
    return sources


def matrices(config: MonitorConfig, modules: _Named, params: _NamedParams, aliases: Mapping[str, Any],
             layout: FeatureLayout) -> list[Matrix]:
    """The 2-D parameters ``features.weights.params`` selects (default: the 2-D target parameters), embedding tables
    left out unless ``embeddings`` is on, with how each is split over ranks."""
    section = config.features.weights
    if section.params:
        two_d = [item for item in params if _shape_of(item[1]) == 2]
        chosen = set(select([name for name, _, _ in two_d], section.params, "features.weights.params"))
        two_d = [item for item in two_d if item[0] in chosen]
    else:
        two_d = [item for item in select_params(params, config, aliases) if _shape_of(item[1]) == 2]
    if not section.embeddings:
        embedding = layout.embedding or (lambda module: False)
        tables = {id(p) for _, module, _ in modules for p in module.parameters(recurse=False)
                  if isinstance(module, torch.nn.Embedding) or embedding(module)}
        two_d = [item for item in two_d if id(item[1]) not in tables]
    out, unknown = [], []
    for name, param, vpp_stage in two_d:
        split = layout.split(param) if layout.split is not None else None
        if split is None and hasattr(param, "to_local") and param.to_local().shape != param.shape:
            unknown.append(name)  # a DTensor split in a way this integration does not combine
            continue
        out.append(Matrix(name, param, vpp_stage, *(split or (None, None))))
    if unknown:
        logger.warning("trainmon: features.weights: %d parameter(s) are DTensors split over ranks in a layout trainmon "
                       "does not combine (%s); they get no weight_features rows", len(unknown),
                       ", ".join(unknown[:3]) + (", ..." if len(unknown) > 3 else ""))
    return out


def _shape_of(param: torch.Tensor) -> int:
    """The number of dimensions of the whole parameter (an FSDP2 ``DTensor``'s global shape)."""
    return len(param.shape)
