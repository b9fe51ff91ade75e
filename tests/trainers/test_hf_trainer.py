"""transformers.Trainer with trainmon's one-line callback: a randomly initialised GPT-2 on random tokens,
gradient accumulation, clipping, evaluation every 2 steps, with and without gradient checkpointing.
References: the Trainer's own log (its pre-clip grad_norm), the gradients the optimizer used (the test's
own callback, float64) and the losses the model returned (the test's own forward hook)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from tests.reference import read_family  # noqa: E402
from trainmon.integrations.hf import TrainmonCallback  # noqa: E402

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
    assert any("eval_loss" in e for e in trainer.state.log_history)  # evaluation ran in between
    reduced = read_family(rank_dir, "grad_reduced")
    for step in range(1, STEPS + 1):
        assert np.isclose(scalars.loc[step, "grad_norm"], hf_norms[step], rtol=1e-4), step
        assert hf_norms[step] > 0.05  # clipping was active; trainmon's grad_norm is the pre-clip one
        want_loss = np.mean(losses[(step - 1) * ACC: step * ACC])
        assert np.isclose(scalars.loc[step, "loss"], want_loss, rtol=1e-5)
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
