"""Fault injection under a real distributed framework: ``python fail_safe_run.py OUT FRAMEWORK KIND``.

FRAMEWORK is ``ddp``, ``fsdp2`` or ``megatron`` (2 ranks, gloo) or ``deepspeed`` (ZeRO-2, one rank); KIND a
fault of tests/faults.py. Each rank trains the same model twice from the same seed: without trainmon, then with a
monitor attached and trainmon's own exception injected into KIND's hook. It writes ``OUT/result_rank{R}.json``:
whether every parameter (this rank's shard or copy) is bit-identical after training, the warnings trainmon
logged, and the parts in ``failures.json``. The training loop is written as a user writes it; nothing is caught.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))  # mcore_cpu_shim (CPU-only test shim)

import torch
import torch.distributed as dist

from tests.faults import inject
from trainmon import TrainerMonitor

STEPS = 4


def ddp(monitor: TrainerMonitor | None) -> list[torch.Tensor]:
    from tests.models import TinyNet

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyNet())
    loop(model, monitor, log_mean=True)
    return [p.detach().clone() for p in model.parameters()]


def loop(model: torch.nn.Module, monitor: TrainerMonitor | None, log_mean: bool = False) -> None:
    """A user's loop: Adam, the rank's own batches; with ``log_mean`` the loss logged is the mean over the ranks (a
    collective of the user's, which trainmon's wrapper measures)."""
    from tests.models import batch, loss_fn

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if monitor is not None:
        monitor.attach(model, optimizer)
    for step in range(STEPS):
        loss = loss_fn(model, *batch(100 * dist.get_rank() + step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if log_mean:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        if monitor is not None:
            monitor.step(loss=loss)


def fsdp2(monitor: TrainerMonitor | None) -> list[torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    from tests.models import TinyNet

    torch.manual_seed(0)
    model = TinyNet()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    loop(model, monitor)
    return [p.to_local().detach().clone() for p in model.parameters()]


def megatron(monitor: TrainerMonitor | None) -> list[torch.Tensor]:
    import mcore_cpu_shim  # CPU-only test shim, as the other Megatron scripts
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    seed_all = mcore_cpu_shim.apply()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    seed_all()
    batch, seq, vocab, micro = 2, 16, 128, 2
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                   max_sequence_length=seq)
    chunk = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=True), module=gpt)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True),
                                       [chunk])
    if monitor is not None:
        monitor.attach([chunk], optimizer, grad_acc_steps=micro)

    def step_fn(data, model):
        tokens = next(data)
        pos = torch.arange(seq).expand(tokens.shape[0], seq)
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1).view(1, 1, seq, seq)
        output = model(tokens, pos, mask, labels=tokens.roll(-1, dims=1))
        return output, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
        data = iter([torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(micro)])
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(forward_step_func=step_fn, data_iterator=data, model=[chunk],
                                             num_microbatches=micro, seq_length=seq, micro_batch_size=batch,
                                             forward_only=False)
        optimizer.step()
        if monitor is not None:
            monitor.step(loss=torch.stack([x["loss"] for x in losses]).mean())
    params = [p.detach().clone() for p in chunk.parameters()]
    ps.destroy_model_parallel()
    return params


def deepspeed_zero2(monitor: TrainerMonitor | None) -> list[torch.Tensor]:
    import deepspeed

    from tests.models import TinyNet, batch, loss_fn

    torch.manual_seed(0)
    model = TinyNet()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if monitor is not None:
        monitor.attach(engine)
    for step in range(STEPS * 2):
        loss = loss_fn(engine, *batch(step))
        engine.backward(loss)
        engine.step()
        if monitor is not None:
            monitor.step(loss=loss)
    params = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return params


FRAMEWORKS = {"ddp": ddp, "fsdp2": fsdp2, "megatron": megatron, "deepspeed": deepspeed_zero2}


def main() -> None:
    out, framework, kind = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    if framework == "deepspeed":
        import deepspeed

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the 35-65 s JIT build
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    train = FRAMEWORKS[framework]
    try:
        expected = train(None)
        part = inject(kind, after=3).part
        warnings: list[str] = []
        catch = logging.Handler(logging.WARNING)
        catch.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("trainmon").addHandler(catch)
        monitor = TrainerMonitor({"output_dir": str(out), "run_name": "run", "sinks": ["csv"],
                                  "activations": {"enabled": framework != "megatron"},
                                  "communication": {"enabled": framework == "ddp"}})
        try:
            got = train(monitor)
        finally:
            monitor.close()
            logging.getLogger("trainmon").removeHandler(catch)
        failures = out / "run" / f"rank{rank}" / "failures.json"
        result = {"part": part, "identical": len(got) == len(expected) and all(
                      torch.equal(a, b) for a, b in zip(got, expected)),
                  "warnings": [w for w in warnings if "is off for the rest of this run" in w],
                  "failures": json.loads(failures.read_text()) if failures.exists() else None}
        (out / f"result_rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
