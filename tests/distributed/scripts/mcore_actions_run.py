"""Dump and free benchmark on a tiny Megatron-Core GPTModel on CPU (2 gloo ranks), case after case.

``OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 mcore_actions_run.py OUT CASE [CASE ...]``

- ``tp2``: TP=2, the monitor's default families (activations off), ``anomaly.actions: [jsonl, dump,
  free_benchmark]``. A hand-made dump of ``decoder.layers.1`` and its neighbours at step 1 (the clean
  reference for msprobe's compare) and a hand-made free benchmark at step 1; from step 2 on a NaN is
  injected into the output of ``decoder.layers.1.mlp`` on both TP ranks (Megatron skips those steps: a
  constant loss scale), so the first origin is the loss, the dump localises the MLP at step 3 and dumps
  it at step 4.
- ``vpp2``: PP=2 with two virtual stages and full activation recomputation: a hand-made dump of
  ``decoder.layers.0`` in both chunks and a free benchmark of its MLP at step 1.

Per rank the script writes ``OUT/CASE/info_rank{R}.json``: its parallel ranks, the warnings trainmon
logged, the free-benchmark results, and float64 references of the tensors the dump describes (captured
by the script's own hooks): the MLP's output and its fc1 weight shard at step 1.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
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
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from trainmon import TrainerMonitor  # noqa: E402

CASES = {"tp2": dict(tp=2, pp=1, steps=5), "vpp2": dict(tp=1, pp=2, vpp=2, steps=2, recompute=True)}
B, S, V, M = 2, 16, 128, 2          # micro-batch, sequence, vocab, micro-batches
INJECT_FROM = 2


def stats(a: torch.Tensor) -> dict[str, float]:
    x = a.detach().double().numpy().ravel()
    return {"Max": float(x.max()), "Min": float(x.min()), "Mean": float(x.mean()),
            "Norm": float(np.sqrt((x * x).sum()))}


def run_case(name: str, out: Path, tp: int, pp: int, steps: int, vpp: int | None = None,
             recompute: bool = False) -> None:
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp)
    seed_all()
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    cfg = TransformerConfig(num_layers=2 * (vpp or 1), hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=True, tensor_model_parallel_size=tp,
                            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                            hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32, **extra)
    gpts, chunks = [], []
    for stage in range(vpp or 1):
        kw = dict(vp_stage=stage, pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                  post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)) if vpp else dict(
                  pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
        gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=V,
                       max_sequence_length=S, **kw)
        gpts.append(gpt)
        chunks.append(DDP(config=cfg, ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True),
                          module=gpt, disable_bucketing=stage > 0))
    cfg.finalize_model_grads_func = finalize_model_grads
    # A constant loss scale: Megatron skips a step whose gradients are not finite (the weights stay clean).
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1e6, loss_scale=1.0,
                                                 use_distributed_optimizer=True), chunks)
    monitor = TrainerMonitor({
        "output_dir": str(out), "run_name": name, "sinks": ["csv"],
        "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl", "dump", "free_benchmark"]},
        "dump": {"enabled": True, "mode": "tensor", "depth": 1},
        "free_benchmark": {"enabled": True, "pert_mode": "add_noise"},
    })
    warnings: list[str] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainmon").addHandler(catch)
    monitor.attach(chunks, opt, grad_acc_steps=M)
    refs: dict[str, dict] = {}
    handles = []
    gpt = gpts[0]
    if name == "tp2":
        monitor.dump(["decoder.layers.1", "decoder.layers.1.mlp", "decoder.layers.1.mlp.linear_fc*"], steps=[1])
        # linear_fc1 (column-parallel) computes locally; the MLP all-reduces linear_fc2's output over TP ranks
        monitor.free_benchmark(["decoder.layers.1.mlp.linear_fc1", "decoder.layers.1.mlp"], steps=[1])
        state = {"step": 0}

        def inject(module, args, output):
            if state["step"] < INJECT_FROM:
                return None
            first = output[0].clone()
            first.view(-1)[0] = float("nan")
            return (first,) + tuple(output[1:])

        def probe(module, args, output):
            if state["step"] == 1:
                refs.setdefault("mlp_output", []).append(stats(output[0]))

        mlp = gpt.get_submodule("decoder.layers.1.mlp")
        handles += [mlp.register_forward_hook(inject, prepend=True), mlp.register_forward_hook(probe)]
        refs["fc1_weight"] = {}
    else:
        monitor.dump(["decoder.layers.0"], steps=[1])
        monitor.free_benchmark(["decoder.layers.0.mlp"], steps=[1])
        state = {"step": 0}
    for step in range(steps):
        state["step"] = step
        if name == "tp2" and step == 1:  # the fc1 shard the step-1 dump describes (before its update)
            refs["fc1_weight"] = stats(gpt.get_submodule("decoder.layers.1.mlp.linear_fc1").weight)
        data = [iter(batches(step)) for _ in chunks] if vpp else iter(batches(step))

        def step_fn(it, mod):
            tok, labels = next(it)
            pos = torch.arange(S).expand(tok.shape[0], S)
            mask = torch.ones(S, S, dtype=torch.bool).triu(1).view(1, 1, S, S)
            return mod(tok, pos, mask, labels=labels), lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

        for chunk in chunks:
            chunk.zero_grad_buffer()
        opt.zero_grad()
        losses = get_forward_backward_func()(forward_step_func=step_fn, data_iterator=data, model=chunks,
                                             num_microbatches=M, seq_length=S, micro_batch_size=B, forward_only=False)
        opt.step()
        monitor.step(loss=torch.stack([x["loss"] for x in losses]).mean() if losses else None)
    for handle in handles:
        handle.remove()
    bench = monitor._session.actions["free_benchmark"]
    results = [(r.step, r.name, r.vpp_stage, r.output_index, r.max_rel, r.passed) for r in bench.results]
    localisations = [vars(found) | {"key": None} for found in monitor._session.actions["dump"].localisations]
    monitor.close()
    logging.getLogger("trainmon").removeHandler(catch)
    for chunk in chunks:  # close() leaves no hook behind
        for module in chunk.modules():
            assert not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks), module
        for p in chunk.parameters():
            assert not getattr(p, "_post_accumulate_grad_hooks", None), "parameter hook left behind"
    info = {"tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "warnings": warnings, "free_benchmark": results, "localisations": localisations, "refs": refs}
    (out / name / f"info_rank{dist.get_rank()}.json").write_text(json.dumps(info, default=str))
    ps.destroy_model_parallel()


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(M):
        tok = torch.randint(0, V, (B, S), generator=g)
        out.append((tok, tok.roll(-1, dims=1)))
    return out


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
