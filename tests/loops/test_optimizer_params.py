"""Which parameters get weight-gradient and optimizer rows: every one the optimizer steps with (also an MoE
expert that got no tokens in the last micro-step), and none it does not hold (frozen LoRA bases). References
are the test's own float64 copies of the gradients, parameters and states the optimizer used."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.loops.common import assert_rows_match, config, global_norm, rows, scalars
from tests.reference import METRICS
from trainmon import TrainerMonitor


class _TwoExperts(nn.Module):
    """A router-free MoE stand-in: each sample goes to the expert its ``route`` says; an expert that gets
    no sample in a micro-batch gets no gradient in that micro-step (as an expert without tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.experts = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            chosen = route == i
            if bool(chosen.any()):
                out = out + torch.where(chosen[:, None], expert(h), 0.0)
        return self.head(out)


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 2, generator=g)
    # the last micro-step sends every sample to expert 0: expert 1 has only micro-step 0's gradient
    route = torch.zeros(6, dtype=torch.long) if micro == 1 else torch.arange(6) % 2
    return x, y, route


def _grads64(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: p.grad.detach().double().numpy() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("per_micro_step", [False, True], ids=["last-micro-step", "per-micro-step"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads-set-to-none", "grads-zeroed"])
def test_an_expert_without_tokens_in_the_last_micro_step_has_its_rows(tmp_path, per_micro_step, set_to_none):
    torch.manual_seed(0)
    model = _TwoExperts()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = config(tmp_path, weight_grads={"metrics": METRICS, "per_micro_step": per_micro_step})
    monitor = TrainerMonitor(cfg).attach(model, optimizer, grad_acc_steps=2)
    accumulated: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    for step in range(3):
        for micro in range(2):
            x, y, route = _batch(step, micro)
            (torch.nn.functional.mse_loss(model(x, route), y) / 2).backward()
            accumulated[(step, micro)] = _grads64(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        monitor.step()
    monitor.close()
    assert "experts.1.weight" in accumulated[(0, 1)]  # the optimizer stepped with expert 1's gradient
    unreduced, reduced = rows(tmp_path, "grad_unreduced"), rows(tmp_path, "grad_reduced")
    for step in range(3):
        assert_rows_match(reduced, step, accumulated[(step, 1)])
        for micro in (0, 1) if per_micro_step else (1,):
            assert_rows_match(unreduced, step, accumulated[(step, micro)], micro_step=micro)
        assert set(unreduced[unreduced.step == step].micro_step) == ({0, 1} if per_micro_step else {1})


class _LoRALinear(nn.Module):
    """A frozen base ``Linear`` plus a trainable low-rank adapter (what peft's LoRA layer computes)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # (peft zero-initialises it; non-zero gives gradients to A)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def lora_model(layers: int = 4, width: int = 32) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [_LoRALinear(width, width), nn.GELU()]
    return nn.Sequential(*blocks)


@pytest.mark.parametrize("handed", ["trainable-only", "all-parameters"])
def test_frozen_parameters_outside_the_optimizer_are_not_measured(tmp_path, handed):
    """``trainable-only``: the optimizer holds the adapters; ``all-parameters``: it holds every parameter, the
    frozen ones with ``requires_grad=False``. Either way only the adapters have rows, equal to float64."""
    torch.manual_seed(0)
    model = lora_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable if handed == "trainable-only" else model.parameters(), lr=1e-2)
    cfg = config(tmp_path, params={"enabled": True, "metrics": METRICS},
                 optimizer_states={"enabled": True, "states": ["exp_avg", "exp_avg_sq"], "metrics": METRICS})
    monitor = TrainerMonitor(cfg).attach(model, optimizer)
    used, params, states = {}, {}, {}
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 32, generator=g)
        model(x).square().mean().backward()
        used[step] = {n: p.grad.double().numpy() for n, p in model.named_parameters() if p.grad is not None}
        params[step] = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        states[step] = {n: optimizer.state[p]["exp_avg"].double().numpy().copy()
                        for n, p in model.named_parameters() if p.requires_grad}
        optimizer.zero_grad()
        monitor.step()
    monitor.close()
    adapters = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert adapters and all("lora" in n for n in adapters)
    for family in ("grad_unreduced", "grad_reduced", "param", "exp_avg", "exp_avg_sq"):
        assert sorted(set(rows(tmp_path, family).name)) == adapters, family
    for step in range(3):
        assert_rows_match(rows(tmp_path, "grad_unreduced"), step, used[step])
        assert_rows_match(rows(tmp_path, "grad_reduced"), step, used[step])
        assert_rows_match(rows(tmp_path, "param"), step, params[step])
        assert_rows_match(rows(tmp_path, "exp_avg"), step, states[step])


def test_a_parameter_unfrozen_later_has_its_rows_again(tmp_path):
    """All parameters in the optimizer, the base frozen for the first step (a freeze-then-unfreeze schedule):
    step 0 has only the adapters' rows, step 1 every parameter's, each equal to float64."""
    torch.manual_seed(0)
    model = lora_model(layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = config(tmp_path, params={"enabled": True, "metrics": METRICS})
    monitor = TrainerMonitor(cfg).attach(model, optimizer)
    used, params = {}, {}
    for step in range(2):
        if step == 1:
            model.requires_grad_(True)
        model(torch.randn(8, 32, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        used[step] = {n: p.grad.double().numpy() for n, p in model.named_parameters() if p.grad is not None}
        params[step] = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()
    monitor.close()
    assert len(used[0]) < len(used[1]) == len(list(model.parameters()))
    for step in range(2):
        for family in ("grad_unreduced", "grad_reduced"):
            assert_rows_match(rows(tmp_path, family), step, used[step])
        assert_rows_match(rows(tmp_path, "param"), step, params[step])



@pytest.mark.parametrize("interval", [1, 2], ids=["every_step", "change_on_an_uncollected_step"])
def test_parameters_added_with_add_param_group_have_their_rows(tmp_path, interval):
    """Progressive unfreezing: the optimizer starts with the head only; at step 3 the backbone is unfrozen and handed
    to it with ``add_param_group`` (its own lr), a StepLR on both groups. Before, the backbone had no
    ``grad_unreduced``, ``grad_reduced``, ``param`` or ``exp_avg`` rows (the optimizer's parameters were read once, at
    attach), while ``grad_norm`` counted it: now every parameter the optimizer steps has its rows, equal to float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    cfg = config(tmp_path, step_interval=interval, params={"enabled": True, "metrics": METRICS},
                 optimizer_states={"enabled": True, "states": ["exp_avg"], "metrics": METRICS})
    monitor = TrainerMonitor(cfg).attach(model, optimizer)
    used, params, states, lrs = {}, {}, {}, {}
    for step in range(6):
        if step == 3:
            model[0].requires_grad_(True)
            optimizer.add_param_group({"params": list(model[0].parameters()), "lr": 1e-3})
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        used[step] = {n: p.grad.double().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
        params[step] = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters() if p.requires_grad}
        lrs[step] = [group["lr"] for group in optimizer.param_groups]
        optimizer.step()
        states[step] = {n: optimizer.state[p]["exp_avg"].double().numpy().copy()
                        for n, p in model.named_parameters() if p in optimizer.state}
        optimizer.zero_grad()
        scheduler.step()
        monitor.step()
    monitor.close()
    assert len(used[2]) == 2 and len(used[3]) == 4
    values = scalars(tmp_path)
    for step in range(0, 6, interval):
        for family in ("grad_unreduced", "grad_reduced"):
            assert_rows_match(rows(tmp_path, family), step, used[step])
        assert_rows_match(rows(tmp_path, "param"), step, params[step])
        assert_rows_match(rows(tmp_path, "exp_avg"), step, states[step])
        assert values.loc[step, "grad_norm"] == pytest.approx(global_norm(used[step]), rel=1e-5)
        for i, lr in enumerate(lrs[step]):
            assert values.loc[step, f"lr/group{i}"] == pytest.approx(lr)
