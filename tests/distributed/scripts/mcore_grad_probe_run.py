"""Train a tiny Megatron-Core GPTModel on CPU with the grad probe on; one case per run.

``python mcore_grad_probe_run.py OUT CASE_JSON`` on each rank (env:// rendezvous, tests/launch.py).
CASE: ``name``, ``tp``, ``pp``, ``vpp``, ``distopt``, ``level``. Writes the monitor's run to
``OUT/NAME/`` and, per rank, ``OUT/NAME/grads_rank{R}.npz``: the whole gradients (float64) that
Megatron's torch optimizers stepped with, for the parameters of the rank's pipeline stage, captured
in the script's own step pre-hook on those optimizers (each rank's ``main.grad`` piece, placed by
the distributed optimizer's range and concatenated over TP ranks along ``partition_dim``; a
TP-replicated parameter taken from TP rank 0), keyed ``{step}|{vpp}|{name}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import mcore_cpu_shim

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

B, S, V, M, STEPS = 2, 16, 128, 2, 3     # micro-batch, sequence, vocab, micro-batches, steps
BOUNDS = [-0.01, 0.0, 0.01]


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's micro-batches: the global micro-batch of 2*B samples split over DP ranks."""
    g = torch.Generator().manual_seed(1000 + step)
    data = [torch.randint(0, V, (2 * B, S), generator=g) for _ in range(M)]
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = 2 * B // dp
    return [(t[rank * per:(rank + 1) * per], t[rank * per:(rank + 1) * per].roll(-1, dims=1)) for t in data]


def leaves(opt):
    return list(getattr(opt, "chained_optimizers", [opt]))


def pieces(opt, named: dict[str, torch.nn.Parameter]) -> dict[str, tuple[int, np.ndarray]]:
    """``key -> (start in the TP-local flattening, float64 piece)``: the gradients the torch optimizers step with."""
    by_id = {id(p): key for key, p in named.items()}
    out = {}
    for leaf in leaves(opt):
        if hasattr(leaf, "shard_fp32_groups"):  # DistributedOptimizer: fp32 shards of this rank's ranges
            for models, shards in zip(leaf.model_fp32_groups, leaf.shard_fp32_groups):
                for param, shard in zip(models, shards):
                    held = leaf._get_model_param_range_map(param)["param"]
                    out[by_id[id(param)]] = (held.start, shard.grad.detach().double().numpy().copy())
        else:  # FP32Optimizer: the parameters themselves
            for group in leaf.optimizer.param_groups:
                for param in group["params"]:
                    out[by_id[id(param)]] = (0, param.grad.detach().double().numpy().ravel().copy())
    return out


def assemble(everyone: list[dict], named: dict[str, torch.nn.Parameter], tp: int) -> dict[str, np.ndarray]:
    """Whole gradients of this stage's parameters from every rank's pieces (independent of trainmon)."""
    me_pp = ps.get_pipeline_model_parallel_rank()
    out = {}
    for key, param in named.items():
        by_tp: dict[int, np.ndarray] = {}
        for entry in everyone:
            if entry["pp"] != me_pp or key not in entry["pieces"]:
                continue
            local = by_tp.setdefault(entry["tp"], np.full(param.numel(), np.nan))
            start, values = entry["pieces"][key]
            local[start:start + values.size] = values
        parts = [by_tp[r].reshape(param.shape) for r in range(tp)]
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            whole = np.concatenate(parts, axis=param.partition_dim)
        else:
            whole = parts[0]
        assert not np.isnan(whole).any(), key
        out[key] = whole
    return out


def main() -> None:
    out, case = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    tp, pp, vpp, distopt = case.get("tp", 1), case.get("pp", 1), case.get("vpp"), case.get("distopt", False)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp)
    seed_all()
    cfg = TransformerConfig(num_layers=2 * (vpp or 1), hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=True, tensor_model_parallel_size=tp,
                            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                            hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32)
    cfg.finalize_model_grads_func = finalize_model_grads  # the DP reduction, as Megatron-LM's training.py sets it
    chunks, named = [], {}
    for stage in range(vpp or 1):
        kw = dict(vp_stage=stage, pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                  post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)) if vpp else dict(
                  pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
        gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=V,
                       max_sequence_length=S, **kw)
        named.update({f"{stage}|{n}": p for n, p in gpt.named_parameters()})
        chunks.append(DDP(config=cfg, ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=distopt, grad_reduce_in_fp32=True), module=gpt, disable_bucketing=stage > 0))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1e6,
                                                 use_distributed_optimizer=distopt, adam_eps=1e-8), chunks)
    monitor = TrainerMonitor({
        "output_dir": str(out), "run_name": case["name"], "sinks": ["csv"], "weight_grads": {"enabled": False},
        "optimizer_states": {"enabled": False},
        "grad_probe": {"enabled": True, "level": case.get("level", "L2"), "bounds": BOUNDS, "scalars": "param"}})
    monitor.attach(chunks, opt, grad_acc_steps=M)
    captured: dict[str, tuple[int, np.ndarray]] = {}
    handles = [leaf.optimizer.register_step_pre_hook(lambda *a: captured.update(pieces(opt, named)))
               for leaf in leaves(opt)]
    refs: dict[str, np.ndarray] = {}
    for step in range(STEPS):
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
        get_forward_backward_func()(forward_step_func=step_fn, data_iterator=data, model=chunks, num_microbatches=M,
                                    seq_length=S, micro_batch_size=2 * B // ps.get_data_parallel_world_size(),
                                    forward_only=False)
        captured.clear()
        ok, _, _ = opt.step()
        assert ok
        monitor.step()
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"pp": ps.get_pipeline_model_parallel_rank(),
                                          "tp": ps.get_tensor_model_parallel_rank(), "pieces": captured})
        for key, whole in assemble(everyone, named, tp).items():
            refs[f"{step}|{key}"] = whole
    for handle in handles:
        handle.remove()
    monitor.close()
    np.savez(out / case["name"] / f"grads_rank{dist.get_rank()}.npz", **refs)
    ps.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
