"""The step guard under Megatron-Core, against runs that leave the poisoned batch out (``anomaly.guard``), and its
adapter to Megatron's rerun state machine.

``python mcore_guard_run.py OUT CASE`` on 1 or 2 ranks (env:// rendezvous, tests/launch.py; a world of one without
it). CASE is a JSON object ``{"name", "tp", "distopt", "bf16", "chained", "runs": [...]}``. One process trains a tiny
GPTModel (no dropout) several times from the same seed, as Megatron-LM's ``train_step`` does: ``zero_grad_buffer``,
the pipeline schedule over ``M`` micro-batches, ``optimizer.step()``, and an ``OptimizerParamScheduler`` stepped only
when ``update_successful``. The runs (``BAD`` is the poisoned step):

- ``reference``: at ``BAD`` no forward, backward or step (the user's way to leave a batch out); ``reference_stop``:
  stops before ``BAD``; ``clean``: every step, no poison.
- ``nan`` / ``spike``: guarded; at ``BAD`` one entry of ``decoder.layers.1.mlp.linear_fc2.weight``'s gradient of the
  last micro-batch is NaN on the last rank / every micro-batch's loss x10 on rank 0; ``unguarded_*``: the same
  without trainmon.
- ``rerun_*``: guarded, with :class:`~trainmon.integrations.megatron.rerun.RerunValidation` in the
  ``should_run_forward_backward`` loop and the state machine in ``validate_results`` mode (``disabled`` for
  ``rerun_disabled_nan``): ``transient_*`` poisons the first run of ``BAD`` only, ``persistent_*`` (and
  ``rerun_spike``) every run of it. A requested exit (``should_checkpoint_and_exit``) ends the run, with its code.

Per rank it writes ``OUT/<name>/result_rank{R}.json``: per run, the tensors (model parameters, every leaf optimizer's
main parameters, every tensor of its torch optimizer's state, the learning rates) that differ from each reference
(``torch.equal``), the ``update_successful`` of each step, the exit code requested, and an error raised.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import mcore_cpu_shim  # CPU-only test shim, shared with examples/megatron_gpt.py

seed_all = mcore_cpu_shim.apply()

if "RANK" not in os.environ:  # no launcher: a world of one on a free port
    with socket.socket() as _sock:
        _sock.bind(("127.0.0.1", 0))
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_sock.getsockname()[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core import rerun_state_machine as rsm_module  # noqa: E402
from megatron.core.distributed import DistributedDataParallel as DDP  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from trainmon import TrainerMonitor  # noqa: E402
from trainmon.integrations.megatron.rerun import RerunValidation  # noqa: E402

# The rerun state machine saves and restores the CUDA RNG state: there is none on CPU (test-only, as the shim).
torch.cuda.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
torch.cuda.set_rng_state = lambda *a, **k: None

B, S, V, M, STEPS, BAD = 2, 16, 128, 2, 9, 6     # micro-batch, sequence, vocab, micro-batches, steps, poisoned step
GUARD = {"enabled": True, "window": 8, "warmup": 4}
NAN_PARAM = "decoder.layers.1.mlp.linear_fc2.weight"


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's micro-batches of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    data = [torch.randint(0, V, (2 * B, S), generator=g) for _ in range(M)]
    per = 2 * B // dp
    return [(t[rank * per:(rank + 1) * per], t[rank * per:(rank + 1) * per].roll(-1, dims=1)) for t in data]


def leaves(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def build(case: dict):
    seed_all()
    bf16 = case.get("bf16", False)
    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            tensor_model_parallel_size=case.get("tp", 1), hidden_dropout=0.0, attention_dropout=0.0,
                            pipeline_dtype=dtype, bf16=bf16, params_dtype=dtype)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=V, max_sequence_length=S)
    if not case.get("ddp", True):
        return gpt, gpt, torch.optim.Adam(gpt.parameters(), lr=1e-3), None
    model = DDP(config=cfg, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=case.get("distopt", False), grad_reduce_in_fp32=True),
        module=Float16Module(cfg, gpt) if bf16 else gpt)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, bf16=bf16, loss_scale=case.get("loss_scale"),
                                 use_distributed_optimizer=case.get("distopt", False))
    optimizer = get_megatron_optimizer(opt_config, [model])
    if not case.get("chained", True) and len(leaves(optimizer)) == 1:
        optimizer = leaves(optimizer)[0]  # a bare leaf, as some loops hold it
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=3,
                                        lr_decay_steps=STEPS, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=STEPS, wd_incr_style="constant")
    return gpt, model, optimizer, scheduler


def train(case: dict, out: str, run: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    rerun = run.startswith("rerun_")
    if rerun:
        mode = rsm_module.RerunMode.DISABLED if "disabled" in run else rsm_module.RerunMode.VALIDATE_RESULTS
        rsm_module.initialize_rerun_state_machine(mode=mode)
    gpt, model, optimizer, scheduler = build(case)
    monitor = validation = None
    if run in ("nan", "spike", "failing_spike") or rerun:
        monitor = TrainerMonitor({"output_dir": out, "run_name": f"{case['name']}_{run}", "sinks": ["csv"],
                                  "step_interval": 2, "anomaly": {"guard": GUARD, "actions": ["jsonl"]}})
        monitor.attach([model], optimizer, grad_acc_steps=M)
        if rerun:
            validation = RerunValidation(optimizer)
    poison = "nan" if "nan" in run else "spike" if "spike" in run else ""
    successes: list[bool] = []
    norms: list[list[float]] = []
    result: dict = {"exit_code": None, "error": None, "norms": norms}
    first_runs: list[bool] = []
    try:
        for step in range(STEPS):
            if run == "reference" and step == BAD:
                continue
            if run == "reference_stop" and step == BAD:
                break
            machine = rsm_module.get_rerun_state_machine() if rerun else None
            while machine is None or machine.should_run_forward_backward(None):
                first = machine is None or machine.state == rsm_module.RerunState.INITIAL_RUN
                first_runs.append(first)
                poisoned = poison and step == BAD and ("transient" not in run or first)
                handles = []
                if poisoned and poison == "nan" and rank == world - 1:
                    target = dict(gpt.named_parameters())[NAN_PARAM]
                    micro = {"count": 0}

                    def nan_in_last(grad, micro=micro):
                        micro["count"] += 1
                        if micro["count"] < M:
                            return grad
                        grad = grad.clone()
                        grad.view(-1)[0] = float("nan")
                        return grad

                    handles.append(target.register_hook(nan_in_last))
                factor = 10.0 if poisoned and poison == "spike" and rank == 0 else 1.0
                data = iter(batches(step))

                def step_fn(it, mod, factor=factor):
                    tok, labels = next(it)
                    pos = torch.arange(S).expand(tok.shape[0], S)
                    mask = torch.ones(S, S, dtype=torch.bool).triu(1).view(1, 1, S, S)
                    output = mod(tok, pos, mask, labels=labels)
                    return output, lambda o: (o.float().mean() * factor, {"loss": o.float().mean().detach()})

                model.zero_grad_buffer()
                optimizer.zero_grad()
                get_forward_backward_func()(forward_step_func=step_fn, data_iterator=data, model=[model],
                                            num_microbatches=M, seq_length=S,
                                            micro_batch_size=2 * B // ps.get_data_parallel_world_size(),
                                            forward_only=False)
                for handle in handles:
                    handle.remove()
                if validation is not None:
                    validation.validate()
                if machine is None:
                    break
            if machine is not None:
                should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()
                if should_exit:
                    result["exit_code"] = exit_code
                    break
            update_successful, grad_norm, _ = optimizer.step()
            successes.append(bool(update_successful))
            if monitor is not None and update_successful and grad_norm is not None:
                verdict = monitor._session.step_guard.verdict  # this step's, until monitor.step() takes it
                if verdict is not None:  # (none once a failing guard is off)
                    norms.append([verdict[6], float(grad_norm)])  # the guard's global norm, Megatron's (pre-clip)
            if update_successful:  # Megatron-LM's train_step: the schedule advances on applied steps only
                scheduler.step(increment=1)
            if monitor is not None:
                monitor.step()
    except RuntimeError as exc:  # the rerun state machine's own (validate_result, disabled mode, fatal)
        result["error"] = str(exc)
    finally:
        if monitor is not None:
            monitor.close()
            monitor.close()
        if rerun:
            rsm_module.destroy_rerun_state_machine()
    assert "prepare_grads" not in optimizer.__dict__, "the step guard left its wrapper behind"
    result.update(successes=successes, first_runs=first_runs, tensors=state(gpt, optimizer))
    return result


def state(gpt, optimizer) -> dict[str, torch.Tensor]:
    tensors = {f"model/{name}": p.detach().clone() for name, p in gpt.named_parameters()}
    for li, leaf in enumerate(leaves(optimizer)):
        if hasattr(leaf, "shard_fp32_groups"):  # DistributedOptimizer: this rank's fp32 shards
            mains = [m for groups in (leaf.shard_fp32_groups, leaf.shard_fp32_from_float16_groups)
                     for group in groups for m in group]
        elif hasattr(leaf, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params: fp32 copies
            mains = [m for groups in (leaf.fp32_from_float16_groups, leaf.fp32_from_fp32_groups)
                     for group in groups for m in group]
        else:  # FP32Optimizer: the parameters themselves
            mains = [p for group in leaf.optimizer.param_groups for p in group["params"]]
        for i, main in enumerate(mains):
            tensors[f"main/{li}/{i}"] = main.detach().clone()
        for i, values in enumerate(leaf.optimizer.state.values()):
            for key, value in values.items():
                tensors[f"state/{li}/{i}/{key}"] = torch.as_tensor(value).clone()
        tensors[f"lr/{li}"] = torch.tensor([group["lr"] for group in leaf.optimizer.param_groups],
                                           dtype=torch.float64)
    return tensors


SYNCS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")


def host_reads(case: dict, out: str, guarded: bool) -> list[int]:
    """Per step, the host-synchronising tensor calls of the whole training step (Megatron's own included), with a
    monitor that collects only step 0 and the guard on or off (``numpy()`` of a CPU tensor is a view, not counted)."""
    gpt, model, optimizer, _ = build(case)
    monitor = TrainerMonitor({"output_dir": out, "run_name": f"{case['name']}_reads_{guarded}", "sinks": ["csv"],
                              "step_interval": 1000, "anomaly": {"guard": {**GUARD, "enabled": guarded}}})
    monitor.attach([model], optimizer, grad_acc_steps=M)
    counts: list[int] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}
    inside = [False]  # the CPU shim's TorchFunctionMode dispatches a method again: one call, counted once

    def counting(name):
        def call(tensor, *args, **kwargs):
            if inside[0]:
                return originals[name](tensor, *args, **kwargs)
            counts[-1] += 1
            inside[0] = True
            try:
                return originals[name](tensor, *args, **kwargs)
            finally:
                inside[0] = False
        return call

    def step_fn(it, mod):
        tok, labels = next(it)
        pos = torch.arange(S).expand(tok.shape[0], S)
        mask = torch.ones(S, S, dtype=torch.bool).triu(1).view(1, 1, S, S)
        output = mod(tok, pos, mask, labels=labels)
        return output, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    try:
        for step in range(4):
            counts.append(0)
            for name in SYNCS:
                setattr(torch.Tensor, name, counting(name))
            try:
                model.zero_grad_buffer()
                optimizer.zero_grad()
                losses = get_forward_backward_func()(forward_step_func=step_fn, data_iterator=iter(batches(step)),
                                                     model=[model], num_microbatches=M, seq_length=S,
                                                     micro_batch_size=2 * B // ps.get_data_parallel_world_size(),
                                                     forward_only=False)
                optimizer.step()
                monitor.step(loss=torch.stack([x["loss"] for x in losses]).mean())  # the loss goes every step
            finally:
                for name, original in originals.items():
                    setattr(torch.Tensor, name, original)
    finally:
        monitor.close()
    return counts


def refusals(out: str) -> dict[str, str]:
    """What attach says to set-ups the guard cannot hold back exactly (and to one it can: a torch optimizer over
    chunks without Megatron's DDP, guarded by the torch guard)."""
    from trainmon.errors import UnsupportedSetupError

    messages = {}
    for name in ("loss_scale", "torch_optimizer_over_ddp", "torch_optimizer"):
        gpt, model, optimizer, _ = build({"bf16": name == "loss_scale", "ddp": name != "torch_optimizer",
                                          "loss_scale": 1024.0 if name == "loss_scale" else None})
        if name == "torch_optimizer_over_ddp":
            optimizer = torch.optim.Adam(gpt.parameters(), lr=1e-3)
        chunks = [model]
        monitor = TrainerMonitor({"output_dir": out, "run_name": f"refused_{name}", "anomaly": {"guard": GUARD}})
        try:
            monitor.attach(chunks, optimizer)
            messages[name] = "not refused"
            monitor.close()
        except UnsupportedSetupError as exc:
            messages[name] = str(exc)
        assert "prepare_grads" not in optimizer.__dict__ and "step" not in optimizer.__dict__
    _, _, optimizer, _ = build({})
    try:  # the rerun source needs the guard attached
        RerunValidation(optimizer)
        messages["rerun_without_guard"] = "accepted"
    except ValueError as exc:
        messages["rerun_without_guard"] = str(exc)
    return messages


def main() -> None:
    out, case = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=case.get("tp", 1))
    try:
        runs = {}
        for run in case["runs"]:
            if run != "failing_spike":
                runs[run] = train(case, out, run)
                continue
            from tests.faults import FAULTS, inject

            fault = FAULTS["megatron_step_guard"]
            owner = getattr(importlib.import_module(fault.module), fault.owner)
            original = getattr(owner, fault.attribute)
            inject("megatron_step_guard", after=BAD + 1)  # the decision of step BAD raises
            try:
                runs[run] = train(case, out, run)
            finally:
                setattr(owner, fault.attribute, original)
        tensors = {run: got.pop("tensors") for run, got in runs.items()}
        references = [run for run in ("reference", "reference_stop", "clean", "unguarded_spike") if run in runs]
        for run, got in runs.items():
            mine = tensors[run]
            got["compared"] = len(mine)
            got["finite"] = all(bool(torch.isfinite(t).all()) for name, t in mine.items()
                                if name.startswith(("model/", "main/")))
            for reference in references:
                expected = tensors[reference]
                got[f"differ_{reference}"] = sorted(name for name in expected
                                                    if name not in mine or not torch.equal(mine[name], expected[name]))
        if case.get("refusals"):
            runs["refusals"] = refusals(out)
        if case.get("reads"):
            runs["host_reads"] = {"plain": host_reads(case, out, False), "guarded": host_reads(case, out, True)}
        Path(out, case["name"]).mkdir(parents=True, exist_ok=True)
        Path(out, case["name"], f"result_rank{dist.get_rank()}.json").write_text(json.dumps(runs, indent=1))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
