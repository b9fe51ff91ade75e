"""Every monitor config msprobe publishes, through ``TrainerMonitor.from_msprobe``, one step on a small model.

The configs (tests/data/msprobe_configs/, provenance also in SOURCES.json there) are every JSON monitor
config in msprobe's documentation and unit tests:

- the docs shipped in the mindstudio-probe 1.2.1 and 8.3.3 wheels from PyPI (``msprobe/docs/19.monitor.md``;
  8.3.3 is the newest wheel that ships docs, 26.x ships none);
- the newest docs and the unit-test configs, which no wheel ships: msprobe's source, at
  https://gitcode.com/Ascend/mstt, read from its GitHub mirror xiaobingling93-pixel/Ascend-mstt at
  commit 99c2e0f990a17d328f487062acc9c490f7f6ff26 (2026-04-25), paths below.

Each must load, attach and run one training step; the modules and parameters with rows must be the
ones msprobe selects by its own rules (``msprobe_selection``, restated from msprobe 1.2.1's source in
tests/unit/test_msprobe_translation.py), the root module included (rows ``.input``, ``.output``, ...).
A config's ``module_ranks`` ([0, 1, 2, 3] in three of them) runs on this one-process job's rank 0, with a
warning naming the absent ranks, as msprobe runs on the listed ranks a job has.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from tests.unit.test_msprobe_translation import msprobe_selection
from trainmon import TrainerMonitor
from trainmon.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "msprobe_configs"
SOURCES = {  # file -> where msprobe publishes it (doc blocks by the line their ``` fence opens on)
    "doc121_line94.json":
        "mindstudio-probe 1.2.1 wheel (PyPI): msprobe/docs/19.monitor.md:94",
    "doc121_line145.json":
        "mindstudio-probe 1.2.1 wheel (PyPI): msprobe/docs/19.monitor.md:145",
    "doc121_line170.json":
        "mindstudio-probe 1.2.1 wheel (PyPI): msprobe/docs/19.monitor.md:170",
    "doc121_line178.json":
        "mindstudio-probe 1.2.1 wheel (PyPI): msprobe/docs/19.monitor.md:178",
    "doc121_line216.json":
        "mindstudio-probe 1.2.1 wheel (PyPI): msprobe/docs/19.monitor.md:216",
    "doc121_line243.json":
        "mindstudio-probe 1.2.1 wheel (PyPI): msprobe/docs/19.monitor.md:243",
    "doc121_line272.json":
        "mindstudio-probe 1.2.1 wheel (PyPI): msprobe/docs/19.monitor.md:272 (fragment, wrapped in {} here)",
    "doc121_line320.json":
        "mindstudio-probe 1.2.1 wheel (PyPI): msprobe/docs/19.monitor.md:320",
    "doc121_line369.json":
        "mindstudio-probe 1.2.1 wheel (PyPI): msprobe/docs/19.monitor.md:369",
    "doc121_line496.json":
        "mindstudio-probe 1.2.1 wheel (PyPI): msprobe/docs/19.monitor.md:496",
    "doc833_line147.json":
        "mindstudio-probe 8.3.3 wheel (PyPI): msprobe/docs/19.monitor.md:147",
    "doc833_line161.json":
        "mindstudio-probe 8.3.3 wheel (PyPI): msprobe/docs/19.monitor.md:161",
    "doc833_line176.json":
        "mindstudio-probe 8.3.3 wheel (PyPI): msprobe/docs/19.monitor.md:176",
    "doc833_line197.json":
        "mindstudio-probe 8.3.3 wheel (PyPI): msprobe/docs/19.monitor.md:197",
    "doc833_line213.json":
        "mindstudio-probe 8.3.3 wheel (PyPI): msprobe/docs/19.monitor.md:213",
    "doc833_line234.json":
        "mindstudio-probe 8.3.3 wheel (PyPI): msprobe/docs/19.monitor.md:234",
    "doc833_line302.json":
        "mindstudio-probe 8.3.3 wheel (PyPI): msprobe/docs/19.monitor.md:302",
    "doc833_line310.json":
        "mindstudio-probe 8.3.3 wheel (PyPI): msprobe/docs/19.monitor.md:310",
    "doc833_line340.json":
        "mindstudio-probe 8.3.3 wheel (PyPI): msprobe/docs/19.monitor.md:340",
    "doc833_line393.json":
        "mindstudio-probe 8.3.3 wheel (PyPI): msprobe/docs/19.monitor.md:393",
    "doc833_line423.json":
        "mindstudio-probe 8.3.3 wheel (PyPI): msprobe/docs/19.monitor.md:423 "
        "(fragment, wrapped in {} here; // comment removed)",
    "doc833_line430.json":
        "mindstudio-probe 8.3.3 wheel (PyPI): msprobe/docs/19.monitor.md:430 (fragment, wrapped in {} here)",
    "doc833_line438.json":
        "mindstudio-probe 8.3.3 wheel (PyPI): msprobe/docs/19.monitor.md:438 (fragment, wrapped in {} here)",
    "doc833_line684.json":
        "mindstudio-probe 8.3.3 wheel (PyPI): msprobe/docs/19.monitor.md:684",
    "docnew_line25.json":
        "newest docs: debug/accuracy_tools/msprobe/docs/zh/monitor_instruct.md:25",
    "docnew_line153.json":
        "newest docs: debug/accuracy_tools/msprobe/docs/zh/monitor_instruct.md:153",
    "docnew_line167.json":
        "newest docs: debug/accuracy_tools/msprobe/docs/zh/monitor_instruct.md:167",
    "docnew_line182.json":
        "newest docs: debug/accuracy_tools/msprobe/docs/zh/monitor_instruct.md:182",
    "docnew_line203.json":
        "newest docs: debug/accuracy_tools/msprobe/docs/zh/monitor_instruct.md:203",
    "docnew_line219.json":
        "newest docs: debug/accuracy_tools/msprobe/docs/zh/monitor_instruct.md:219",
    "docnew_line238.json":
        "newest docs: debug/accuracy_tools/msprobe/docs/zh/monitor_instruct.md:238",
    "docnew_line306.json":
        "newest docs: debug/accuracy_tools/msprobe/docs/zh/monitor_instruct.md:306",
    "docnew_line314.json":
        "newest docs: debug/accuracy_tools/msprobe/docs/zh/monitor_instruct.md:314",
    "docnew_line345.json":
        "newest docs: debug/accuracy_tools/msprobe/docs/zh/monitor_instruct.md:345",
    "docnew_line375.json":
        "newest docs: debug/accuracy_tools/msprobe/docs/zh/monitor_instruct.md:375 "
        "(fragment, wrapped in {} here; // comment removed)",
    "docnew_line382.json":
        "newest docs: debug/accuracy_tools/msprobe/docs/zh/monitor_instruct.md:382 (fragment, wrapped in {} here)",
    "docnew_line390.json":
        "newest docs: debug/accuracy_tools/msprobe/docs/zh/monitor_instruct.md:390 (fragment, wrapped in {} here)",
    "docnew_line677.json":
        "newest docs: debug/accuracy_tools/msprobe/docs/zh/monitor_instruct.md:677",
    "ut_ms_test_config.json":
        "unit tests: debug/accuracy_tools/msprobe/test/mindspore_ut/ms_monitor/config/test_config.json",
    "ut_all_config.json":
        "unit tests: debug/accuracy_tools/msprobe/test/pytorch_ut/monitor/config/all_config.json",
    "ut_cc_config.json":
        "unit tests: debug/accuracy_tools/msprobe/test/pytorch_ut/monitor/config/cc_config.json",
    "ut_mv_config.json":
        "unit tests: debug/accuracy_tools/msprobe/test/pytorch_ut/monitor/config/mv_config.json",
    "ut_stack_config.json":
        "unit tests: debug/accuracy_tools/msprobe/test/pytorch_ut/monitor/config/stack_config.json",
    "ut_struct_config.json":
        "unit tests: debug/accuracy_tools/msprobe/test/pytorch_ut/monitor/config/struct_config.json",
    "ut_ur_config.json":
        "unit tests: debug/accuracy_tools/msprobe/test/pytorch_ut/monitor/config/ur_config.json",
    "ut_wg_config.json":
        "unit tests: debug/accuracy_tools/msprobe/test/pytorch_ut/monitor/config/wg_config.json",
    "ut_xy_config.json":
        "unit tests: debug/accuracy_tools/msprobe/test/pytorch_ut/monitor/config/xy_config.json",
}
_PARAM_FAMILIES = ("grad_unreduced", "grad_reduced", "param", "exp_avg", "exp_avg_sq", "update")
_ROW = re.compile(r"(.*)\.(input|output|input_grad|output_grad)(?:\.\d+)?")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.act = torch.nn.Tanh()
        self.fc2 = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Stack(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block() for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class LanguageModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Stack(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


class Wrapped(torch.nn.Module):
    """``module.module.language_model...``, ``module.encoder...``, ``module.embedding.word_embedding``."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Module()
        self.module.language_model = LanguageModel()
        self.encoder = Stack(1)
        self.embedding = torch.nn.Module()
        self.embedding.word_embedding = torch.nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.module.language_model(self.embedding.word_embedding(x)))


class Net(torch.nn.Module):
    """A small model holding every name the published configs target (Megatron-style names,
    ``layer1``/``layer2`` of the MindSpore unit test), plus names msprobe squashes (layers, embedding,
    final, output, norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = Wrapped()
        self.language_model = LanguageModel()
        self.layer1 = torch.nn.Linear(8, 8)
        self.layer2 = torch.nn.Linear(8, 8)
        self.final_norm = torch.nn.LayerNorm(8)
        self.output_layer = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.language_model(self.module(x))
        return self.output_layer(self.final_norm(self.layer2(torch.tanh(self.layer1(h)))))


def _called_modules(model: torch.nn.Module) -> set[str]:
    """Modules whose forward runs (containers like ModuleList never do: no tool has rows for them)."""
    called: set[str] = set()
    handles = [m.register_forward_hook(lambda *_, name=n: called.add(name)) for n, m in model.named_modules()]
    with torch.no_grad():
        model(torch.zeros(2, 4))
    for handle in handles:
        handle.remove()
    return called


def _rows(rank_dir: Path) -> set[tuple[str, str]]:
    """``(family, row name)`` written: from the CSV files, or the TensorBoard events (``format: tensorboard``)."""
    found = set()
    for path in rank_dir.glob("*.csv"):
        frame = pd.read_csv(path, keep_default_na=False, na_values=["nan"])
        found |= {(path.stem, name) for name in frame["name"]}
    if found:
        return found
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for events in rank_dir.glob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            family, _, rest = tag.partition("/")
            if family == "scalars" or "/" in rest:  # not the overview's {family}/{metric}_{stat}
                found.add((family, rest if family == "scalars" else rest.rpartition("/")[0]))
    return found


def test_every_published_config_is_collected_and_cited() -> None:
    on_disk = {p.name for p in CONFIGS.glob("*.json")} - {"SOURCES.json"}
    assert on_disk == set(SOURCES)
    listed = {entry["file"] for entry in json.loads((CONFIGS / "SOURCES.json").read_text())}
    assert listed == on_disk
    # 10 in the 1.2.1 docs, 14 in the 8.3.3 docs, 14 in the newest docs, 8 PyTorch + 1 MindSpore unit tests
    assert len(on_disk) == 47


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_published_config_runs_and_selects_what_msprobe_selects(name: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    data: dict[str, Any] = json.loads((CONFIGS / name).read_text())
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    monitor = TrainerMonitor.from_msprobe(CONFIGS / name)
    config = monitor.config
    assert config.output_dir == str(tmp_path)
    if data.get("module_ranks"):
        assert config.ranks == list(dict.fromkeys(data["module_ranks"])) and config.absent_ranks == "skip"
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with monitor:
        monitor.attach(model, optimizer)
        loss = model(torch.randn(4, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step(loss=loss)
    if not config.enabled:
        return
    if data.get("module_ranks") == [0, 1, 2, 3]:
        assert "ranks 1, 2, 3 do not exist: this job has 1 rank (0..0); collecting on rank 0 only" in caplog.text
    (run_dir,) = tmp_path.iterdir()
    rank_dir = run_dir / "rank0"
    rows = _rows(rank_dir)
    modules = {_ROW.fullmatch(n).group(1) for family, n in rows if family in ("actv", "actv_grad")}
    params = {n for family, n in rows if family in _PARAM_FAMILIES}
    params |= {n.removeprefix("grad_probe/").removesuffix("/mg_direction") for family, n in rows
               if family == "scalars" and n.startswith("grad_probe/") and n.endswith("/mg_direction")
               and n != "grad_probe/mg_direction"}

    expected_modules, expected_params = msprobe_selection(data, [n for n, _ in model.named_modules()],
                                                          [n for n, _ in model.named_parameters()])
    if not data.get("xy_distribution") or (data.get("forward_only") and data.get("backward_only")):
        expected_modules = set()  # msprobe hooks modules with print_struct too, but records only their structure
    expected_modules &= _called_modules(model)
    if not any(data.get(k) for k in ("wg_distribution", "mv_distribution", "param_distribution", "mg_direction",
                                     "ur_distribution")):
        expected_params = set()
    assert modules == expected_modules
    assert params == expected_params
    if data.get("print_struct"):
        assert (rank_dir / "module_struct.json").exists()



# ------------------------------------------------------------------ the first hour with a msprobe config
def _write(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def test_a_config_for_four_ranks_runs_on_one_and_all_xy_measures_the_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """msprobe's module_ranks [0, 1, 2, 3] on a one-process job: a warning, rank 0 collects; all_xy hooks the root
    module too (msprobe's "" module, rows .input/.output/.output_grad). Values against float64 numpy of the tensors
    the loop really used; an evaluation forward between steps writes no row."""
    path = _write(tmp_path, {"module_ranks": [0, 1, 2, 3], "xy_distribution": True, "all_xy": True,
                             "wg_distribution": True, "format": "csv", "ops": ["norm", "max"]})
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected: dict[tuple[str, int], np.ndarray] = {}
    monitor = TrainerMonitor.from_msprobe(path).attach(model, optimizer)
    assert "ranks 1, 2, 3 do not exist: this job has 1 rank (0..0); collecting on rank 0 only" in caplog.text
    assert "module_ranks" in caplog.text
    for step in range(2):
        x = torch.randn(3, 8)
        out = model(x)
        loss = out.pow(2).mean()
        loss.backward()
        out64 = out.detach().double().numpy()
        expected[(".input", step)] = x.double().numpy()
        expected[(".output", step)] = out64
        expected[(".output_grad", step)] = 2 * out64 / out64.size  # d mean(out^2) / d out
        expected[("fc1.weight", step)] = model.fc1.weight.grad.double().numpy()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step(loss=loss)
        model.eval()
        with torch.no_grad():
            model(torch.randn(5, 8))  # evaluation: no rows, the root's none either
        model.train()
    monitor.close()
    rank_dir = tmp_path / "out" / monitor.run_dir.name / "rank0"
    frames = {family: pd.read_csv(rank_dir / f"{family}.csv", keep_default_na=False, na_values=["nan"])
              for family in ("actv", "actv_grad", "grad_reduced")}
    for (name, step), reference in expected.items():
        family = {".input": "actv", ".output": "actv", ".output_grad": "actv_grad"}.get(name, "grad_reduced")
        frame = frames[family]
        (row,) = frame[(frame["name"] == name) & (frame["step"] == step)].itertuples()
        assert row.norm == pytest.approx(np.linalg.norm(reference), rel=1e-6)
        assert row.max == pytest.approx(reference.max(), rel=1e-6)
    assert {".input", ".output", "fc1.output", "act.output", "fc2.output"} <= set(frames["actv"]["name"])


def test_a_config_naming_no_rank_of_the_job_fails_at_attach_with_msprobes_key(tmp_path: Path) -> None:
    path = _write(tmp_path, {"module_ranks": [2, 3], "wg_distribution": True})
    monitor = TrainerMonitor.from_msprobe(path)
    with pytest.raises(ConfigError) as info:
        monitor.attach(Block(), None)
    assert str(info.value) == (f"{path}: msprobe key module_ranks: ranks 2, 3 do not exist: this job has 1 rank "
                               "(0..0); list a rank below 1")
    monitor.close()


@pytest.mark.parametrize(("config", "message"), [
    ({"start_step": -1}, "msprobe key start_step: must be >= 0, got -1"),
    ({"step_interval": 0}, "msprobe key step_interval: must be >= 1, got 0"),
    ({"module_ranks": [-1]}, "msprobe key module_ranks: lists no rank that can exist"),
    ({"xy_distribution": "yes"}, "msprobe key xy_distribution: must be true or false"),
])
def test_config_errors_name_the_file_and_msprobes_key(tmp_path: Path, config: dict[str, Any], message: str) -> None:
    path = _write(tmp_path, config)
    with pytest.raises(ConfigError) as info:
        TrainerMonitor.from_msprobe(path)
    assert str(info.value).startswith(f"{path}: {message}")


def test_a_target_that_names_nothing_is_reported_by_its_key(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, {"targets": {"fc3": {}, "fc2": {}}, "xy_distribution": True, "wg_distribution": True})
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = Block()
    with TrainerMonitor.from_msprobe(path) as monitor:
        monitor.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert (f"msprobe targets key 'fc3' ({path}) selects no module or parameter of this model; it is skipped, as "
            "msprobe skips it; close names: ['fc2', 'fc1']") in caplog.text
    assert "'fc2'" not in caplog.text.split("close names")[0] and "re:" not in caplog.text
    caplog.clear()
    _write(tmp_path, {"targets": {"fc3": {}}, "xy_distribution": True})
    with TrainerMonitor.from_msprobe(path) as monitor:
        monitor.attach(model, None)
    assert "targets.modules: no name matches ['fc3']" in caplog.text and "re:" not in caplog.text
