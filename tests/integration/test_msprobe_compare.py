"""trainmon through ``TrainerMonitor.from_msprobe`` against msprobe 1.2.1 itself on one deterministic run (with
the config's targets, and again with ``all_xy``: every module, the root module too).

msprobe 1.2.1 is the ``mindstudio-probe`` wheel from PyPI, unpacked (never installed) into
``.cache/msprobe-1.2.1/`` by ``scripts/fetch_msprobe.sh`` (run by ``scripts/setup.sh``). Its monitor is
imported from there in a child process (it patches ``torch.optim.Adam.step`` on the class, so it must
not share a process with other tests). No fake is needed for NPU-only modules: its monitor runs on CPU
with ``torch_npu`` absent. Three of its packages' ``__init__`` files are bypassed (empty package
objects with the right ``__path__``) because they import msprobe's accuracy-compare tools, which need
openpyxl and other packages the monitor never uses. The test skips, saying why, when the wheel cannot
be fetched or imported.

Every row both tools write is compared (absolute or relative difference <= 1e-5): activations and
their gradients, weight gradients before and after reduction, parameters, Adam moments (msprobe reads
them before the optimizer step, trainmon after it: msprobe's step s is trainmon's step s-1) and
``mg_direction``; and the AnomalyTurbulence events msprobe writes to ``anomaly.json`` are the
relative-spike events trainmon writes to ``anomalies.jsonl``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

from trainmon import TrainerMonitor
from trainmon.config.msprobe_names import squash_name

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "msprobe-1.2.1"
TOLERANCE = 1e-5
STEPS = 6
GRAD_ACC = 2
OPS = ["norm", "min", "max", "mean", "zeros", "nans"]
CONFIG = {
    # A module by name, a module and its parameters by msprobe's squashed name with the chunk prefix
    # ("0:1.fc1" is layers.1.fc1), a parameter-name prefix that is no module ("layers.1.fc2.w"), the head.
    "targets": {"layers.0": {}, "0:1.fc1": {"input": "tuple[1]:0", "output": "tensor"}, "layers.1.fc2.w": {},
                "head": {}},
    "xy_distribution": True, "wg_distribution": True, "mv_distribution": True, "param_distribution": True,
    "mg_direction": True, "format": "csv", "ops": OPS, "ndigits": 12,
    "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True},
}

MODEL_SOURCE = textwrap.dedent('''
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.act = torch.nn.ReLU()
            self.fc2 = torch.nn.Linear(16, 8)

        def forward(self, x):
            return x + self.fc2(self.act(self.fc1(x)))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(4, 8)
            self.layers = torch.nn.ModuleList([Block(), Block()])
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x):
            h = self.embed(x)
            for layer in self.layers:
                h = layer(h)
            return self.head(h)

    def build():
        """The model, its Adam optimizer and the data generator of the deterministic run."""
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
        data = torch.Generator().manual_seed(1)
        return model, optimizer, data

    def run(model, optimizer, data, steps, grad_acc, on_step):
        """Train; on_step(loss) after each optimizer step."""
        for _ in range(steps):
            for _ in range(grad_acc):
                x = torch.randn(16, 4, generator=data)
                y = torch.randn(16, 1, generator=data)
                loss = ((model(x) - y) ** 2).mean() / grad_acc
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            on_step(loss)
''')

MSPROBE_RUNNER = textwrap.dedent('''
    import os, sys, types
    cache, config, model_file, steps, grad_acc = sys.argv[1:6]
    sys.path.insert(0, cache)
    for name in ("msprobe.pytorch", "msprobe.pytorch.common", "msprobe.core.grad_probe"):
        package = types.ModuleType(name)  # skip __init__: it imports msprobe's compare tools, not the monitor
        package.__path__ = [os.path.join(cache, *name.split("."))]
        sys.modules[name] = package
    from msprobe.pytorch.monitor.module_hook import TrainerMon
    sys.path.insert(0, os.path.dirname(model_file))
    import compare_model
    model, optimizer, data = compare_model.build()
    # A plain torch Adam: msprobe reads its state like Megatron's FP32 optimizer (opt_ty is required
    # for mv_distribution in 1.2.1); params_have_main_grad=False reads param.grad.
    monitor = TrainerMon(config, params_have_main_grad=False, opt_ty="Megatron_FP32Optimizer")
    monitor.monitor_gnorm_with_ad(model, grad_acc_steps=int(grad_acc), optimizer=optimizer)
    compare_model.run(model, optimizer, data, int(steps), int(grad_acc), lambda loss: None)
''')


def _msprobe_available() -> str | None:
    """None when msprobe 1.2.1 is unpacked in the cache (fetching it if needed), else why not."""
    if not (CACHE / ".complete").exists():
        result = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_msprobe.sh")], capture_output=True, text=True,
                                env={**os.environ, "PYTHON": sys.executable}, timeout=600, check=False)
        if result.returncode != 0:
            return f"msprobe 1.2.1 wheel could not be fetched: {result.stderr.strip()[-300:]}"
    return None


@pytest.fixture(scope="module", params=[False, True], ids=["targets", "all_xy"])
def runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> tuple[Path, Path, Path]:
    """``(msprobe rank folder, msprobe anomaly.json, trainmon rank folder)`` of the same training: with CONFIG's
    targets, and with ``all_xy`` (every module, the root module ``""`` too, rows ``.input``, ``.output``, ...)."""
    reason = _msprobe_available()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("msprobe_compare")
    (base / "compare_model.py").write_text(MODEL_SOURCE)
    (base / "msprobe_config.json").write_text(json.dumps({**CONFIG, "all_xy": request.param}))
    (base / "runner.py").write_text(MSPROBE_RUNNER)
    out_msprobe = base / "msprobe_out"
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(out_msprobe), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(base / "runner.py"), str(CACHE), str(base / "msprobe_config.json"),
                             str(base / "compare_model.py"), str(STEPS), str(GRAD_ACC)],
                            capture_output=True, text=True, env=env, timeout=600, check=False)
    if result.returncode != 0 and "ModuleNotFoundError" in result.stderr:
        pytest.skip(f"msprobe 1.2.1 cannot be imported here: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr[-3000:]
    rank_dirs = [p for p in out_msprobe.iterdir() if re.search(r"-rank0-", p.name)]
    assert len(rank_dirs) == 1, list(out_msprobe.iterdir())

    sys.path.insert(0, str(base))
    try:
        import compare_model
    finally:
        sys.path.remove(str(base))
    out_trainmon = base / "trainmon_out"
    os.environ["MONITOR_OUTPUT_DIR"] = str(out_trainmon)
    try:
        monitor = TrainerMonitor.from_msprobe(base / "msprobe_config.json")
    finally:
        del os.environ["MONITOR_OUTPUT_DIR"]
    model, optimizer, data = compare_model.build()
    with monitor:
        monitor.attach(model, optimizer, grad_acc_steps=GRAD_ACC)
        compare_model.run(model, optimizer, data, STEPS, GRAD_ACC, monitor.step)
    sys.modules.pop("compare_model", None)
    (run_dir,) = out_trainmon.iterdir()
    return rank_dirs[0], out_msprobe / "anomaly_detected" / "rank0" / "anomaly.json", run_dir / "rank0"


def _read(path: Path) -> pd.DataFrame:
    return pd.read_csv(path, keep_default_na=False, na_values=["nan"])


def _msprobe_rows(folder: Path, family: str) -> pd.DataFrame:
    frames = [_read(p) for p in sorted(folder.iterdir()) if re.fullmatch(rf"{family}_\d+-\d+\.csv", p.name)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _names(model_names: list[str]) -> dict[str, str]:
    """msprobe's name of a module or parameter -> its real name. msprobe names a parameter (and a
    module under all_xy) by its squashed name, a module hooked by its targets key as written."""
    squashed = {squash_name(name): name for name in model_names}
    assert len(squashed) == len(model_names), "the compared model must have no two names with one squashed name"
    return {**squashed, **{name: name for name in model_names}}


def _module_and_param_names(tmp: Path) -> tuple[list[str], list[str]]:
    sys.path.insert(0, str(tmp))
    try:
        import compare_model

        net = compare_model.Net()
    finally:
        sys.path.remove(str(tmp))
        sys.modules.pop("compare_model", None)
    return [n for n, _ in net.named_modules()], [n for n, _ in net.named_parameters()]  # the root is ""


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= TOLERANCE * max(1.0, abs(a), abs(b))


def test_every_shared_row_agrees_with_msprobe_1_2_1(runs: tuple[Path, Path, Path]) -> None:
    msprobe_dir, _, trainmon_dir = runs
    modules, params = _module_and_param_names(msprobe_dir.parents[1])
    module_of, param_of = _names(modules), _names(params)
    compared: dict[str, int] = {}
    worst = 0.0
    mismatches: list[str] = []
    names: set[str] = set()

    def check(family: str, key: tuple, mine: dict, theirs: float) -> None:
        nonlocal worst
        if key not in mine and math.isnan(theirs) and key[0].endswith(".input_grad"):
            return  # msprobe writes NaN where no gradient flows (an input that is data); trainmon writes no row
        compared[family] = compared.get(family, 0) + 1
        names.add(key[0])
        if key not in mine:
            mismatches.append(f"{family}: trainmon has no row {key}")
            return
        if not _close(mine[key], theirs):
            mismatches.append(f"{family} {key}: trainmon {mine[key]!r}, msprobe {theirs!r}")
        elif not (math.isnan(theirs) or math.isnan(mine[key])):
            worst = max(worst, abs(mine[key] - theirs))

    # Activations and their gradients: msprobe 1.2.1 writes one row per module and micro-step
    # ("{squashed module}_{micro_step}"), columns "{input|output|input_grad|output_grad}.{op}".
    for family, kinds in (("actv", ("input", "output")), ("actv_grad", ("input_grad", "output_grad"))):
        theirs = _msprobe_rows(msprobe_dir, family)
        mine_frame = _read(trainmon_dir / f"{family}.csv")
        mine = {(row["name"], int(row["step"]), int(row["micro_step"]), op): float(row[op])
                for _, row in mine_frame.iterrows() for op in OPS}
        for _, row in theirs.iterrows():
            squashed, micro_step = str(row["module_name"]).rsplit("_", 1)
            module = module_of[squashed]
            for kind in kinds:
                for op in OPS:
                    check(family, (f"{module}.{kind}", int(row["step"]), int(micro_step), op), mine,
                          float(row[f"{kind}.{op}"]))
    # Per-parameter families; msprobe reads Adam's moments before the step, trainmon after it.
    for family, shift in (("grad_unreduced", 0), ("grad_reduced", 0), ("param", 0), ("exp_avg", 1),
                          ("exp_avg_sq", 1)):
        theirs = _msprobe_rows(msprobe_dir, family)
        mine_frame = _read(trainmon_dir / f"{family}.csv")
        last_micro = mine_frame.groupby(["name", "step"])["micro_step"].transform("max") == mine_frame["micro_step"]
        mine = {(row["name"], int(row["step"]), op): float(row[op])
                for _, row in mine_frame[last_micro].iterrows() for op in OPS}
        assert len(theirs), family
        for _, row in theirs.iterrows():
            for op in OPS:
                check(family, (param_of[row["param_name"]], int(row["step"]) - shift, op), mine, float(row[op]))
    # mg_direction: msprobe's "other" rows (every op of a 0-d value; mean is the value itself).
    scalars = _read(trainmon_dir / "scalars.csv")
    mine = {(name.removeprefix("grad_probe/").removesuffix("/mg_direction"), int(step), "mean"): float(value)
            for step, name, value in scalars.itertuples(index=False) if name.endswith("/mg_direction")}
    for _, row in _msprobe_rows(msprobe_dir, "other").iterrows():
        check("mg_direction", (param_of[row["param_name"]], int(row["step"]), "mean"), mine, float(row["mean"]))

    assert not mismatches, "\n".join(mismatches[:30]) + f"\n({len(mismatches)} mismatches)"
    print(f"compared with msprobe 1.2.1: {compared}, {sum(compared.values())} values, max |difference| {worst:.3g}")
    assert compared["actv"] and compared["actv_grad"] and compared["mg_direction"]
    if json.loads((msprobe_dir.parents[1] / "msprobe_config.json").read_text())["all_xy"]:
        assert {".input", ".output", ".output_grad"} <= names  # the root module's rows (msprobe's "" module)
    assert sum(compared.values()) >= 1000


def test_anomaly_turbulence_events_agree_with_msprobe_1_2_1(runs: tuple[Path, Path, Path]) -> None:
    msprobe_dir, anomaly_json, trainmon_dir = runs
    modules, params = _module_and_param_names(msprobe_dir.parents[1])
    module_of, param_of = _names(modules), _names(params)
    family_of_tag = {"input": ("actv", "input", 0), "output": ("actv", "output", 0),
                     "input_grad": ("actv_grad", "input_grad", 0), "output_grad": ("actv_grad", "output_grad", 0),
                     "acc_grad": ("grad_unreduced", "", 0), "post_grad": ("grad_reduced", "", 0),
                     "exp_avg": ("exp_avg", "", 1), "efxp_avg_sq": ("exp_avg_sq", "", 1)}
    # msprobe keeps one event per tag and step (anomaly.json is keyed by tag, step and call id; the
    # op that fired last wins), so events are compared per row, step (and micro-step for activations),
    # and msprobe's op must be one of the metrics trainmon found anomalous there.
    theirs: dict[tuple, str] = {}
    for event in json.loads(anomaly_json.read_text()).values():
        op = re.search(r"'(\w+)'\) at step", event["message"]).group(1)
        name, _, tag = event["tag_name"].partition("/")
        tag = tag.rpartition("/")[2] or "param"  # parameters are tagged by their name alone
        plain = name.split(":", 1)[1]
        if tag == "mg_direction":
            theirs[("scalars", f"grad_probe/{param_of[plain]}/mg_direction", event["step"], None)] = op
            continue
        family, kind, shift = family_of_tag.get(tag, ("param", "", 0))
        if kind:
            squashed, micro_step = plain.rsplit("_", 1)
            theirs[(family, f"{module_of[squashed]}.{kind}", event["step"], int(micro_step))] = op
        else:
            theirs[(family, param_of[plain], event["step"] - shift, None)] = op
    mine: dict[tuple, set[str]] = {}
    for line in (trainmon_dir / "anomalies.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["detector"] != "spike":
            continue
        micro_step = event["micro_step"] if event["family"] in ("actv", "actv_grad") else None
        metric = "mean" if event["family"] == "scalars" else event["metric"]
        mine.setdefault((event["family"], event["name"], event["step"], micro_step), set()).add(metric)
    # The shifted moments: trainmon's last step has no msprobe counterpart.
    mine = {key: ops for key, ops in mine.items() if not (key[0] in ("exp_avg", "exp_avg_sq") and key[2] == STEPS - 1)}
    # msprobe also scans the zeros and nans of the one number mg_direction is; trainmon scans the number.
    skipped = {key for key, op in theirs.items() if key[0] == "scalars" and op in ("zeros", "nans")}
    theirs = {key: op for key, op in theirs.items() if key not in skipped}
    mine = {key: ops for key, ops in mine.items() if key not in skipped}
    assert theirs, "msprobe reported no AnomalyTurbulence event: the comparison would prove nothing"
    assert set(mine) == set(theirs), (sorted(set(mine) - set(theirs))[:10], sorted(set(theirs) - set(mine))[:10])
    wrong = {key: (op, mine[key]) for key, op in theirs.items() if op not in mine[key]}
    assert not wrong, list(wrong.items())[:10]
    print(f"AnomalyTurbulence: {len(theirs)} msprobe events, each matched by trainmon")


def test_mg_direction_counts_a_zero_sign_as_one_half_and_is_one_at_step_0(tmp_path: Path) -> None:
    """msprobe's get_sign_matches: ((sign(g) * sign(m)).sum() / numel + 1) / 2; 1.0 at step 0 (no msprobe needed)."""
    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    grads = [torch.tensor([1.0, -1.0, 0.0, 2.0]), torch.tensor([1.0, 1.0, -1.0, 0.0])]
    momenta = [None, torch.tensor([1.0, 1.0, 1.0, 1.0])]  # what "exp_avg" holds when the step starts
    config = {"output_dir": str(tmp_path), "run_name": "r", "weight_grads": {"enabled": False},
              "optimizer_states": {"enabled": False}, "sinks": ["csv"],
              "grad_probe": {"enabled": True, "level": "L0", "mg_direction": True, "scalars": "param"}}
    with TrainerMonitor(config) as monitor:
        model = torch.nn.Module()
        model.w = weight
        monitor.attach(model, optimizer)
        for grad, momentum in zip(grads, momenta):
            if momentum is not None:
                optimizer.state[weight]["exp_avg"] = momentum
            weight.grad = grad.clone()
            optimizer.step()
            monitor.step()
    scalars = _read(tmp_path / "r" / "rank0" / "scalars.csv")
    values = {(int(s), n): v for s, n, v in scalars.itertuples(index=False)}
    assert values[(0, "grad_probe/w/mg_direction")] == 1.0  # step 0, whatever the signs
    # signs (1, 1, -1, 0) x (1, 1, 1, 1): two agree, one opposes, one zero (a half) -> (1 / 4 + 1) / 2
    assert values[(1, "grad_probe/w/mg_direction")] == pytest.approx(0.625)
    assert values[(1, "grad_probe/mg_direction")] == pytest.approx(0.625)
