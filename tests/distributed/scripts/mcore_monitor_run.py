"""Train a tiny Megatron-Core GPTModel on CPU under TrainerMonitor, case after case in one process.

``OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 mcore_monitor_run.py OUT CASE [CASE ...]``

For each case it writes the monitor's run to ``OUT/CASE/`` and, per rank, independent float64
numpy references of the same quantities to ``OUT/CASE/refs_rank{R}.json``: the full unreduced
gradient (a snapshot of ``main_grad`` taken before ``finalize_model_grads`` reduces it, with the
TP shards concatenated), the reduced gradient (its mean over the DP ranks), Adam's ``exp_avg``,
``exp_avg_sq`` and update recomputed in numpy from those gradients, and activations captured by
the script's own hooks.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import mcore_cpu_shim  # CPU-only test shim, shared with examples/megatron_gpt.py

seed_all = mcore_cpu_shim.apply()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import DistributedDataParallel as DDP  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer import (  # noqa: E402
    OptimizerConfig,
    _get_megatron_optimizer_based_on_param_groups,
    _get_param_groups_and_buffers,
    get_megatron_optimizer,
)
from megatron.core.optimizer.optimizer import ChainedOptimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from tests.reference import precursors_np  # noqa: E402
from trainmon import TrainerMonitor  # noqa: E402
from trainmon.integrations.megatron.collect import MegatronParamCollector  # noqa: E402

CASES = {
    "tp1": dict(tp=1, pp=1),
    "tp1_distopt": dict(tp=1, pp=1, distopt=True),
    "tp1_distopt_overlap": dict(tp=1, pp=1, distopt=True, overlap=True),
    "tp1_bf16": dict(tp=1, pp=1, bf16=True, activations=True),
    # bf16 with the distributed optimizer (shard_fp32_from_float16_groups); attach gets a dp_group
    # with other ranks than the optimizer's: one warning, the optimizer's group is used.
    "tp1_distopt_bf16": dict(tp=1, pp=1, distopt=True, bf16=True, wrong_dp_group=True),
    # Megatron's bf16 default: main_grad (and its DP all-reduce) in bf16.
    "tp1_bf16_grad16": dict(tp=1, pp=1, bf16=True, grad_fp32=False),
    # tp_group / pp_group / dp_group passed to attach explicitly (fresh tp/pp group objects).
    "tp2": dict(tp=2, pp=1, distopt=True, explicit_groups=True),
    # TP=2 whose replicated parameters (layer norms, row-parallel biases, position embeddings) differ by 12% on TP
    # rank 1, as diverged replicas do: each rank's rows are its own replica's (the references are per rank)
    "tp2_diverged": dict(tp=2, pp=1, distopt=True, diverge=True),
    # Constant loss scale 1: Megatron skips a step with non-finite gradients, so the faults of
    # step 1 (stage 1 forward) do not poison the weights of step 2 (stage 0 backward).
    "pp2": dict(tp=1, pp=2, distopt=True, loss_scale=1.0, activations=True, inject=True, steps=3,
                explicit_groups=True),
    "vpp2": dict(tp=1, pp=2, vpp=2, activations=True, recompute=True),
    # A ChainedOptimizer of two FP32Optimizers (weight-decayed parameters, the others), as tp1 otherwise.
    "tp1_chained": dict(tp=1, pp=1, chained=True),
}
B, S, V, M, STEPS = 2, 16, 128, 2, 2          # micro-batch, sequence, vocab, micro-batches, steps
INJECT_FORWARD_STEP, INJECT_BACKWARD_STEP = 1, 2   # pp2: NaN in stage 1's forward, in stage 0's backward
BETAS, EPS = (0.9, 0.999), 1e-8


def np_stats(a: np.ndarray, eps: float = 1e-8) -> dict[str, float]:
    a = np.asarray(a, dtype=np.float64).ravel()
    return {"norm": float(np.sqrt(np.sum(a * a))), "min": float(np.min(a)), "max": float(np.max(a)),
            "mean": float(np.mean(a)), "zeros": float(np.mean(np.abs(a) < eps)),
            "nans": float(np.isnan(a).sum()), "infs": float(np.isinf(a).sum())}


def full(tensor: torch.Tensor, param: torch.nn.Parameter) -> np.ndarray:
    """The whole tensor of a TP-partitioned parameter (shards concatenated), as float64."""
    t = tensor.detach().float()
    if getattr(param, "tensor_model_parallel", False) and ps.get_tensor_model_parallel_world_size() > 1:
        parts = [torch.empty_like(t) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
        t = torch.cat(parts, dim=param.partition_dim)
    return t.numpy().astype(np.float64)


def fresh_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new group object with the ranks of ``group`` (every rank creates every such group, in order)."""
    mine = dist.get_process_group_ranks(group)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    result = None
    for ranks in sorted({tuple(r) for r in everyone}):
        new = dist.new_group(list(ranks))
        if list(ranks) == mine:
            result = new
    return result


def chained_optimizer(config: OptimizerConfig, chunks: list) -> ChainedOptimizer:
    """Megatron's own parameter groups, one FP32Optimizer per group, chained (get_megatron_optimizer
    makes one optimizer per group of model chunks / expert parameters; these are its building blocks)."""
    groups, _ = _get_param_groups_and_buffers(chunks, model_chunk_offset=0, config=config, config_overrides=None,
                                              filter_fn=lambda g: True, buffer_name="buffers")
    assert len(groups) == 2, [len(g["params"]) for g in groups]
    return ChainedOptimizer([_get_megatron_optimizer_based_on_param_groups(
        config, chunks, [group], model_parallel_group=ps.get_model_parallel_group()) for group in groups])


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's micro-batches: the global micro-batch of 2*B samples is split over DP ranks."""
    g = torch.Generator().manual_seed(1000 + step)
    data = [torch.randint(0, V, (2 * B, S), generator=g) for _ in range(M)]
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = 2 * B // dp
    out = []
    for tokens in data:
        tok = tokens[rank * per:(rank + 1) * per]
        out.append((tok, tok.roll(-1, dims=1)))
    return out


def run_case(name: str, out: Path, tp: int, pp: int, vpp: int | None = None, distopt: bool = False,
             bf16: bool = False, activations: bool = False, inject: bool = False, recompute: bool = False,
             overlap: bool = False, grad_fp32: bool = True, loss_scale: float | None = None, steps: int = STEPS,
             explicit_groups: bool = False, wrong_dp_group: bool = False, chained: bool = False,
             diverge: bool = False) -> None:
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp)
    seed_all()
    dtype = torch.bfloat16 if bf16 else torch.float32
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    cfg = TransformerConfig(num_layers=2 * (vpp or 1), hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=True, tensor_model_parallel_size=tp,
                            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                            hidden_dropout=0.0, attention_dropout=0.0,  # runs with other layouts compare
                            pipeline_dtype=dtype, bf16=bf16, params_dtype=dtype, **extra)
    gpts, chunks = [], []
    for stage in range(vpp or 1):
        kw = dict(vp_stage=stage, pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                  post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)) if vpp else dict(
                  pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
        gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=V,
                       max_sequence_length=S, **kw)
        inner = Float16Module(cfg, gpt) if bf16 else gpt
        gpts.append(gpt)
        chunks.append(DDP(config=cfg, ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=distopt, grad_reduce_in_fp32=grad_fp32, overlap_grad_reduce=overlap),
            module=inner, disable_bucketing=stage > 0))
    gpt = gpts[0]
    if diverge and ps.get_tensor_model_parallel_rank() == 1:  # before the optimizer copies its main parameters
        with torch.no_grad():
            for p in gpt.parameters():
                if not getattr(p, "tensor_model_parallel", False):
                    p.mul_(1.12).add_(0.01)  # + 0.01: layer-norm biases start at 0
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=bf16, clip_grad=1e6,
                                 use_distributed_optimizer=distopt, adam_eps=EPS, loss_scale=loss_scale)
    opt = get_megatron_optimizer(opt_config, chunks) if not chained else chained_optimizer(opt_config, chunks)
    if distopt and bf16:  # the fp32 shards of bf16 parameters are what trainmon must find
        assert any(group for leaf in opt.chained_optimizers for group in leaf.shard_fp32_from_float16_groups)
    params = {f"{stage}|{pname}": p for stage, g in enumerate(gpts) for pname, p in g.named_parameters()}
    snapshot: dict[str, torch.Tensor] = {}

    def finalize(*args, **kwargs):
        for pname, p in params.items():   # reference: main_grad before any DP reduction
            snapshot[pname] = p.main_grad.detach().clone()
        return finalize_model_grads(*args, **kwargs)

    cfg.finalize_model_grads_func = finalize
    if overlap:  # as Megatron-LM's training.py: reduce only after the last micro-batch's backward
        cfg.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else [c.no_sync for c in chunks]
    run_dir = out / name
    monitor = TrainerMonitor({
        "output_dir": str(out), "run_name": name, "sinks": ["csv"],
        "activations": {"enabled": activations},
        "params": {"enabled": True}, "optimizer_states": {"precursors": True},
        "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl"]},
    })
    groups: dict = {}
    if explicit_groups:  # fresh group objects with parallel_state's ranks: identity shows which one is used
        groups = dict(tp_group=fresh_group(ps.get_tensor_model_parallel_group()),
                      pp_group=fresh_group(ps.get_pipeline_model_parallel_group()),
                      dp_group=ps.get_data_parallel_group())
    elif wrong_dp_group:  # this rank alone, not the optimizer's 2-rank group
        groups = dict(dp_group=ps.get_tensor_model_parallel_group())
    warnings: list[str] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainmon").addHandler(catch)
    try:
        monitor.attach(chunks, opt, grad_acc_steps=M, **groups)
    finally:
        logging.getLogger("trainmon").removeHandler(catch)
    (collector,) = [c for c in monitor._session.attachment.collectors if isinstance(c, MegatronParamCollector)]
    used_tp_group = collector.layout.tp_group is groups["tp_group"] if explicit_groups else None
    state = {"step": 0, "forwards": 0}

    def injector(module, args, output):
        """NaN in stage 1's forward (micro-step 0) at one step, in stage 0's backward (micro-step 1) at the next."""
        micro, state["forwards"] = state["forwards"], state["forwards"] + 1
        stage = ps.get_pipeline_model_parallel_rank()
        if stage == 1 and micro == 0 and state["step"] == INJECT_FORWARD_STEP:
            out0 = output[0].clone()
            out0.view(-1)[0] = float("nan")
            return (out0,) + tuple(output[1:])
        if stage == 0 and micro == 1 and state["step"] == INJECT_BACKWARD_STEP:
            output[0].register_hook(lambda grad: grad.clone().fill_(float("nan")))
        return None

    captured: dict[str, list[np.ndarray]] = {}
    handles = []
    if activations or bf16:   # the script's own activation capture (the independent reference)
        for mname, row in (("decoder.layers.0", "decoder.layers.0.output"),
                           ("decoder.layers.0.mlp", "decoder.layers.0.mlp.output.0")):
            def probe(module, args, output, row=row):
                t = output[0] if isinstance(output, tuple) else output
                captured.setdefault(f"0|{row}", []).append(t.detach().float().numpy().astype(np.float64))
            handles.append(gpt.get_submodule(mname).register_forward_hook(probe))
    if inject:  # prepended: the monitor's hooks see the injected NaN (and hook the NaN gradient after it)
        handles.append(gpt.get_submodule("decoder.layers.0.mlp" if ps.get_pipeline_model_parallel_rank() == 1
                                         else "decoder.layers.0").register_forward_hook(injector, prepend=True))
    refs: dict[str, dict] = {}
    m = {n: 0.0 for n in params}
    v = {n: 0.0 for n in params}
    skipped = []
    for step in range(steps):
        state["step"], state["forwards"] = step, 0
        captured.clear()
        data = [iter(batches(step)) for _ in chunks] if vpp else iter(batches(step))

        def step_fn(it, mod):
            tok, labels = next(it)
            pos = torch.arange(S).expand(tok.shape[0], S)
            mask = torch.ones(S, S, dtype=torch.bool).triu(1).view(1, 1, S, S)
            output = mod(tok, pos, mask, labels=labels)
            return output, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

        for chunk in chunks:
            chunk.zero_grad_buffer()
        opt.zero_grad()
        losses = get_forward_backward_func()(forward_step_func=step_fn, data_iterator=data, model=chunks,
                                             num_microbatches=M, seq_length=S,
                                             micro_batch_size=2 * B // ps.get_data_parallel_world_size(),
                                             forward_only=False)
        ok, grad_norm, _ = opt.step()
        loss = torch.stack([x["loss"] for x in losses]).mean() if losses else None
        monitor.step(loss=loss)
        step_refs: dict[str, dict] = {f: {} for f in ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq",
                                                      "update", "ratio", "actv", "precursors")}
        dp_group, dp = ps.get_data_parallel_group(), ps.get_data_parallel_world_size()
        if not ok:  # skipped for non-finite gradients: no optimizer hook ran, Adam's state is unchanged
            skipped.append(step)
        for pname, p in params.items():
            unreduced = full(snapshot[pname], p)
            step_refs["grad_unreduced"][pname] = np_stats(unreduced)
            if not ok:
                continue
            summed = torch.from_numpy(unreduced.copy())
            dist.all_reduce(summed, group=dp_group)
            reduced = summed.numpy() / dp
            m[pname] = BETAS[0] * m[pname] + (1 - BETAS[0]) * reduced
            v[pname] = BETAS[1] * v[pname] + (1 - BETAS[1]) * reduced ** 2
            update = (m[pname] / (1 - BETAS[0] ** (step + 1))) / (
                np.sqrt(v[pname] / (1 - BETAS[1] ** (step + 1))) + EPS)
            after = full(p, p)
            step_refs["grad_reduced"][pname] = np_stats(reduced)
            step_refs["exp_avg"][pname] = np_stats(m[pname])
            step_refs["exp_avg_sq"][pname] = np_stats(v[pname])
            step_refs["update"][pname] = np_stats(update)
            step_refs["ratio"][pname] = np_stats(np.where(after != 0, update / np.where(after != 0, after, 1), 0))
            step_refs["precursors"][pname] = precursors_np(reduced, m[pname], v[pname], after, step + 1, BETAS, EPS,
                                                           opt.param_groups[0]["lr"])
        for mname, outs in captured.items():  # mname: the row name
            for micro, array in enumerate(outs):
                step_refs["actv"][f"{mname}|{micro}"] = np_stats(array)
        step_refs["grad_norm"] = grad_norm
        refs[str(step)] = step_refs
    for handle in handles:
        handle.remove()
    monitor.close()
    monitor.close()
    assert "step" not in opt.__dict__, "the optimizer's step wrapper was not undone"
    for chunk in chunks:  # close() leaves no hook behind (Megatron's own DDP hooks are on grad accumulators)
        for module in chunk.modules():
            assert not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks), module
        for p in chunk.parameters():
            assert not getattr(p, "_post_accumulate_grad_hooks", None), "parameter hook left behind"
    for leaf in getattr(opt, "chained_optimizers", [opt]):
        assert not (leaf.optimizer._optimizer_step_pre_hooks or leaf.optimizer._optimizer_step_post_hooks)
    with open(run_dir / f"refs_rank{dist.get_rank()}.json", "w") as f:
        json.dump({"pp_stage": ps.get_pipeline_model_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
                   "dp_rank": ps.get_data_parallel_rank(), "steps": refs, "skipped": skipped,
                   "warnings": warnings, "used_tp_group": used_tp_group}, f)
    ps.destroy_model_parallel()


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    try:
        for name in sys.argv[2:]:
            run_case(name, out, **CASES[name])
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
