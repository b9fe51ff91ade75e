"""transformers.Trainer with trainmon's one-line callback: a randomly initialised GPT-2 on random tokens,
gradient accumulation, clipping, evaluation every 2 steps, with and without gradient checkpointing; padded
causal-LM batches (items per micro-batch differ) with accumulation 2 and 4, with and without
``average_tokens_across_devices``, a model without ``**kwargs`` (no ``num_items_in_batch``); 2 gloo processes;
DeepSpeed ZeRO-2 and ZeRO-3.
References: the Trainer's own log (``trainer.state.log_history``: its loss and pre-clip grad_norm), the
gradients the optimizer used (the test's own callback, float64; DeepSpeed's ``safe_get_full_grad`` /
``safe_get_full_optimizer_state``) and the loss recomputed in float64 numpy from the logits and labels the
model really used (the test's own forward hook, ``tests/trainers/hf_common.py``)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from tests.launch import ROOT, run_ranks  # noqa: E402
from tests.reference import read_family  # noqa: E402
from tests.trainers.hf_common import (  # noqa: E402
    LossReference,
    NoKwargsLM,
    PaddedTokens,
    expected_losses,
    gpt2,
    trainer_counts_every_label,
)
from trainmon.errors import UnsupportedSetupError  # noqa: E402
from trainmon.tools.store import open_run  # noqa: E402
from trainmon.trainers.hf import TrainmonCallback  # noqa: E402

SCRIPT = ROOT / "tests" / "trainers" / "scripts" / "hf_train.py"

STEPS, ACC = 4, 2


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _Reference(transformers.TrainerCallback):
    """The test's own record: gradients right before optimizer.step (after clipping), per step."""

    def __init__(self) -> None:
        self.used: dict[int, dict[str, np.ndarray]] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.used[state.global_step + 1] = {n: p.grad.detach().double().numpy().copy()
                                            for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_trainer_with_the_callback(tmp_path, checkpointing):
    """With ``gradient_checkpointing``, the blocks' forwards re-run in the backward: measured once, not twice."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    losses: list[float] = []
    handle = model.register_forward_hook(
        lambda m, a, out: losses.append(float(out.loss)) if m.training and torch.is_grad_enabled() else None)
    monitor_config = {"output_dir": str(tmp_path / "tm"), "run_name": "run", "sinks": ["csv"],
                      "activations": {"enabled": True, "metrics": ["norm"]},
                      "targets": {"modules": ["transformer.h.0.mlp", "transformer.h.0.mlp.c_fc",
                                              "transformer.h.0.attn"]},
                      "weight_grads": {"metrics": ["norm", "min", "max", "mean"]}}
    reference = _Reference()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=STEPS, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, gradient_accumulation_steps=ACC, learning_rate=1e-3, max_grad_norm=0.05,
        logging_steps=1, eval_strategy="steps", eval_steps=2, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0, seed=0, gradient_checkpointing=checkpointing)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(64, 1), eval_dataset=_Tokens(8, 2),
                                   callbacks=[TrainmonCallback(monitor_config), reference])
    trainer.train()
    handle.remove()
    rank_dir = tmp_path / "tm" / "run" / "rank0"
    scalars = read_family(rank_dir, "scalars").pivot(index="step", columns="name", values="value")
    assert list(scalars.index) == list(range(1, STEPS + 1))  # the Trainer's global_step numbering
    hf_norms = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e}
    hf_losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    assert any("eval_loss" in e for e in trainer.state.log_history)  # evaluation ran in between
    reduced = read_family(rank_dir, "grad_reduced")
    for step in range(1, STEPS + 1):
        assert np.isclose(scalars.loc[step, "grad_norm"], hf_norms[step], rtol=1e-4), step
        assert hf_norms[step] > 0.05  # clipping was active; trainmon's grad_norm is the pre-clip one
        assert np.isclose(scalars.loc[step, "loss"], hf_losses[step], rtol=1e-6), step  # what the Trainer logs
        # no padding, every row as long: the step's token mean is the mean of its micro-batches' token means
        assert np.isclose(scalars.loc[step, "loss"], np.mean(losses[(step - 1) * ACC: step * ACC]) * ACC, rtol=1e-5)
        at = reduced[reduced.step == step].set_index("name")
        used = reference.used[step]
        assert len(at) == len(used) > 10
        for name, grad in used.items():
            assert np.isclose(at.loc[name, "norm"], np.linalg.norm(grad), rtol=1e-4, atol=1e-8), (step, name)
            assert np.isclose(at.loc[name, "max"], grad.max(), rtol=1e-4, atol=1e-8), (step, name)
    actv = read_family(rank_dir, "actv")
    mlp = actv[actv.name == "transformer.h.0.mlp.output"]
    assert sorted(set(mlp.step)) == list(range(1, STEPS + 1))
    assert all(sorted(group.micro_step) == [0, 1] for _, group in mlp.groupby("step"))  # no evaluation rows
    # checkpointing re-runs attn and c_fc (not mlp: torch stops the re-run early) in the backward: no second row
    assert set(actv.name) >= {"transformer.h.0.attn.output", "transformer.h.0.mlp.c_fc.output"}
    assert not actv.duplicated(["step", "micro_step", "name"]).any()


def _train_padded(tmp_path, model, acc: int, avg_tokens: bool, steps: int = 3):
    """Train on padded causal-LM rows with the callback and the test's own loss and gradient references."""
    reference, losses = _Reference(), LossReference(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=acc, learning_rate=1e-3, max_grad_norm=0.05, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
        average_tokens_across_devices=avg_tokens)
    monitor_config = {"output_dir": str(tmp_path / "tm"), "run_name": "run", "sinks": ["csv"],
                      "weight_grads": {"metrics": ["norm"]}, "optimizer_states": {"enabled": False}}
    trainer = transformers.Trainer(model=model, args=args, train_dataset=PaddedTokens(128, 1),
                                   callbacks=[TrainmonCallback(monitor_config), reference])
    trainer.train()
    losses.handle.remove()
    rank_dir = tmp_path / "tm" / "run" / "rank0"
    scalars = read_family(rank_dir, "scalars").pivot(index="step", columns="name", values="value")
    return trainer, scalars, losses.micro, reference, rank_dir


@pytest.mark.parametrize("avg_tokens", [True, False], ids=["avg-tokens", "local-tokens"])
@pytest.mark.parametrize("acc", [2, 4])
def test_loss_is_the_trainers_logged_loss(tmp_path, acc, avg_tokens):
    """GPT-2 takes ``num_items_in_batch``: the Trainer divides each micro-batch's summed token loss by the items of
    the whole accumulated batch; trainmon's ``loss`` is the token mean over the step, as logged, not a 1/acc part."""
    torch.manual_seed(0)
    trainer, scalars, micro, reference, rank_dir = _train_padded(tmp_path, gpt2(), acc, avg_tokens)
    counts = [count for _, count, _ in micro]
    assert len(set(counts[:acc])) > 1  # the padding makes the micro-batches' items differ
    logged = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    want = expected_losses([micro], acc, normalised=True, across_ranks=avg_tokens,
                           every_label=trainer_counts_every_label(trainer.model))
    assert list(scalars.index) == [e["step"] for e in logged] == [1, 2, 3]
    for entry, want_loss in zip(logged, want):
        step = entry["step"]
        assert np.isclose(scalars.loc[step, "loss"], entry["loss"], rtol=1e-6), (step, entry["loss"])
        assert np.isclose(scalars.loc[step, "loss"], want_loss, rtol=1e-5), (step, want_loss)
        assert np.isclose(scalars.loc[step, "grad_norm"], entry["grad_norm"], rtol=1e-5), step
        assert entry["grad_norm"] > 0.05  # clipping was active: trainmon's grad_norm is the pre-clip one
    _assert_grads_used(rank_dir, reference)


def test_loss_of_a_model_without_loss_kwargs(tmp_path):
    """A forward without ``**kwargs`` gets no ``num_items_in_batch``: the Trainer logs the mean of the micro-batches'
    mean losses (each divided by the accumulation steps, then summed)."""
    torch.manual_seed(0)
    acc = 4
    trainer, scalars, micro, reference, rank_dir = _train_padded(tmp_path, NoKwargsLM(), acc, True)
    assert trainer.model_accepts_loss_kwargs is False
    logged = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    want = expected_losses([micro], acc, normalised=False, across_ranks=True)
    for entry, want_loss in zip(logged, want, strict=True):
        assert np.isclose(scalars.loc[entry["step"], "loss"], entry["loss"], rtol=1e-6)
        assert np.isclose(scalars.loc[entry["step"], "loss"], want_loss, rtol=1e-5)
        assert np.isclose(scalars.loc[entry["step"], "grad_norm"], entry["grad_norm"], rtol=1e-5)
    _assert_grads_used(rank_dir, reference)


def _assert_grads_used(rank_dir, reference: _Reference) -> None:
    reduced = read_family(rank_dir, "grad_reduced")
    for step, used in reference.used.items():
        at = reduced[reduced.step == step].set_index("name")
        assert len(at) == len(used)
        for name, grad in used.items():
            assert np.isclose(at.loc[name, "norm"], np.linalg.norm(grad), rtol=1e-4, atol=1e-8), (step, name)


def test_data_parallel_in_one_process_is_refused(tmp_path):
    """``torch.nn.DataParallel`` (the Trainer on several GPUs in one process) runs hooks once per replica: refused at
    train begin, naming the alternative. (Needs several GPUs to happen for real: called with such arguments.)"""
    from types import SimpleNamespace

    callback = TrainmonCallback({"output_dir": str(tmp_path), "sinks": []})
    args = SimpleNamespace(n_gpu=2, gradient_accumulation_steps=1)
    with pytest.raises(UnsupportedSetupError, match="DataParallel.*one process per GPU"):
        callback.on_train_begin(args, SimpleNamespace(global_step=0), None, model=gpt2(), optimizer=None)
    assert callback.monitor is None


def _read_case(run) -> tuple[list[dict], pd.DataFrame]:
    refs = [json.loads(path.read_text()) for path in sorted(run.glob("ref_rank*.json"))]
    return refs, read_family(run / "tm" / "run" / "rank0", "scalars").pivot(index="step", columns="name",
                                                                               values="value")


def _run_case(tmp_path, case: dict, world_size: int):
    run_ranks([SCRIPT, tmp_path, json.dumps(case)], world_size=world_size, timeout=300.0)
    return tmp_path / case["name"]


@pytest.mark.slow
@pytest.mark.parametrize("avg_tokens", [True, False], ids=["avg-tokens", "local-tokens"])
def test_two_processes_log_the_mean_over_processes(tmp_path, avg_tokens):
    """2 gloo processes (DDP), accumulation 2, padded rows: every rank's ``loss`` is the Trainer's logged loss, the
    mean over the processes (with ``average_tokens_across_devices``: the token mean over both ranks' items)."""
    acc = 2
    run = _run_case(tmp_path, {"name": "ddp", "acc": acc, "avg_tokens": avg_tokens}, world_size=2)
    refs, _ = _read_case(run)
    every_label = trainer_counts_every_label(gpt2())
    want = expected_losses([ref["micro"] for ref in refs], acc, normalised=True, across_ranks=avg_tokens,
                           every_label=every_label)
    local = expected_losses([refs[0]["micro"]], acc, normalised=True, across_ranks=True, every_label=every_label)
    assert not np.allclose(want, local, rtol=1e-3)  # the ranks' data differ: a rank-local loss would not pass
    for rank, ref in enumerate(refs):
        scalars = read_family(run / "tm" / "run" / f"rank{rank}", "scalars").pivot(index="step", columns="name",
                                                                                     values="value")
        logged = [e for e in ref["log_history"] if "loss" in e and "grad_norm" in e]
        assert [e["step"] for e in logged] == list(scalars.index) == [1, 2, 3]
        for entry, want_loss in zip(logged, want):
            step = entry["step"]
            assert np.isclose(scalars.loc[step, "loss"], entry["loss"], rtol=1e-6), (rank, step)
            assert np.isclose(scalars.loc[step, "loss"], want_loss, rtol=1e-5), (rank, step)
            assert np.isclose(scalars.loc[step, "grad_norm"], entry["grad_norm"], rtol=1e-5), (rank, step)
        # The Trainer wrapped the model in DDP: the reduced gradient, the same on both ranks, is written once
        # (by rank 0) and read back for each rank from the store.
        assert not (run / "tm" / "run" / "rank1" / "grad_reduced.csv").exists()
        assert not (run / "tm" / "run" / "store" / "grad_reduced" / "rank=1").exists()
        with open_run(run / "tm" / "run") as connection:
            reduced = connection.execute("SELECT step, name, norm FROM grad_reduced WHERE rank = ?",
                                         [rank]).df().set_index(["step", "name"])
        for step, used in ref["grads"].items():
            for name, norm in used.items():
                assert np.isclose(reduced.loc[(int(step), name), "norm"], norm, rtol=1e-4, atol=1e-8), (rank, name)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3], ids=["zero2", "zero3"])
def test_deepspeed_zero(tmp_path, zero):
    """``TrainingArguments(deepspeed={... stage 2/3})``, one process, accumulation 2, clipping active: the callback
    attaches to the Trainer's DeepSpeedEngine. ``grad_reduced`` equals DeepSpeed's ``safe_get_full_grad`` read at
    the start of ``engine.step()`` (before DeepSpeed clips), ``exp_avg`` its ``safe_get_full_optimizer_state``
    after the step, ``loss`` and ``grad_norm`` the Trainer's log."""
    acc = 2
    run = _run_case(tmp_path, {"name": f"z{zero}", "acc": acc, "avg_tokens": True, "zero": zero}, world_size=1)
    (ref,), scalars = _read_case(run)
    logged = [e for e in ref["log_history"] if "loss" in e and "grad_norm" in e]
    want = expected_losses([ref["micro"]], acc, normalised=True, across_ranks=True,
                           every_label=trainer_counts_every_label(gpt2()))
    assert [e["step"] for e in logged] == list(scalars.index) == [1, 2, 3]
    for entry, want_loss in zip(logged, want):
        step = entry["step"]
        assert np.isclose(scalars.loc[step, "loss"], entry["loss"], rtol=1e-6), step
        assert np.isclose(scalars.loc[step, "loss"], want_loss, rtol=1e-5), step
        assert np.isclose(scalars.loc[step, "grad_norm"], entry["grad_norm"], rtol=1e-5), step
        assert entry["grad_norm"] > 0.05  # DeepSpeed clipped: the logged norm is its pre-clip one
    rank_dir = run / "tm" / "run" / "rank0"
    for family, key in (("grad_reduced", "grads"), ("exp_avg", "exp_avg")):
        table = read_family(rank_dir, family).set_index(["step", "name"])
        assert len(ref[key]) == 3
        for step, norms in ref[key].items():
            assert len(norms) > 10
            for name, norm in norms.items():
                assert np.isclose(table.loc[(int(step), name), "norm"], norm, rtol=1e-4, atol=1e-9), (family, name)


@pytest.mark.parametrize("kind", ["loss_hook", "optimizer_pre_hook", "step_end"])
def test_a_failure_of_trainmon_inside_the_trainer_never_reaches_train(tmp_path, monkeypatch, caplog, kind):
    """Fail-safe: trainmon's own exception in the callback's loss hook (part ``loss``), an optimizer hook or the
    end of a step (part ``weights``) during ``trainer.train()``: training completes, the weights are bit-identical
    to a run without trainmon, one warning names the part."""
    import logging

    from tests.faults import patched
    from trainmon.trainers.hf import TrainerLoss

    def train(callbacks):
        torch.manual_seed(0)
        model = gpt2()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "hf"), max_steps=4, per_device_train_batch_size=4,
            gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
            use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
        transformers.Trainer(model=model, args=args, train_dataset=PaddedTokens(64, 1), callbacks=callbacks).train()
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    expected = train([])
    if kind == "loss_hook":
        original = TrainerLoss._hook

        def failing(self, *args, **kwargs):
            raise RuntimeError("injected fault in TrainerLoss._hook")

        monkeypatch.setattr(TrainerLoss, "_hook", failing)
        assert original is not failing
        part = "loss"
    else:
        part = patched(monkeypatch, kind, after=2).part
    config = {"output_dir": str(tmp_path / "tm"), "run_name": "run", "sinks": ["csv"]}
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        got = train([TrainmonCallback(config)])
    for name, param in expected.items():
        assert torch.equal(got[name], param), name
    warnings = [r.getMessage() for r in caplog.records if "is off for the rest of this run" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"trainmon: {part} failed"), warnings
