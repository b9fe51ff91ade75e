"""MindSpore lifecycle, import isolation, uncollected steps, and the cross-framework output contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import Tensor, nn  # noqa: E402

from tests.integration import test_mindspore_families as families  # noqa: E402
from tests.integration.test_mindspore_families import Mlp, _data, _hooks_left  # noqa: E402
from tests.reference import METRICS, assert_close, np_stats, read_family  # noqa: E402
from trainmon import TrainerMonitor  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)


stats_path = families.stats_path  # both statistics paths: host (numpy, on the CPU) and device


@pytest.fixture(autouse=True)
def no_leftovers():
    """See test_mindspore_families.no_leftovers; the MindSpore hooks are checked in each test."""
    yield


def test_import_trainmon_does_not_import_mindspore() -> None:
    code = "import sys, trainmon; assert 'mindspore' not in sys.modules, 'mindspore imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_lifecycle_hooks_only_on_collected_steps_and_none_after_close(tmp_path: Path) -> None:
    ms.set_seed(0)
    net = Mlp()
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-2)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv", "tensorboard"],
                              "step_interval": 2, "activations": {"enabled": True}})
    monitor.attach(net, opt)
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
    armed = []
    for step in range(4):
        armed.append(bool(net.fc1._forward_hook) and bool(net.fc1.weight.hooks()))
        x, y = _data(step)
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
        record = monitor.step(loss=loss)
        assert (record is not None) == (step % 2 == 0)
    assert armed == [True, False, True, False]
    monitor.close()
    monitor.close()
    assert not _hooks_left(net, opt)
    rank_dir = tmp_path / "run" / "rank0"
    assert sorted(set(read_family(rank_dir, "grad_reduced").step)) == [0, 2]
    # AdamWeightDecay: moments1/moments2 and its un-bias-corrected update m / (sqrt(v) + eps)
    update = read_family(rank_dir, "update")
    row = update[(update.step == 2) & (update.name == "fc2.weight")].iloc[0]
    m, v = opt.moments1[2].asnumpy().astype(np.float64), opt.moments2[2].asnumpy().astype(np.float64)
    assert np.isfinite(row["norm"]) and row["norm"] > 0
    assert list(read_family(rank_dir, "exp_avg").name.unique()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert m.shape == (3, 10) and v.shape == (3, 10)
    assert list(rank_dir.glob("events.out.tfevents.*"))


def test_same_config_gives_same_headers_and_rows_as_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One YAML file drives a torch and a MindSpore run of the same network (same initial weights, data
    and Adam hyper-parameters, a NaN injected into ``act`` at the last step): the CSV files, headers,
    rows and values, the TensorBoard tags, steps and values, and the ``anomalies.jsonl`` events match.

    The NaN goes in at the last step because what follows it is the frameworks' own business, not the
    monitor's: with NaN weights, torch's ReLU returns NaN and MindSpore's CPU ReLU returns 0.
    """
    torch = pytest.importorskip("torch")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class TorchAct(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.poison = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(x)
            return y * float("nan") if self.poison else y

    class TorchMlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.act, self.fc2 = torch.nn.Linear(6, 10), TorchAct(), torch.nn.Linear(10, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.act(self.fc1(x)))

    config_file = tmp_path / "monitor.yaml"
    config_file.write_text(
        "output_dir: out\n"  # relative: each framework runs in its own working directory
        "run_name: run\n"
        "sinks: [csv, tensorboard]\n"
        "tensorboard: {per_tensor: true}\n"
        "activations: {enabled: true, metrics: [max, norm, nans]}\n"
        "params: {enabled: true}\n"
        "targets: {modules: ['fc*', act], params: ['*']}\n"
        "optimizer_states: {states: [exp_avg, exp_avg_sq, update, ratio]}\n"
        "anomaly: {detectors: [{type: nonfinite}], actions: [jsonl]}\n", encoding="utf-8")
    steps, poison_step = 3, 2
    torch.manual_seed(0)
    tmodel = TorchMlp()
    initial = {name: p.detach().numpy().copy() for name, p in tmodel.named_parameters()}
    # eps far below sqrt(v): MindSpore's nn.Adam adds eps before the bias correction and torch after it,
    # so with eps=1e-6 the parameters of the two runs drift apart by up to 1e-2 relative after one step.
    topt = torch.optim.Adam(tmodel.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-12)
    torch_dir, ms_dir = tmp_path / "torch", tmp_path / "mindspore"
    torch_dir.mkdir()
    ms_dir.mkdir()
    monkeypatch.chdir(torch_dir)
    with TrainerMonitor(config_file) as monitor:
        monitor.attach(tmodel, topt)
        for step in range(steps):
            tmodel.act.poison = step == poison_step
            x, y = (torch.from_numpy(a) for a in _data(step))
            loss = torch.nn.functional.mse_loss(tmodel(x), y)
            loss.backward()
            topt.step()
            topt.zero_grad()
            monitor.step(loss=loss)
    net = Mlp()
    for name, param in net.parameters_and_names():  # the torch run's initial weights
        param.set_data(Tensor(initial[name]))
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-2, beta1=0.9, beta2=0.99, eps=1e-12)
    monkeypatch.chdir(ms_dir)
    with TrainerMonitor(config_file) as monitor:
        monitor.attach(net, opt)
        grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
        for step in range(steps):
            net.act.poison = step == poison_step
            loss, grads = grad_fn(*(Tensor(a) for a in _data(step)))
            opt(grads)
            monitor.step(loss=loss)
    assert not _hooks_left(net, opt)
    torch_dir, ms_dir = torch_dir / "out" / "run" / "rank0", ms_dir / "out" / "run" / "rank0"
    files = sorted(p.name for p in torch_dir.glob("*.csv"))
    assert files == sorted(p.name for p in ms_dir.glob("*.csv"))
    assert "actv_grad.csv" in files and "ratio.csv" in files
    for name in files:
        t, m = read_family(torch_dir, name[:-4]), read_family(ms_dir, name[:-4])
        assert list(t.columns) == list(m.columns), name
        if name == "scalars.csv":  # scalars: same names; their order within a step is not part of the contract
            t, m = (frame.sort_values(["step", "name"], ignore_index=True) for frame in (t, m))
        assert t[["step", "name"]].values.tolist() == m[["step", "name"]].values.tolist(), name  # same rows, same order
        metrics = [c for c in t.columns if c not in ("vpp_stage", "name", "step", "micro_step")]
        norms = t["norm"].to_numpy(np.float64) if "norm" in metrics else np.zeros(len(t))
        _assert_same_values(t[metrics].to_numpy(np.float64), m[metrics].to_numpy(np.float64), norms, name)
    # TensorBoard: the same tags, written at the same steps, with the same values
    boards = [EventAccumulator(str(d), size_guidance={"scalars": 0}).Reload() for d in (torch_dir, ms_dir)]
    tags = sorted(boards[0].Tags()["scalars"])
    assert tags == sorted(boards[1].Tags()["scalars"])
    assert {"actv/act.output/nans", "ratio/fc1.weight/norm", "scalars/loss", "scalars/grad_norm"} <= set(tags)
    for tag in tags:
        (steps_t, values_t), (steps_m, values_m) = ([[e.step for e in s], [e.value for e in s]]
                                                    for s in (board.Scalars(tag) for board in boards))
        assert steps_t == steps_m == list(range(steps)), tag
        family, _, rest = tag.partition("/")  # an overview summary {family}/{metric}_{stat}: its family's norm_max
        norm_tag = f"{family}/norm_max" if "/" not in rest else tag.rsplit("/", 1)[0] + "/norm"
        norms = np.array([e.value for e in boards[0].Scalars(norm_tag)]) if norm_tag in tags else np.zeros(steps)
        _assert_same_values(np.array(values_t)[:, None], np.array(values_m)[:, None], norms, tag)
    # anomalies.jsonl: the same events with the same fields, in the same order (only the wall time differs)
    events_t, events_m = ([json.loads(line) for line in (d / "anomalies.jsonl").read_text().splitlines()]
                          for d in (torch_dir, ms_dir))
    assert [list(e) for e in events_t] == [list(e) for e in events_m]
    assert [{**e, "time": None} for e in events_t] == [{**e, "time": None} for e in events_m]
    first = events_m[0]
    assert (first["step"], first["phase"], first["family"], first["name"]) == (poison_step, "forward", "actv",
                                                                                 "act.output")


def _assert_same_values(torch_values: np.ndarray, ms_values: np.ndarray, norms: np.ndarray, label: str) -> None:
    """Equal NaN patterns, and ``|t - m| <= 1e-5 |t| + 1e-6 norm`` elsewhere (row-wise ``norm``).

    Both runs compute in float32 from the same weights and data, so what differs is float32 rounding
    in a different order (matmul and reduction order, Adam's update arithmetic). The relative 1e-5
    bounds that for well-conditioned values (measured: at most ~5e-6, on ``ratio``, where a parameter
    near 0 amplifies the frameworks' different Adam rounding); the ``1e-6 norm`` term covers values
    far below their tensor's scale, which carry rounding of the tensor's scale (measured: a ``min``
    of ``exp_avg_sq`` of 2.4e-9 in a tensor of norm 3e-4 differs by 2.2e-5 relative). rtol 2e-4 is
    not needed.
    """
    assert (np.isnan(torch_values) == np.isnan(ms_values)).all(), label
    finite = ~np.isnan(torch_values)
    bound = 1e-5 * np.abs(torch_values) + 1e-6 * np.nan_to_num(np.abs(norms))[:, None]
    assert (np.abs(torch_values - ms_values)[finite] <= bound[finite]).all(), (label, torch_values, ms_values)




def test_features_mindspore_lacks_warn_once_and_training_goes_on(tmp_path: Path, caplog) -> None:
    net = Mlp()
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-2)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "grad_probe": {"enabled": True},
                              "communication": {"enabled": True}, "dump": {"enabled": True}})
    monitor.attach(net, opt)
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
    loss, grads = grad_fn(*(Tensor(a) for a in _data(0)))
    opt(grads)
    assert monitor.step(loss=loss) is not None
    monitor.close()
    warned = [r.getMessage() for r in caplog.records if "not supported with mindspore" in r.getMessage()]
    assert warned == []  # grad_probe, communication and dump are supported


def _fixed_data(step: int) -> tuple[Tensor, Tensor]:
    return tuple(Tensor(a) for a in _data(step))  # type: ignore[return-value]


@pytest.mark.parametrize("optimizer", ["AdamWeightDecay", "Adam"])
def test_optimizer_state_rows_match_numpy_float64(tmp_path: Path, optimizer: str, stats_path: str) -> None:
    """exp_avg, exp_avg_sq, update and ratio rows against float64 numpy from the optimizer's own moments.

    The moments are read from ``opt.moments1/moments2`` (``moment1/moment2`` for ``nn.Adam``) after each
    step and checked against their recursion from the step's gradients, so a swapped or stale state
    tuple fails too. The update is the one docs/mindspore.md documents: ``m / (sqrt(v) + eps)`` for
    AdamWeightDecay (no bias correction; weight decay is not part of it) and torch's bias-corrected
    ``m_hat / (sqrt(v_hat) + eps)`` for Adam.
    """
    betas, eps, lr = (0.9, 0.99), 1e-6, 1e-2
    ms.set_seed(0)
    net = Mlp()
    if optimizer == "AdamWeightDecay":
        opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                                 weight_decay=0.1)
        m_attr, v_attr = "moments1", "moments2"
    else:
        opt = nn.Adam(net.trainable_params(), learning_rate=lr, beta1=betas[0], beta2=betas[1], eps=eps)
        m_attr, v_attr = "moment1", "moment2"
    states = ["exp_avg", "exp_avg_sq", "update", "ratio"]
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
                              "optimizer_states": {"states": states}})
    monitor.attach(net, opt)
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
    names = [name for name, _ in net.parameters_and_names()]
    expected: list[dict[str, dict[str, np.ndarray]]] = []
    m_prev = {name: np.zeros(p.shape) for name, p in net.parameters_and_names()}
    v_prev = {name: np.zeros(p.shape) for name, p in net.parameters_and_names()}
    for step in range(3):
        _, grads = grad_fn(*_fixed_data(step))
        opt(grads)
        per_family: dict[str, dict[str, np.ndarray]] = {family: {} for family in states}
        for i, name in enumerate(names):
            m = getattr(opt, m_attr)[i].asnumpy().astype(np.float64)
            v = getattr(opt, v_attr)[i].asnumpy().astype(np.float64)
            g = grads[i].asnumpy().astype(np.float64)
            # the optimizer's own moments follow Adam's recursion from this step's gradient
            np.testing.assert_allclose(m, betas[0] * m_prev[name] + (1 - betas[0]) * g, rtol=1e-5, atol=1e-9)
            np.testing.assert_allclose(v, betas[1] * v_prev[name] + (1 - betas[1]) * g * g, rtol=1e-5, atol=1e-12)
            m_prev[name], v_prev[name] = m, v
            if optimizer == "AdamWeightDecay":
                update = m / (np.sqrt(v) + eps)
            else:
                update = (m / (1 - betas[0] ** (step + 1))) / (np.sqrt(v / (1 - betas[1] ** (step + 1))) + eps)
            param = opt.parameters[i].asnumpy().astype(np.float64)  # after the step, as the hook sees it
            per_family["exp_avg"][name], per_family["exp_avg_sq"][name] = m, v
            per_family["update"][name] = update
            per_family["ratio"][name] = np.where(param != 0, update / np.where(param != 0, param, 1), 0.0)
        expected.append(per_family)
        monitor.step()
    monitor.close()
    assert not _hooks_left(net, opt)
    rank_dir = tmp_path / "run" / "rank0"
    for family in states:
        frame = read_family(rank_dir, family)
        assert sorted(set(frame.step)) == [0, 1, 2], family
        for step, per_family in enumerate(expected):
            rows = frame[frame.step == step]
            assert rows.name.tolist() == names, (family, step)
            for _, row in rows.iterrows():
                reference = per_family[family][row["name"]]
                # float32 sums of <= 60 values: 1e-5 relative, with the mean's cancellation bounded by the norm
                assert_close(row, np_stats(reference), METRICS, rtol=1e-5,
                             atol=1e-6 * float(np.sqrt(np.sum(reference ** 2))) / reference.size,
                             label=f"{optimizer} {family} {row['name']} step {step}")


class _HostTransferCounter:
    """Counts MindSpore device-to-host reads made from trainmon code on the training thread.

    Every public way a MindSpore tensor reaches host memory is wrapped (``asnumpy``/``numpy``,
    ``item``/``_item``, ``tolist``, ``__array__``, ``__float__``/``__int__``/``__bool__``/``__index__``,
    ``__str__``/``__repr__``, ``data_sync``); nested calls (``__float__`` -> ``_item``) count once. The
    sinks' writer thread is not counted: it only sees host floats.
    """

    METHODS = ("asnumpy", "numpy", "item", "_item", "tolist", "__array__", "__float__", "__int__", "__bool__",
               "__index__", "__str__", "__repr__", "data_sync", "_numpy_non_blocking")

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.where: list[tuple[str, bool]] = []  # per call: the innermost trainmon function, and whether in transfer()
        self._originals: dict[str, object] = {}
        self._depth = 0

    def __enter__(self) -> _HostTransferCounter:
        import threading

        main = threading.current_thread()
        for name in self.METHODS:
            if name not in vars(Tensor) and not hasattr(Tensor, name):
                continue
            original = vars(Tensor).get(name, getattr(Tensor, name))
            self._originals[name] = original

            def wrapper(tensor, *args, _original=original, _name=name, **kwargs):
                where = _from_trainmon() if self._depth == 0 and threading.current_thread() is main else None
                if where is not None:
                    self.calls.append(_name)
                    self.where.append(where)
                self._depth += 1
                try:
                    return _original(tensor, *args, **kwargs)
                finally:
                    self._depth -= 1

            setattr(Tensor, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(Tensor, name, original)


def _from_trainmon() -> tuple[str, bool] | None:
    """``(innermost trainmon function, whether MindSporeStepBuffer.transfer is on the stack)``, or None when
    no trainmon frame is."""
    frame = sys._getframe(2)
    innermost = None
    in_transfer = False
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("trainmon"):
            innermost = innermost or frame.f_code.co_name
            in_transfer = in_transfer or (frame.f_code.co_name == "transfer"
                                          and frame.f_globals["__name__"].endswith("mindspore.buffer"))
        frame = frame.f_back
    return None if innermost is None else (innermost, in_transfer)


def test_one_host_transfer_per_collected_step_and_none_otherwise(tmp_path: Path, stats_path: str) -> None:
    """No read in a hook; on a collected step the first read is the ``asnumpy()`` of the stacked device
    statistics in ``MindSporeStepBuffer.transfer`` (the step's one synchronisation), and on the host path
    every other read is a view of host memory made after it, inside ``transfer``; nothing on other steps."""
    ms.set_seed(0)
    net = Mlp()
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv", "tensorboard"],
                              "step_interval": 2, "activations": {"enabled": True}, "params": {"enabled": True},
                              "optimizer_states": {"states": ["exp_avg", "exp_avg_sq", "update", "ratio"]},
                              "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl"]}})
    monitor.attach(net, opt)
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
    per_step, where = [], []
    for step in range(4):
        with _HostTransferCounter() as counter:
            loss, grads = grad_fn(*_fixed_data(step))
            opt(grads)
            record = monitor.step(loss=loss)
        per_step.append(counter.calls)
        where.append(counter.where)
        assert (record is not None) == (step % 2 == 0)
    monitor.close()
    assert not _hooks_left(net, opt)
    assert per_step[1] == per_step[3] == [], per_step
    for calls, places in ((per_step[0], where[0]), (per_step[2], where[2])):
        # The first: the `asnumpy()` of the stacked statistics and scalars in MindSporeStepBuffer.transfer.
        assert calls[0] == "asnumpy" and places[0] == ("transfer", True), places
        if stats_path == "device":
            assert calls == ["asnumpy"], calls
        else:  # then views of host memory (tensors, Adam's beta powers and eps), inside transfer
            assert len(calls) > 1 and set(calls) == {"asnumpy"}, calls
            assert {place for place in places[1:]} <= {("host_view", True), ("host_scalar", True)}, places
    assert len(read_family(tmp_path / "run" / "rank0", "update")) == 2 * 4  # the collected steps were measured


def test_the_loss_of_every_step_reaches_the_detectors(tmp_path: Path) -> None:
    """A NaN loss on a step that is not collected is reported with its step; its value comes to the host
    with the next collected step's one transfer (no read of its own)."""
    ms.set_seed(0)
    net = Mlp()
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    seen: list = []
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "step_interval": 4,
                              "anomaly": {"actions": ["callback"]}})
    monitor.on_anomaly(seen.append)
    monitor.attach(net, opt)
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
    reads = []
    for step in range(7):
        with _HostTransferCounter() as counter:
            loss, grads = grad_fn(*_fixed_data(step))
            opt(grads)
            monitor.step(loss=loss * float("nan") if step in (2, 5) else loss)
        reads.append(len(counter.calls))
    monitor.close()
    assert [(e.step, e.name) for e in seen if e.detector == "nonfinite"] == [(2, "loss"), (5, "loss")]
    assert reads[1] == reads[2] == reads[3] == reads[5] == reads[6] == 0, reads
