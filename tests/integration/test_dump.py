"""Targeted dump on real torch models, checked against numpy float64 recomputations."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from trainmon.actions.dump import TargetedDump
from trainmon.actions.naming import implicated_module, module_parents, modules_for_events, neighbourhood
from trainmon.anomaly.engine import AnomalyEngine
from trainmon.base.records import METRICS, build_record
from trainmon.base.safe_io import is_within, safe_file_name
from trainmon.collect.activations import ActivationCollector
from trainmon.collect.buffer import StepBuffer
from trainmon.collect.context import StepContext
from trainmon.collect.hooks import HookRegistry
from trainmon.collect.stats_base import StatsSpec
from trainmon.config import ActivationsConfig, AnomalyConfig, DumpConfig


@dataclass
class Event:
    """The two fields of an AnomalyEvent the dump action reads."""

    name: str
    family: str


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.act = nn.Tanh()
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.fc(x))
        if self.poison:
            y = y.clone()
            y[0, 0] = float("nan")
        return y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def assert_no_hooks(model: nn.Module) -> None:
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks
    for param in model.parameters():
        assert not getattr(param, "_post_accumulate_grad_hooks", None)


def assert_stats(desc: dict, array: np.ndarray) -> None:
    assert desc["shape"] == list(array.shape)
    expected = [array.max(), array.min(), array.mean(), np.sqrt(np.square(array).sum())]
    np.testing.assert_allclose([desc["Max"], desc["Min"], desc["Mean"], desc["Norm"]], expected,
                               rtol=1e-4, atol=1e-6)


def test_nan_at_step5_dumps_layer2_at_step6(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(4, 6), torch.randn(4, 1)
    # The real activation collector finds the first non-finite row, as the monitor does.
    ctx = StepContext(specs={"actv": StatsSpec.from_metrics(METRICS, 1e-8)}, metrics={"actv": list(METRICS)},
                      collecting=True)
    registry = HookRegistry()
    collector = ActivationCollector(ctx, [(n, m, 0) for n, m in net.named_modules() if n],
                                    ActivationsConfig(enabled=True, backward=False), registry)
    collector.arm()
    rank_dir = tmp_path / "run" / "rank0"
    dump = TargetedDump(net, rank_dir, DumpConfig(enabled=True, mode="tensor", depth=1))
    # The real anomaly engine hands the step's events, first-origin first, to the dump action.
    engine = AnomalyEngine(AnomalyConfig(detectors=[{"type": "nonfinite"}], actions=["jsonl", "dump"]), 0, rank_dir)
    implicated: dict[int, list[str]] = {}
    engine.register_action("dump", lambda events: implicated.setdefault(events[0].step, dump.on_anomaly(events)))
    for step in range(8):
        ctx.step = step  # as the monitor does (calls of a module are numbered per step and micro-step)
        dump.begin_step(step)
        net.layers[2].poison = step == 5
        if step == 6:
            params = {k: v.detach().double().numpy().copy() for k, v in net.state_dict().items()}
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        if torch.isfinite(loss):  # skip the poisoned step, as a loss scaler would
            opt.step()
        dump.end_step()
        ctx.grouped.flush()  # as the session does at the end of a step (device path: activations kept until then)
        host = ctx.buffer.transfer()
        ctx.buffer = StepBuffer()
        engine.process(build_record(step, 0, 0, host.keys, host.partials, host.scalars, ctx.metrics))
    engine.close()
    dump.close()
    dump.close()
    collector.close()
    assert_no_hooks(net)

    # The parent ModuleList is requested too, but it is never called, so it has no entries.
    assert implicated == {5: ["layers", "layers.2", "layers.2.fc", "layers.2.act"]}
    first = json.loads((rank_dir / "anomalies.jsonl").read_text().splitlines()[0])
    assert (first["step"], first["name"]) == (5, "layers.2.output")
    step_dirs = sorted(p.name for p in (tmp_path / "run" / "rank0" / "dump").iterdir())
    assert step_dirs == ["step6"]
    out = tmp_path / "run" / "rank0" / "dump" / "step6"
    dump_json = json.loads((out / "dump.json").read_text())
    assert (dump_json["task"], dump_json["level"], dump_json["framework"]) == ("tensor", "L0", "pytorch")
    data = dump_json["data"]
    assert {key.split(".")[1] + "." + key.split(".")[2] for key in data} == {"layers.2"}
    assert set(data) == {
        "Module.layers.2.Block.forward.0", "Module.layers.2.fc.Linear.forward.0",
        "Module.layers.2.act.Tanh.forward.0", "Module.layers.2.act.Tanh.backward.0",
        "Module.layers.2.fc.Linear.backward.0", "Module.layers.2.Block.backward.0",
        "Module.layers.2.fc.Linear.parameters_grad"}

    # Independent float64 recomputation of step 6 from the weights it started with.
    xs, ys = x.double().numpy(), y.double().numpy()
    h = xs
    hidden = []
    for i in range(3):
        z = h @ params[f"layers.{i}.fc.weight"].T + params[f"layers.{i}.fc.bias"]
        hidden.append((h, z))
        h = np.tanh(z)
    h1, z2 = hidden[2]
    a2 = h
    out_ = a2 @ params["head.weight"].T + params["head.bias"]
    d_out = 2 * (out_ - ys) / out_.size
    d_a2 = d_out @ params["head.weight"]
    d_z2 = d_a2 * (1 - a2 ** 2)

    block = data["Module.layers.2.Block.forward.0"]
    assert_stats(block["input_args"][0], h1)
    assert_stats(block["output"][0], a2)
    fc = data["Module.layers.2.fc.Linear.forward.0"]
    assert_stats(fc["input_args"][0], h1)
    assert_stats(fc["output"][0], z2)
    assert_stats(fc["parameters"]["weight"], params["layers.2.fc.weight"])
    assert fc["input_args"][0]["requires_grad"] is True and fc["input_kwargs"] == {}
    act_bwd = data["Module.layers.2.act.Tanh.backward.0"]
    assert_stats(act_bwd["input"][0], d_a2)   # gradient w.r.t. the forward output
    assert_stats(act_bwd["output"][0], d_z2)  # gradient w.r.t. the forward input
    grads = data["Module.layers.2.fc.Linear.parameters_grad"]
    assert_stats(grads["weight"][0], d_z2.T @ h1)  # msprobe's layout: {param: [description]}
    assert_stats(grads["bias"][0], d_z2.sum(0))

    # Tensor files: plain tensors loadable with weights_only=True, equal to the reference.
    loaded = torch.load(out / "dump_tensor_data" / fc["output"][0]["data_name"], weights_only=True)
    np.testing.assert_allclose(loaded.double().numpy(), z2, rtol=1e-5, atol=1e-6)
    loaded = torch.load(out / "dump_tensor_data" / grads["weight"][0]["data_name"], weights_only=True)
    np.testing.assert_allclose(loaded.double().numpy(), d_z2.T @ h1, rtol=1e-4, atol=1e-7)

    construct = json.loads((out / "construct.json").read_text())
    assert construct["Module.layers.2.fc.Linear.forward.0"] == "Module.layers.2.Block.forward.0"
    assert construct["Module.layers.2.Block.forward.0"] is None
    assert construct["Module.layers.2.fc.Linear.backward.0"] == "Module.layers.2.Block.backward.0"
    stack = json.loads((out / "stack.json").read_text())
    assert any("test_dump.py" in line for line in stack["Module.layers.2.fc.Linear.forward.0"])


def test_module_names_cannot_escape_the_run_directory(tmp_path: Path) -> None:
    net = nn.Sequential()
    net.add_module("plain", nn.Linear(3, 3))
    net.add_module("sl/ash", nn.Linear(3, 3))          # torch's add_module allows '/'
    net._modules["../../../escape"] = nn.Linear(3, 3)  # add_module refuses '.', the dict does not
    rank_dir = tmp_path / "run" / "rank0"
    dump = TargetedDump(net, rank_dir, DumpConfig(enabled=True, mode="tensor", depth=0))
    assert dump.request(["../../../escape", "sl/ash"], steps=[0]) == ["sl/ash", "../../../escape"]
    dump.begin_step(0)
    net(torch.randn(2, 3)).sum().backward()
    dump.end_step()
    dump.close()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and all(is_within(rank_dir / "dump" / "step0", p) for p in files)
    assert not list(tmp_path.parent.glob("*escape*"))
    data = json.loads((rank_dir / "dump" / "step0" / "dump.json").read_text())["data"]
    assert "Module.../../../escape.Linear.forward.0" in data  # the JSON keeps the real name
    for entry in data.values():
        for item in entry.get("input_args", []) + entry.get("output", []):
            tensor_file = rank_dir / "dump/step0/dump_tensor_data" / item["data_name"]
            assert "/" not in item["data_name"] and tensor_file.is_file()

    nasty = ["../../x", "..", ".", "/abs/path", "a\\..\\b", "a\x00b", "ü/..", "x" * 500, ".hidden", "a/b", "a_b"]
    base = tmp_path / "base"
    made = [safe_file_name(name, ".pt") for name in nasty]
    assert len(set(made)) == len(made)
    for name in made:
        assert "/" not in name and "\\" not in name and ".." not in name and "\x00" not in name
        assert not name.startswith(".") and len(name) <= 200 and name.endswith(".pt")
        assert is_within(base, base / name)


def test_md5_mode_and_budgets(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(1)
    net = Net()
    weight = net.layers[0].fc.weight.detach().clone()
    dump = TargetedDump(net, tmp_path / "rank0", DumpConfig(enabled=True, mode="md5", max_dumps=1, depth=0))
    dump.request(["layers.0.fc"], steps=[0])
    dump.request(["layers.1.fc"], steps=[1, 2])
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(3):
            dump.begin_step(step)
            net(torch.randn(2, 6)).sum().backward()
            dump.end_step()
    dump.close()
    assert sorted(p.name for p in (tmp_path / "rank0" / "dump").iterdir()) == ["step0"]
    assert sum("max_dumps" in r.message for r in caplog.records) == 1
    data = json.loads((tmp_path / "rank0/dump/step0/dump.json").read_text())
    desc = data["data"]["Module.layers.0.fc.Linear.forward.0"]["parameters"]["weight"]
    assert desc["md5"] == hashlib.md5(weight.numpy().tobytes()).hexdigest()
    assert data["task"] == "statistics" and not (tmp_path / "rank0/dump/step0/dump_tensor_data").exists()

    caplog.clear()
    small = TargetedDump(net, tmp_path / "small", DumpConfig(enabled=True, mode="tensor", max_bytes=200, depth=0))
    small.request(["layers.0.fc", "layers.1.fc"], steps=[0])
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        small.begin_step(0)
        net(torch.randn(2, 6)).sum().backward()
        small.end_step()
        small.close()
    assert sum("max_bytes" in r.message for r in caplog.records) == 1
    tensor_files = list((tmp_path / "small/dump/step0/dump_tensor_data").iterdir())
    assert tensor_files and sum(torch.load(p, weights_only=True).nbytes for p in tensor_files) <= 200
    entry = json.loads((tmp_path / "small/dump/step0/dump.json").read_text())["data"]
    described = [d for key, e in entry.items() if ".forward." in key for d in e["output"]]
    assert any("data_name" not in d for d in described) and all(d["Max"] is not None for d in described)
    assert_no_hooks(net)


def test_event_names_map_to_modules() -> None:
    net = nn.Sequential()
    net.add_module("layer", nn.Module())
    net.layer.add_module("output", nn.Linear(2, 2))   # HF BERT style: a module named "output"
    net.layer.add_module("mlp", nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    parents = module_parents(net)
    names = {n for n in parents if n}
    assert implicated_module("layer.output", names, "actv") == "layer"
    assert implicated_module("layer.output.output.1", names, "actv") == "layer.output"
    assert implicated_module("layer.mlp.0.input_grad", names, "actv_grad") == "layer.mlp.0"
    assert implicated_module("layer.mlp.0.weight", names, "grad_reduced") == "layer.mlp.0"
    assert implicated_module("loss", names | {"loss"}, "scalars") is None  # even with a module named "loss"
    assert neighbourhood("layer.mlp", parents, 1) == ["layer", "layer.mlp", "layer.mlp.0", "layer.mlp.1"]
    assert neighbourhood("layer.mlp", parents, 0) == ["layer.mlp"]
    events = [Event("loss", "scalars"), Event("layer.mlp.1.output", "actv"), Event("layer.output.weight", "param")]
    assert modules_for_events(events, parents, 0) == ["layer.mlp.1"]


class Residual(nn.Module):
    """``out = fc(x); out += x``: the in-place add modifies the dumped module's output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        out += x
        return out


def _train_inplace(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dump: TargetedDump | None,
                   steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """Train ``steps`` SGD steps; return the weights each step started with."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    started = []
    for step in range(steps):
        if dump is not None:
            dump.begin_step(step)
        started.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dump is not None:
            dump.end_step()
    return started


def test_dump_of_modules_modified_in_place_only_observes(tmp_path: Path) -> None:
    def build() -> nn.Module:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 1))

    x, y = torch.randn(5, 4), torch.randn(5, 1)
    plain = build()
    _train_inplace(plain, x, y, None)
    model = build()
    dump = TargetedDump(model, tmp_path, DumpConfig(enabled=True, mode="tensor", depth=0))
    dump.request(["0", "1"], steps=[1])
    started = _train_inplace(model, x, y, dump)  # register_full_backward_hook raised here
    dump.close()
    assert_no_hooks(model)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key  # the dump only observed

    # Independent reference: autograd on an out-of-place copy of step 1's forward.
    w = {k: v.clone().requires_grad_(True) for k, v in started[1].items()}
    z = x @ w["0.weight"].T + w["0.bias"]
    a = torch.relu(z)
    loss = nn.functional.mse_loss(a @ w["2.weight"].T + w["2.bias"], y)
    d_z, d_a, d_w0 = torch.autograd.grad(loss, [z, a, w["0.weight"]])
    out = tmp_path / "dump" / "step1"
    data = json.loads((out / "dump.json").read_text())["data"]

    def load(desc: dict) -> torch.Tensor:
        return torch.load(out / "dump_tensor_data" / desc["data_name"], weights_only=True)

    linear, relu = data["Module.0.Linear.backward.0"], data["Module.1.ReLU.backward.0"]
    torch.testing.assert_close(load(linear["input"][0]), d_z)     # gradient w.r.t. the Linear's output
    assert linear["output"] == []                                  # its input x is a leaf: no hook, no entry
    torch.testing.assert_close(load(relu["input"][0]), d_a)       # w.r.t. the ReLU's output
    torch.testing.assert_close(load(relu["output"][0]), d_z)      # w.r.t. its input, before the in-place op
    assert_stats(relu["output"][0], d_z.double().numpy())
    torch.testing.assert_close(load(data["Module.0.Linear.parameters_grad"]["weight"][0]), d_w0)
    construct = json.loads((out / "construct.json").read_text())
    assert construct["Module.0.Linear.backward.0"] is None


def test_dump_of_a_residual_with_an_in_place_add(tmp_path: Path) -> None:
    torch.manual_seed(4)
    model = nn.Sequential(Residual(), nn.Tanh())
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    dump = TargetedDump(model, tmp_path, DumpConfig(enabled=True, mode="statistics"))
    dump.request(["0", "0.fc"], steps=[0])
    started = _train_inplace(model, x, y, dump, steps=2)
    dump.close()
    assert_no_hooks(model)
    w = {k: v.clone().requires_grad_(True) for k, v in started[0].items()}
    fc = x @ w["0.fc.weight"].T + w["0.fc.bias"]
    summed = fc + x
    loss = nn.functional.mse_loss(torch.tanh(summed), y)
    d_fc, d_summed = torch.autograd.grad(loss, [fc, summed])
    data = json.loads((tmp_path / "dump" / "step0" / "dump.json").read_text())["data"]
    assert_stats(data["Module.0.fc.Linear.backward.0"]["input"][0], d_fc.double().numpy())
    assert_stats(data["Module.0.Residual.backward.0"]["input"][0], d_summed.double().numpy())


def test_dump_finds_modules_by_their_row_names_under_checkpoint_wrapper(tmp_path: Path) -> None:
    """Rows and anomaly events name modules without the ``_checkpoint_wrapped_module`` level; the dump finds the
    module by that name (the wrapped module itself, the user's class) and keys its entries with it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from tests.models import TinyNet, batch, loss_fn
    from trainmon import TrainerMonitor

    torch.manual_seed(0)
    model = TinyNet()
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
              "dump": {"enabled": True, "mode": "statistics"}}
    with TrainerMonitor(config).attach(model, optimizer) as monitor:
        assert monitor.dump(["layers.1.fc2", "layers.0"], steps=[1]) == ["layers.0", "layers.1.fc2"]  # model order
        for step in range(2):
            loss = loss_fn(model, *batch(step))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
    data = json.loads((tmp_path / "run" / "rank0" / "dump" / "step1" / "dump.json").read_text())["data"]
    assert any(key.startswith("Module.layers.1.fc2.Linear.forward") for key in data), sorted(data)
    assert any(key.startswith("Module.layers.0.Block.forward") for key in data), sorted(data)
    assert not any("_checkpoint_wrapped_module" in key for key in data)
