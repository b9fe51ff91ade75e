"""Every statistics family of a plain torch run equals an independent numpy float64 reference."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.models import InPlaceMLP, TinyNet, TwoOutputsNet, batch, loss_fn
from tests.reference import METRICS, adam_update_np, assert_close, np_stats, read_family
from trainmon import TrainerMonitor

ALL = {"enabled": True, "metrics": METRICS}


def _capture_activations(model: torch.nn.Module, store: dict) -> list:
    """The test's own hooks (independent of trainmon) copying tensors to numpy."""
    handles = []
    for name, module in model.named_modules():
        if not name or isinstance(module, torch.nn.ModuleList):
            continue

        def fwd(mod, args, out, name=name):
            store.setdefault(f"{name}.output", []).append(out.detach().double().numpy().copy())
            if isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                store.setdefault(f"{name}.input", []).append(args[0].detach().double().numpy().copy())

        def bwd(mod, grad_in, grad_out, name=name):
            store.setdefault(f"{name}.output_grad", []).append(grad_out[0].double().numpy().copy())
            if grad_in[0] is not None:
                store.setdefault(f"{name}.input_grad", []).append(grad_in[0].double().numpy().copy())

        handles.append(module.register_forward_hook(fwd))
        handles.append(module.register_full_backward_hook(bwd))
    return handles


def test_every_family_matches_numpy(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    with torch.no_grad():
        model.layers[0].fc1.bias.zero_()  # exact zeros: exercises `zeros` and the ratio's param == 0 rule
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv", "tensorboard"],
              "tensorboard": {"per_tensor": True},
              "activations": ALL, "weight_grads": ALL, "params": ALL,
              "optimizer_states": {"metrics": METRICS, "states": ["exp_avg", "exp_avg_sq", "update", "ratio"]}}
    acts: dict[str, list[np.ndarray]] = {}
    ref: dict[tuple[str, str, int], np.ndarray] = {}
    monitor = TrainerMonitor(config).attach(model, optimizer)
    handles = _capture_activations(model, acts)
    losses = []
    for step in range(3):
        acts.clear()
        loss = loss_fn(model, *batch(step))
        loss.backward()
        for name, p in model.named_parameters():
            ref[("grad", name, step)] = p.grad.double().numpy().copy()
            ref[("param", name, step)] = p.detach().double().numpy().copy()
        optimizer.step()
        for name, p in model.named_parameters():
            state = optimizer.state[p]
            ref[("exp_avg", name, step)] = state["exp_avg"].double().numpy().copy()
            ref[("exp_avg_sq", name, step)] = state["exp_avg_sq"].double().numpy().copy()
            update = adam_update_np(state["exp_avg"].numpy(), state["exp_avg_sq"].numpy(), float(step + 1),
                                    (0.9, 0.999), 1e-8)
            ref[("update", name, step)] = update
            pnp = p.detach().double().numpy()
            ref[("ratio", name, step)] = np.where(pnp != 0, update / np.where(pnp != 0, pnp, 1), 0.0)
        for key, arrays in acts.items():
            ref[("actv_capture", key, step)] = arrays[0]
        optimizer.zero_grad()
        monitor.step(loss=loss)
        losses.append(float(loss))
    for h in handles:
        h.remove()
    monitor.close()
    rank_dir = tmp_path / "run" / "rank0"

    # Weight gradients, parameters, optimizer states.
    for family, kind in [("grad_unreduced", "grad"), ("grad_reduced", "grad"), ("param", "param"),
                         ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("update", "update"),
                         ("ratio", "ratio")]:
        frame = read_family(rank_dir, family)
        assert list(frame.columns) == ["vpp_stage", "name", "step", "micro_step", *METRICS]
        assert len(frame) == 3 * len(list(model.parameters())), family
        for _, row in frame.iterrows():
            assert_close(row, np_stats(ref[(kind, row["name"], row["step"])]), METRICS, label=f"{family} {row['name']}")

    # Activations and activation gradients (forward inputs/outputs and full-backward grads).
    for family in ("actv", "actv_grad"):
        frame = read_family(rank_dir, family)
        checked = 0
        for _, row in frame.iterrows():
            key = ("actv_capture", row["name"], row["step"])
            if key in ref:
                assert_close(row, np_stats(ref[key]), METRICS, label=f"{family} {row['name']}")
                checked += 1
        assert checked >= 10, (family, checked)
    names = set(read_family(rank_dir, "actv")["name"])
    assert {"layers.1.fc2.output", "layers.1.fc2.input", "embed.output", "head.output"} <= names
    assert "layers.1.fc2.output_grad" in set(read_family(rank_dir, "actv_grad")["name"])

    # Scalars: loss, global grad norm, learning rate.
    scalars = read_family(rank_dir, "scalars")
    loss_rows = scalars[scalars["name"] == "loss"]
    np.testing.assert_allclose(loss_rows["value"].to_numpy(), losses, rtol=1e-6)
    grad_norm = scalars[(scalars["name"] == "grad_norm") & (scalars["step"] == 2)]["value"].item()
    want = np.sqrt(sum(np.sum(ref[("grad", n, 2)] ** 2) for n, _ in model.named_parameters()))
    assert np.isclose(grad_norm, want, rtol=1e-5)
    assert scalars[scalars["name"] == "lr/group0"]["value"].tolist() == [1e-2] * 3

    # TensorBoard: tags {family}/{name}/{metric}, read back with tensorboard's reader.
    events = EventAccumulator(str(rank_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "grad_reduced/layers.0.fc1.weight/norm" in tags and "scalars/loss" in tags
    tb = [e.value for e in events.Scalars("grad_reduced/layers.0.fc1.weight/norm")]
    csv_norms = read_family(rank_dir, "grad_reduced").query("name == 'layers.0.fc1.weight'")["norm"].tolist()
    np.testing.assert_allclose(tb, csv_norms, rtol=1e-6)
    # the overview beside them (tests/integration/test_tensorboard_overview.py checks it against numpy)
    tb_max = [e.value for e in events.Scalars("grad_reduced/norm_max")]
    np.testing.assert_allclose(tb_max, read_family(rank_dir, "grad_reduced").groupby("step")["norm"].max(), rtol=1e-6)
    assert (tmp_path / "run" / "run.json").exists()


def test_gradient_accumulation_rows_per_micro_step(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = {"output_dir": str(tmp_path), "run_name": "acc", "sinks": ["csv"], "targets": {"modules": ["head"]},
              "activations": {"enabled": True, "metrics": ["norm"]},
              "weight_grads": {"metrics": METRICS, "per_micro_step": True},
              "optimizer_states": {"states": ["momentum"], "metrics": METRICS}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer, grad_acc_steps=2)
        for step in range(2):
            grads = []
            for micro in range(2):
                (loss_fn(model, *batch(10 * step + micro)) / 2).backward()
                grads.append(model.head.weight.grad.double().numpy().copy())
            optimizer.step()
            momentum = optimizer.state[model.head.weight]["momentum_buffer"].double().numpy()
            optimizer.zero_grad()
            monitor.step()
    rank_dir = tmp_path / "acc" / "rank0"
    actv = read_family(rank_dir, "actv")
    assert sorted(set(zip(actv["step"], actv["micro_step"]))) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    unreduced = read_family(rank_dir, "grad_unreduced").query("name == 'head.weight' and step == 1")
    assert unreduced["micro_step"].tolist() == [0, 1]
    for micro, grad in enumerate(grads):  # the accumulated gradient after each micro-step
        assert_close(unreduced.iloc[micro], np_stats(grad), METRICS, label=f"grad_unreduced micro {micro}")
    reduced = read_family(rank_dir, "grad_reduced").query("name == 'head.weight' and step == 1")
    assert reduced["micro_step"].tolist() == [1]
    assert_close(reduced.iloc[0], np_stats(grads[-1]), METRICS, label="grad_reduced")
    mom = read_family(rank_dir, "momentum").query("name == 'head.weight' and step == 1")
    assert_close(mom.iloc[0], np_stats(momentum), METRICS, label="momentum")


def test_bf16_statistics_accumulate_in_float32(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16)
    x = torch.randn(256, 64).to(torch.bfloat16)
    config = {"output_dir": str(tmp_path), "run_name": "bf16", "sinks": ["csv"],
              "activations": ALL, "weight_grads": {"enabled": False}, "optimizer_states": {"enabled": False}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model)
        out = model(x)
        monitor.step()
    row = read_family(tmp_path / "bf16" / "rank0", "actv").query("name == '0.output'").iloc[0]
    expected = np_stats(out.detach().float().numpy())
    assert_close(row, expected, ["norm", "mean", "min", "max"], rtol=1e-4)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _grad_rows(tmp_path, run: str) -> dict[tuple[str, int], object]:
    frame = read_family(tmp_path / run / "rank0", "actv_grad")
    assert (frame["micro_step"] == 0).all()
    return {(row["name"], row["step"]): row for _, row in frame.iterrows()}


@pytest.mark.parametrize(("grad_hooks", "targets"), [("tensor", ["fc1", "fc2"]), ("module", ["*"])])
def test_in_place_relu_trains_and_output_grads_match_float64(tmp_path, caplog, grad_hooks, targets):
    """ReLU(inplace=True) after a target: ``tensor`` hooks work; ``module`` falls back when the ReLU is a target."""
    torch.manual_seed(0)
    model = InPlaceMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"output_dir": str(tmp_path), "run_name": "inplace", "sinks": ["csv"], "targets": {"modules": targets},
              "activations": {**ALL, "grad_hooks": grad_hooks}, "optimizer_states": {"enabled": False}}
    ref: dict[tuple[str, int], np.ndarray] = {}
    with caplog.at_level(logging.WARNING, logger="trainmon"), TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for step in range(3):
            x, target = torch.randn(32, 8), torch.randn(32, 4)
            # Independent reference: a float64 copy without in-place ops, gradients by retain_grad.
            weights = {name: p.detach().double().requires_grad_() for name, p in model.named_parameters()}
            z = torch.nn.functional.linear(x.double(), weights["fc1.weight"], weights["fc1.bias"])
            h = torch.relu(z)
            out = torch.nn.functional.linear(h, weights["fc2.weight"], weights["fc2.bias"])
            for tensor in (z, h, out):
                tensor.retain_grad()
            _mse(out, target.double()).backward()
            for name, tensor in [("fc1.output_grad", z), ("act.input_grad", z), ("act.output_grad", h),
                                 ("fc2.input_grad", h), ("fc2.output_grad", out)]:
                ref[(name, step)] = tensor.grad.numpy().copy()
            _mse(model(x), target).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    assert ("using grad_hooks: tensor" in caplog.text) == (grad_hooks == "module")
    rows = _grad_rows(tmp_path, "inplace")
    expected = {"fc1.output_grad", "fc2.input_grad", "fc2.output_grad"}
    if grad_hooks == "module":
        expected |= {"act.input_grad", "act.output_grad"}
    assert expected <= {name for name, _ in rows}
    assert "fc1.input_grad" not in {name for name, _ in rows}  # the input is a leaf without gradient
    for (name, step), row in rows.items():
        if name in expected:
            assert_close(row, np_stats(ref[(name, step)]), METRICS, rtol=1e-5, atol=1e-7, label=f"{name} {step}")


@pytest.mark.parametrize("grad_hooks", ["module", "tensor"])
def test_gradient_rows_are_named_by_tuple_position(tmp_path, grad_hooks):
    """Output ``(a, b)``, gradient for ``b`` only: row ``.output_grad.1``, like ``b``'s forward row ``.output.1``."""
    torch.manual_seed(0)
    model = TwoOutputsNet()
    config = {"output_dir": str(tmp_path), "run_name": "pair", "sinks": ["csv"], "targets": {"modules": ["pair"]},
              "activations": {**ALL, "grad_hooks": grad_hooks}, "weight_grads": {"enabled": False},
              "optimizer_states": {"enabled": False}}
    x, target = torch.randn(16, 8), torch.randn(16, 8)
    ref_model = copy.deepcopy(model).double()
    projected = ref_model.proj(x.double())
    a, b = ref_model.pair(projected)
    projected.retain_grad()
    b.retain_grad()
    _mse(b, target.double()).backward()
    with TrainerMonitor(config) as monitor:
        monitor.attach(model)
        _mse(model(x), target).backward()
        monitor.step()
    forward_names = set(read_family(tmp_path / "pair" / "rank0", "actv")["name"])
    assert forward_names == {"pair.input", "pair.output.0", "pair.output.1"}
    rows = _grad_rows(tmp_path, "pair")
    assert set(rows) == {("pair.output_grad.1", 0), ("pair.input_grad", 0)}
    assert_close(rows[("pair.output_grad.1", 0)], np_stats(b.grad.numpy()), METRICS, label="output_grad.1")
    assert_close(rows[("pair.input_grad", 0)], np_stats(projected.grad.numpy()), METRICS, label="input_grad")


def test_bf16_global_grad_norm_accumulates_in_float32(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64)).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    config = {"output_dir": str(tmp_path), "run_name": "bf16norm", "sinks": ["csv"],
              "weight_grads": {"metrics": ["norm"]}, "optimizer_states": {"enabled": False}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        model(torch.randn(64, 256).to(torch.bfloat16)).float().square().mean().backward()
        grads = [p.grad.double().numpy() for p in model.parameters()]
        optimizer.step()
        monitor.step()
    scalars = read_family(tmp_path / "bf16norm" / "rank0", "scalars")
    got = scalars[scalars["name"] == "grad_norm"]["value"].item()
    want = np.sqrt(sum(np.sum(g * g) for g in grads))
    assert np.isclose(got, want, rtol=1e-5), (got, want)  # bf16 accumulation is off by ~1e-3


class _Mixer(torch.nn.Module):
    """Takes a tensor, a list of tensors and a kwargs tensor; returns a tuple with a dict inside."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.seen: dict[str, np.ndarray] = {}

    def forward(self, x, pair, *, scale):
        a, b = pair
        y = self.proj(x) * scale + a
        z = torch.tanh(b) * 2.0
        for key, value in {"x": x, "a": a, "b": b, "scale": scale, "y": y, "z": z}.items():
            self.seen[key] = value.detach().double().numpy().copy()
        return y, {"aux": z}


class _MixerNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.mixer = _Mixer()

    def forward(self, x):
        h = self.inp(x)
        y, extra = self.mixer(h, [h * 0.5, h - 1.0], scale=h.sigmoid())
        return (y.square().sum() + extra["aux"].sum()) / y.numel()


@pytest.mark.parametrize("grad_hooks", ["module", "tensor"])
def test_tuple_list_and_kwargs_tensors_are_each_measured(tmp_path, grad_hooks):
    """Issue 2: inputs and outputs in tuples, lists and kwargs each get their own row, equal to numpy, named by
    their path (position in a tuple or list, key in a dict).

    Gradients: ``output_grad`` of every output tensor in both modes (hooks on the output tensors); full
    backward hooks (``module``) give ``input_grad`` of the top-level positional input tensors only; ``tensor``
    hooks see every input tensor (documented in the README).
    """
    torch.manual_seed(0)
    model = _MixerNet()
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"], "targets": {"modules": ["mixer"]},
              "activations": {**ALL, "inputs": True, "backward": True, "grad_hooks": grad_hooks}}
    monitor = TrainerMonitor(config).attach(model)
    model(torch.randn(3, 4)).backward()
    monitor.step()
    monitor.close()
    rows = read_family(tmp_path / "run" / "rank0", "actv").set_index("name")
    seen = model.mixer.seen
    expected = {"mixer.input.0": seen["x"], "mixer.input.1.0": seen["a"], "mixer.input.1.1": seen["b"],
                "mixer.input.scale": seen["scale"], "mixer.output.0": seen["y"], "mixer.output.1.aux": seen["z"]}
    assert set(rows.index) == set(expected), sorted(rows.index)
    for name, array in expected.items():
        assert_close(rows.loc[name], np_stats(array), METRICS, label=name)
    grads = read_family(tmp_path / "run" / "rank0", "actv_grad").set_index("name")
    # loss = (sum y^2 + sum z) / 12: d/dy = 2y/12, d/dz = 1/12, d/da = d/dy, d/db = 2 (1 - tanh(b)^2) / 12
    want = {"mixer.output_grad.0": 2 * seen["y"] / 12, "mixer.output_grad.1.aux": np.full_like(seen["z"], 1 / 12)}
    if grad_hooks == "tensor":
        want.update({"mixer.input_grad.1.0": 2 * seen["y"] / 12,
                     "mixer.input_grad.1.1": 2 * (1 - np.tanh(seen["b"]) ** 2) / 12})
        assert {"mixer.input_grad.0", "mixer.input_grad.scale"} <= set(grads.index)
    else:
        assert set(grads.index) == {"mixer.output_grad.0", "mixer.output_grad.1.aux", "mixer.input_grad.0"}
    for name, array in want.items():
        assert_close(grads.loc[name], np_stats(array), METRICS, label=name)
