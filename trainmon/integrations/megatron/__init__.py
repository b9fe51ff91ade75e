"""Megatron-Core: a list of model chunks (virtual pipeline) and a Megatron optimizer.

``monitor.attach(model_chunks, optimizer)`` where ``model_chunks`` is what Megatron's
``get_model`` returns (each chunk usually ``DistributedDataParallel(Float16Module(GPTModel))``)
and ``optimizer`` what ``get_megatron_optimizer`` returns (``FP32Optimizer``,
``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer`` or a ``ChainedOptimizer`` of them).
Process groups come from ``megatron.core.parallel_state`` when it is initialised; explicit
``tp_group``/``pp_group`` override them. Shards of the distributed optimizer are always combined
over the optimizer's own ``data_parallel_group`` (an explicit ``dp_group`` with other ranks gets
one warning). See docs/megatron.md.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from trainmon.base import process_groups
from trainmon.collect.hooks import HookRegistry
from trainmon.collect.step_hooks import StepWrapper
from trainmon.integrations.base import (
    REPLICATED_FAMILIES,
    Attachment,
    AttachOptions,
    Replicated,
    named_modules,
    named_parameters,
    select_modules,
    select_params,
)
from trainmon.integrations.megatron.collect import (
    GroupLayout,
    MainParam,
    MegatronActivationCollector,
    MegatronParamCollector,
)
from trainmon.probe.sharded import ShardedGradProbe

if TYPE_CHECKING:
    from trainmon.base.guard import Guard
    from trainmon.base.types import MegatronParameter
    from trainmon.collect.context import Collector, StepContext
    from trainmon.collect.step_guard import GuardedSteps, GuardFactory
    from trainmon.config import GuardConfig, MonitorConfig

logger = logging.getLogger("trainmon")
_Named = TypeVar("_Named")

def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside Megatron's ``DistributedDataParallel`` / ``Float16Module`` wrappers (and torch DDP)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    wrappers = (DistributedDataParallel, Float16Module, torch.nn.parallel.DistributedDataParallel)
    while isinstance(chunk, wrappers):
        chunk = chunk.module
    return chunk


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


def model_parallel_groups(options: AttachOptions) -> tuple[Any, Any]:
    """``(tp_group, pp_group)``: explicit ones first, else ``parallel_state``'s, else None.

    No data-parallel group is returned: nothing is combined over a DP group except the shards of
    the distributed optimizer, and those over the optimizer's own group (see :func:`check_dp_group`).
    """
    from megatron.core import parallel_state as ps

    tp, pp = options.tp_group, options.pp_group
    if ps.model_parallel_is_initialized():
        tp = tp if tp is not None else ps.get_tensor_model_parallel_group()
        pp = pp if pp is not None else ps.get_pipeline_model_parallel_group()
    return tp, pp


def check_dp_group(dp_group: Any, mains: dict[int, MainParam]) -> bool:
    """Warn once when an explicit ``dp_group`` holds other ranks than the distributed optimizer's group.

    The shards of a ``DistributedOptimizer`` live on the ranks of its ``data_parallel_group``, so
    that is the group their statistics are combined over, whatever ``dp_group`` says. Without a
    distributed optimizer nothing is combined over a data-parallel group (reduced gradients and
    optimizer states are replicated; ``grad_unreduced`` is this rank's own): ``dp_group`` only names the ranks
    whose rows are written once when ``parallel_state`` is not initialised (:func:`replicated_families`).

    Returns:
        True when the warning was logged.
    """
    if dp_group is None or not process_groups.initialized():
        return False
    wanted = process_groups.members(dp_group)
    groups = {id(main.dp_group): main.dp_group for main in mains.values() if main.sharded}
    for group in groups.values():
        used = process_groups.members(group)
        if used != wanted:
            logger.warning("trainmon: dp_group passed to attach (ranks %s) differs from the distributed "
                           "optimizer's data_parallel_group (ranks %s); its shards are combined over the "
                           "optimizer's group", wanted, used)
            return True
    return False


def replicated_families(mains: dict[int, MainParam], options: AttachOptions) -> Replicated | None:
    """The rows that are the same on every rank of the data-parallel group, or None.

    The gradients are averaged over the data-parallel ranks (with context parallelism: over those of
    ``parallel_state``'s data-parallel group with context parallelism), which hold the same parameters: what the
    optimizer steps with, its parameters and states are the same on each (after the tensor-parallel combination,
    a distributed optimizer's shards after their combination over its ``data_parallel_group``). Not so under
    expert parallelism (expert parameters are averaged over the expert data-parallel ranks only, and hold other
    experts on each data-parallel rank), nor when the distributed optimizers use several groups: then every rank
    writes its own rows.
    """
    from megatron.core import parallel_state as ps

    # decided alike on every rank (the caller's collective at attach depends on it): from the job's layout, not
    # from the parameters of this pipeline stage
    initialized = ps.model_parallel_is_initialized()
    if not mains or (initialized and ps.get_expert_model_parallel_world_size() > 1):
        return None
    groups = {id(m.dp_group): m.dp_group for m in mains.values() if m.sharded}
    if len(groups) > 1:
        return None
    if groups:
        group = next(iter(groups.values()))
    else:
        group = ps.get_data_parallel_group(with_context_parallel=True) if initialized else options.dp_group
        if group is None:
            return None  # no data-parallel group known: nothing is assumed
    if process_groups.group_size(group, none_is_world=False) == 1:
        return None
    return Replicated(tuple(f for f in REPLICATED_FAMILIES if f != "momentum"), group)


def guard_refusal(model: Any, optimizer: Any) -> str | None:
    """Why the step guard cannot hold back this Megatron-Core set-up's steps exactly, or None when it can.

    Supported: one model chunk (no pipeline parallelism), tensor and data parallelism (also the distributed
    optimizer), fp32 and bf16 without a loss scaler; or a plain torch optimizer over chunks without Megatron's DDP
    (the torch guard then).
    """
    from megatron.core import parallel_state as ps

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if optimizer is None:
        return "the step guard needs the optimizer: pass it to attach(chunks, optimizer)"
    if isinstance(optimizer, torch.optim.Optimizer):
        if any(hasattr(p, "main_grad") for chunk in chunks for p in chunk.parameters()):
            return ("a torch optimizer over Megatron DDP chunks steps param.grad while the gradients live in "
                    "param.main_grad: pass the Megatron optimizer (get_megatron_optimizer)")
        return None
    if len(chunks) > 1 or ps.model_parallel_is_initialized() and (
            ps.get_pipeline_model_parallel_world_size() > 1):
        return "pipeline parallelism is not supported by the step guard yet"
    if ps.model_parallel_is_initialized() and ps.get_expert_model_parallel_world_size() > 1:
        return "expert parallelism is not supported by the step guard yet"
    try:
        main_params(optimizer)
    except TypeError as exc:
        return str(exc)
    for leaf in leaf_optimizers(optimizer):
        if getattr(leaf, "grad_scaler", None) is not None:
            return ("a loss scaler (fp16, or loss_scale set) is not supported: it skips its own steps and counts "
                    "the others; use bf16 or fp32")
        if getattr(getattr(leaf, "ddp_config", None), "use_megatron_fsdp", False):
            return "Megatron FSDP is not supported by the step guard yet"
    return None


def _computes_grad_norm(optimizer: Any) -> bool:
    """Whether ``optimizer.step()``'s grad norm is one: a ``ChainedOptimizer`` (what ``get_megatron_optimizer``
    returns) always computes it; a bare Megatron optimizer only with ``clip_grad > 0`` (else it returns 0.0)."""
    if getattr(optimizer, "chained_optimizers", None) is not None:
        return True
    return float(getattr(getattr(optimizer, "config", None), "clip_grad", 1.0)) > 0.0


def _record_step_result(ctx: StepContext, wrapper: StepWrapper) -> Callable[..., None]:
    """A step post-hook that records what Megatron's ``optimizer.step()`` returned and knows.

    ``(update_successful, grad_norm, num_zeros)``: ``step_skipped`` (and Megatron's own name
    ``skipped_iter``) is 1 when the step was skipped for non-finite gradients; ``grad_norm`` is
    Megatron's pre-clip norm; ``loss_scale`` and ``lr/group{i}``.
    """
    def hook(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        result = wrapper.last_result
        if not ctx.collecting or not (isinstance(result, tuple) and len(result) == 3):
            return
        ok, grad_norm, num_zeros = result
        buffer = ctx.buffer
        buffer.add_scalar("skipped_iter", 0.0 if ok else 1.0)
        buffer.add_scalar("step_skipped", 0.0 if ok else 1.0)
        if grad_norm is not None and _computes_grad_norm(optimizer):
            buffer.add_scalar("grad_norm", grad_norm)
        if num_zeros is not None:
            buffer.add_scalar("num_zeros", num_zeros)
        scale = optimizer.get_loss_scale()
        if scale is not None:
            buffer.add_scalar("loss_scale", scale)
        for i, group in enumerate(optimizer.param_groups):
            buffer.add_scalar(f"lr/group{i}", group["lr"])

    return hook


def attach(ctx: StepContext, config: MonitorConfig, model: Any, optimizer: Any,
           options: AttachOptions) -> Attachment:
    """Build the collectors for Megatron-Core model chunks and their optimizer.

    Args:
        ctx: the monitor's step context.
        config: the monitor config.
        model: a model chunk or the list of chunks (one per virtual pipeline stage).
        optimizer: the Megatron optimizer, or None.
        options: ``grad_acc_steps`` (set it to the number of micro-batches) and process groups
            (``dp_group`` is only checked against the distributed optimizer's, see :func:`check_dp_group`).

    Raises:
        TargetError: a target pattern matches no module or parameter.
        TypeError: the optimizer is not a supported Megatron optimizer.
    """
    chunks: Sequence[torch.nn.Module] = list(model) if isinstance(model, (list, tuple)) else [model]
    roots = [unwrap(chunk) for chunk in chunks]
    tp_group, pp_group = model_parallel_groups(options)
    tp_rank, tp_size = process_groups.layout(tp_group, none_is_world=False)
    pp_stage = process_groups.group_rank(pp_group, none_is_world=False)
    registry = HookRegistry()
    modules_named, module_aliases = _chunks_named(roots, named_modules)
    collectors: list[Collector] = []
    if config.activations.enabled:
        collectors.append(MegatronActivationCollector(ctx, select_modules(modules_named, config, module_aliases),
                                                      config.activations, registry))
    params, param_aliases = _chunks_named(roots, named_parameters)
    chosen = functools.partial(select_params, params, config, param_aliases)  # raises only when called
    layout = GroupLayout(tp_group, tp_size, tp_rank)
    if config.features.enabled:
        collectors += _feature_collectors(ctx, config, modules_named, module_aliases, params, param_aliases, registry,
                                          layout)
    if isinstance(optimizer, torch.optim.Optimizer):
        # A plain torch optimizer (NVIDIA's examples/run_simple_mcore_train_loop.py): its own
        # step hooks and the torch collectors, which read ``param.grad`` as it stands.
        return _attach_torch_optimizer(ctx, config, roots, modules_named, chosen, optimizer, collectors,
                                       registry, pp_stage, tp_size)
    step_hooks = None
    if optimizer is not None:
        step_hooks = StepWrapper(optimizer).install()
        step_hooks.register_step_post_hook(ctx.guard.wrap("step", _record_step_result(ctx, step_hooks)))
    mains = main_params(optimizer) if optimizer is not None else {}
    replicated = None
    if config.weight_grads.enabled or config.optimizer_states.enabled or config.params.enabled:
        check_dp_group(options.dp_group, mains)
        collectors.append(MegatronParamCollector(ctx, chosen(), mains, layout, config, registry))
        replicated = replicated_families(mains, options)
    if config.grad_probe.enabled:
        try:
            probe = grad_probe(ctx, config, chosen(), mains, layout, registry)
        except BaseException:
            if step_hooks is not None:
                step_hooks.uninstall()  # a failed attach leaves the optimizer as it was
            raise
        if probe is not None:
            collectors.append(probe)
    rank, world_size = process_groups.layout()
    attachment = Attachment(collectors=collectors, roots=[(root, vpp) for vpp, root in enumerate(roots)],
                            modules=modules_named, optimizer=step_hooks, registry=registry, rank=rank,
                            world_size=world_size, pp_stage=pp_stage, collective=world_size > 1,
                            replicated=replicated,
                            step_guard=None if optimizer is None else _guard_factory(optimizer, params, mains, layout))
    if step_hooks is not None:
        attachment.on_close.append(step_hooks.uninstall)
    return attachment


def _guard_factory(optimizer: Any, params: list[tuple[str, MegatronParameter, int]], mains: dict[int, MainParam],
                   layout: GroupLayout) -> GuardFactory:
    """Builds the step guard on ``optimizer`` (``anomaly.guard``): every parameter it steps, judged from this rank's
    pieces of the reduced gradients (summed over the ranks that hold pieces of a parameter)."""

    def build(settings: GuardConfig, guard: Guard, on_decided: Callable[[torch.Tensor | float], None]
              ) -> GuardedSteps:
        from trainmon.errors import UnsupportedSetupError
        from trainmon.integrations.megatron.guard import MegatronStepGuard

        try:
            sharded, group = _probe_group(mains, layout, user="anomaly.guard")
        except ValueError as exc:
            raise UnsupportedSetupError(str(exc)) from exc
        held = [(name, param) for name, param, _ in params if id(param) in mains and param.requires_grad]
        return MegatronStepGuard(settings, optimizer, held, mains, layout.tp_rank, group if sharded else None, guard,
                                 on_decided)

    return build


def _feature_collectors(ctx: StepContext, config: MonitorConfig, modules: list[tuple[str, torch.nn.Module, int]],
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


class _InnerStepHooks:
    """``register_step_pre_hook`` on every torch optimizer inside a Megatron optimizer, as one handle.

    Their pre-hooks run after Megatron has copied, unscaled and clipped the gradients into the main
    parameters (for a ``ChainedOptimizer``: all of them, before the first inner step)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def register_step_pre_hook(self, hook: Callable[..., None]) -> _Handles:
        return _Handles([optimizer.register_step_pre_hook(hook) for optimizer in self.optimizers])


class _Handles:
    """Several removable handles as one."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _probe_group(mains: dict[int, MainParam], layout: GroupLayout, user: str = "grad_probe") -> tuple[bool, Any]:
    """``(sharded, group)``: the ranks whose pieces make up a parameter (TP partitions, distributed-optimizer
    ranges); ``(False, None)`` when every rank holds whole parameters (replicated: each rank writes its own).
    ``user`` names the feature in the errors."""
    dp_groups = {id(m.dp_group): m.dp_group for m in mains.values()
                 if m.sharded and process_groups.group_size(m.dp_group, none_is_world=False) > 1}
    if len(dp_groups) > 1:
        raise ValueError(f"{user}: the distributed optimizers use different data-parallel groups")
    dp_group = next(iter(dp_groups.values()), None)
    if dp_group is None:
        return layout.tp_size > 1, layout.tp_group
    if layout.tp_size == 1:
        return True, dp_group
    from megatron.core import parallel_state as ps

    # TP partitions cut by distributed-optimizer ranges: the group of both (one gather over it)
    wanted = sorted({r for g in (layout.tp_group, dp_group) for r in process_groups.members(g)})
    for with_cp in (False, True):
        group = ps.get_tensor_and_data_parallel_group(with_context_parallel=with_cp) if \
            ps.model_parallel_is_initialized() else None
        if group is not None and sorted(process_groups.members(group)) == wanted:
            return True, group
    raise ValueError(f"{user}: no process group holds exactly the tensor- and data-parallel ranks of the "
                     "distributed optimizer (parallel_state's tensor_and_data_parallel group differs)")


def grad_probe(ctx: StepContext, config: MonitorConfig, params: list[tuple[str, MegatronParameter, int]],
               mains: dict[int, MainParam], layout: GroupLayout, registry: HookRegistry) -> Collector | None:
    """The grad probe on what Megatron's torch optimizers step with: ``main.grad`` of each main parameter,
    in their step pre-hooks (after Megatron's unscaling and clipping), with Adam's ``exp_avg`` of it.

    A TP-partitioned parameter (``tensor_model_parallel``) is a block along ``partition_dim`` of the
    whole parameter; a distributed-optimizer main parameter is a range of that block; a parameter
    replicated over TP ranks is counted on TP rank 0 only. Pieces spread over ranks are combined by
    :class:`~trainmon.probe.sharded.ShardedGradProbe`; without TP or a sharded optimizer, every rank
    measures its own whole parameters with :class:`~trainmon.probe.collector.GradProbe`.
    Without an optimizer the probe is off (one warning).
    """
    from trainmon.probe.collector import GradProbe
    from trainmon.probe.shards import ShardSpec

    optimizers = list({id(m.optimizer): m.optimizer for m in mains.values()}.values())
    if not optimizers:
        logger.warning("trainmon: grad_probe on Megatron needs the optimizer (attach(chunks, optimizer)); it is off")
        return None
    hooks = _InnerStepHooks(optimizers)

    def grad_of(param: MegatronParameter) -> torch.Tensor | None:
        main = mains.get(id(param))
        return None if main is None or main.main.numel() == 0 else main.main.grad

    def exp_avg_of(param: MegatronParameter) -> torch.Tensor | None:
        main = mains.get(id(param))
        if main is None or main.main.numel() == 0:
            return None
        return (main.optimizer.state.get(main.main) or {}).get("exp_avg")

    sharded, group = _probe_group(mains, layout)
    if not sharded:
        return GradProbe(ctx, params, config, registry, hooks, grad_of=grad_of, exp_avg_of=exp_avg_of)

    def spec_of(param: MegatronParameter) -> ShardSpec:
        main = mains.get(id(param))
        start, numel = main.piece if main is not None and main.piece is not None else (0, param.numel())
        shape = list(param.shape)
        if layout.tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            dim = param.partition_dim
            length, shape[dim] = shape[dim], shape[dim] * layout.tp_size
            return ShardSpec.block(shape, dim, layout.tp_rank * length, length, start, numel)
        if layout.tp_rank > 0:
            return ShardSpec.flat(shape, 0, 0)  # replicated over TP: TP rank 0's copy counts
        return ShardSpec.flat(shape, start, numel)

    return ShardedGradProbe(ctx, params, config, registry, hooks, grad_of=grad_of, spec_of=spec_of,
                            exp_avg_of=exp_avg_of, group=group)


def _chunks_named(roots: Sequence[torch.nn.Module],
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


def _attach_torch_optimizer(ctx: StepContext, config: MonitorConfig, roots: list[torch.nn.Module],
                            named_modules: list[tuple[str, torch.nn.Module, int]],
                            chosen: Callable[[], list[tuple[str, MegatronParameter, int]]],
                            optimizer: torch.optim.Optimizer,
                            collectors: list[Collector], registry: HookRegistry, pp_stage: int,
                            tp_size: int = 1) -> Attachment:
    """Megatron-Core model chunks trained with a ``torch.optim`` optimizer.

    Under Megatron's DDP the gradients live in ``param.main_grad`` and ``param.grad`` stays None:
    the torch collectors then see no gradient, so that combination warns once.
    """
    from trainmon.collect.optimizer import TorchOptimizerCollector

    if any(hasattr(p, "main_grad") for root in roots for p in root.parameters()):
        logger.warning("trainmon: a torch optimizer over Megatron DDP chunks: gradients live in param.main_grad, "
                       "which a torch optimizer does not use; grad rows and grad_norm may be missing")
    if config.weight_grads.enabled or config.optimizer_states.enabled or config.params.enabled:
        collectors.append(TorchOptimizerCollector(ctx, chosen(), optimizer, config, registry))
    if config.grad_probe.enabled and tp_size > 1:
        logger.warning("trainmon: grad_probe over tensor-parallel chunks needs the Megatron optimizer (it knows "
                       "the partitions); with a torch optimizer it is off")
    elif config.grad_probe.enabled:
        from trainmon.probe.collector import GradProbe

        collectors.append(GradProbe(ctx, chosen(), config, registry, optimizer))
    rank, world_size = process_groups.layout()
    # the tensor-parallel power iterations all-reduce over the TP group: every rank collects the same steps
    split = any(getattr(c, "collective", False) for c in collectors)
    return Attachment(collectors=collectors, roots=[(root, vpp) for vpp, root in enumerate(roots)],
                      modules=named_modules, optimizer=optimizer, registry=registry, rank=rank,
                      world_size=world_size, pp_stage=pp_stage, collective=split)
