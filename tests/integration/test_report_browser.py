"""``trainmon report`` of a real training run, rendered by a real headless Chromium; the rendered DOM
is checked against the run's own files (read here with pandas and json, independently of the report)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from trainmon import TrainerMonitor

CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome", "chrome")
                 if shutil.which(name)), None)
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary (scripts/setup.sh installs "
                                   "Debian's chromium where apt-get is available)")
BAD_STEP, STEPS = 7, 12


def train_run(root: Path) -> Path:
    """A small MLP trained as users write it, with activations, the grad probe and a NaN input at BAD_STEP."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = {"output_dir": str(root), "run_name": "run", "sinks": ["csv"],
              "activations": {"enabled": True, "metrics": ["norm", "max", "nans"]},
              "grad_probe": {"enabled": True, "level": "L1"},
              "anomaly": {"detectors": [{"type": "nonfinite"}, {"type": "loss_spike"}], "actions": ["jsonl"]}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer, grad_acc_steps=2)
        for step in range(STEPS):
            for micro in range(2):
                x, y = torch.randn(8, 4), torch.randn(8, 2)
                if step == BAD_STEP and micro == 1:
                    x[0, 0] = float("nan")
                loss = nn.functional.mse_loss(model(x), y) / 2
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
    return root / "run"


class _Elements(HTMLParser):
    """Every start tag of a page with its attributes, and the text of elements with an id."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: dict[str, str] = {}
        self._open: list[str | None] = []

    def handle_starttag(self, tag, attrs):
        attributes = {k: v or "" for k, v in attrs}
        self.elements.append((tag, attributes))
        self._open.append(attributes.get("id"))

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        for element_id in self._open:
            if element_id:
                self.text[element_id] = self.text.get(element_id, "") + data

    def having(self, tag: str | None = None, **attrs: str) -> list[dict[str, str]]:
        return [a for t, a in self.elements if (tag is None or t == tag)
                and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]

    def with_class(self, name: str) -> list[dict[str, str]]:
        return [a for _, a in self.elements if name in a.get("class", "").split()]


def render(page: Path | str, tmp_path: Path, screenshot: Path | None = None, fragment: str = "") -> _Elements:
    """The DOM of ``page`` (a file, or a URL) after its scripts ran in headless Chromium (and, for a URL, its
    requests were answered: virtual time waits for them)."""
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1280,2000"]
    args += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    if isinstance(page, str):
        args.append("--virtual-time-budget=30000")
    url = (page if isinstance(page, str) else page.resolve().as_uri()) + fragment
    done = subprocess.run([*args, url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    parser = _Elements()
    parser.feed(done.stdout)
    return parser


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, Path, str]:
    """``(run directory, report.html, what the command printed)`` of one real run."""
    root = tmp_path_factory.mktemp("report")
    run = train_run(root)
    out = root / "report.html"
    done = subprocess.run([sys.executable, "-m", "trainmon", "report", str(run), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return run, out, done.stdout


@needs_browser
def test_report_of_a_real_run_renders_in_chromium(tmp_path, report):
    run, out, printed = report
    files = len(list((run / "rank0").glob("*.csv"))) + 1  # and grad_probe/grad_summary.csv
    assert f"wrote {out}" in printed and f"read {files} CSV files of 1 rank(s)" in printed
    text = out.read_text(encoding="utf-8")
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text  # nothing fetched

    dom = render(out, tmp_path)
    body = dom.having("body")[0]
    assert body.get("data-rendered") == "ok" and "data-js-error" not in body, body
    assert dom.text.get("js-error", "") == ""

    # The heatmap drawn first: the reduced gradients' norm on the rank of the first origin, in the change colours.
    canvas = dom.with_class("view-canvas")[0]
    assert (canvas["data-view"], canvas["data-family"], canvas["data-metric"], canvas["data-at"],
            canvas["data-mode"]) == ("steps", "grad_reduced", "norm", "0", "change")
    # The activations' (a link's fragment): one row per row name of actv.csv, each labelled.
    dom = render(out, tmp_path, fragment="#view=steps&family=actv&metric=norm&rank=0")
    actv = pd.read_csv(run / "rank0" / "actv.csv", keep_default_na=False, na_values=["nan"])
    canvas = dom.with_class("view-canvas")[0]
    names = list(dict.fromkeys(actv["name"]))
    assert canvas["data-family"] == "actv" and canvas["data-metric"] == "norm"
    assert int(canvas["data-rows"]) == len(names) and int(canvas["data-cols"]) == actv["step"].nunique() == STEPS
    assert sorted(a["title"] for a in dom.with_class("row-label") if "data-family" not in a) == sorted(names)
    bad_cells = actv.assign(bad=~np.isfinite(actv["norm"])).groupby(["name", "step"])["bad"].any().sum()
    assert bad_cells > 0 and int(canvas["data-nonfinite"]) == bad_cells
    assert {int(a["data-step"]) for a in dom.with_class("step-tick")} <= set(range(STEPS))

    # Curves: anomaly markers at exactly the steps with events; NaN-loss markers at the NaN steps.
    events = [json.loads(line) for line in (run / "rank0" / "anomalies.jsonl").read_text().splitlines()]
    event_steps = sorted({e["step"] for e in events})
    assert event_steps[0] == BAD_STEP
    loss_chart_markers = {int(a["data-step"]) for a in dom.with_class("anomaly-marker")}
    assert loss_chart_markers == set(event_steps)
    scalars = pd.read_csv(run / "rank0" / "scalars.csv", keep_default_na=False, na_values=["nan"])
    loss = scalars[scalars["name"] == "loss"]
    nan_steps = set(loss.loc[~np.isfinite(loss["value"]), "step"])
    assert nan_steps and {int(a["data-step"]) for a in dom.with_class("bad-marker")} == nan_steps
    assert {a["data-name"] for a in dom.with_class("curve-chart")} >= {"loss", "grad_norm", "lr/group0"}

    # Timeline: one cell per step with events (one rank), the first origin circled at BAD_STEP.
    cells = dom.with_class("timeline-cell")
    assert sorted(int(a["data-step"]) for a in cells) == event_steps
    assert sum(int(a["data-count"]) for a in cells) == len(events)
    origin = dom.with_class("first-origin")[0]
    first = min(events, key=lambda e: (e["step"], e["micro_step"], e["order"]))
    assert (int(origin["data-step"]), int(origin["data-rank"])) == (first["step"], 0) == (BAD_STEP, 0)
    assert first["micro_step"] == 1 and first["name"].startswith("0.")
    assert len(dom.with_class("event-row")) == min(20, len(events))

    # Grad probe: the direction heatmap, one row per probed parameter.
    probe = pd.read_csv(run / "rank0" / "grad_probe" / "grad_summary.csv")
    probe_canvas = dom.having("canvas", data_family="grad_probe")[0]
    assert int(probe_canvas["data-rows"]) == probe["name"].nunique()


@needs_browser
def test_a_script_error_is_written_into_the_page(tmp_path):
    """The error marker works: a page whose data breaks the script says so in its DOM."""
    from trainmon.tools.report.page import render as render_page

    broken = {"summary": {"run_name": "x", "trainmon": "0", "run_dir": "x"}, "ranks": [0], "curves": {}}
    page = tmp_path / "broken.html"
    page.write_text(render_page(broken), encoding="utf-8")
    body = render(page, tmp_path).having("body")[0]
    assert "data-rendered" not in body and "data-js-error" in body


@needs_browser
def test_screenshot(tmp_path, report):
    shot = tmp_path / "report.png"
    render(report[1], tmp_path, screenshot=shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


LLAMA_SPIKE = 65


@pytest.fixture(scope="module")
def llama_report(tmp_path_factory) -> tuple[Path, Path]:
    """``(run, report.html)`` of a synthetic store at the 7B shape (291 tensors, 4 ranks, 200 steps, grad_reduced
    and exp_avg): rank 0's layer 12 jumps x8 at step 65."""
    from benchmarks.synthetic_store import Spike, llama_names, write_store

    run = tmp_path_factory.mktemp("llama") / "run"
    write_store(run, llama_names(32), ranks=4, steps=200, families=("grad_reduced", "exp_avg"),
                spikes=[Spike(LLAMA_SPIKE, r"layers\.12\.", 8.0, rank=0, family="grad_reduced")])
    out = run / "report.html"
    done = subprocess.run([sys.executable, "-m", "trainmon", "report", str(run), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return run, out


def _rgb(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


@needs_browser
def test_7b_shape_report_is_labelled_and_shows_the_spike(tmp_path, llama_report):
    """291 rows labelled by layer and block, step ticks, and the one-step spike of one layer as the largest change
    of the default view, drawn red (its pixel read back from the canvas)."""
    _, out = llama_report
    dom = render(out, tmp_path)
    body = dom.having("body")[0]
    assert body.get("data-rendered") == "ok" and "data-js-error" not in body, body
    canvas = dom.with_class("view-canvas")[0]
    assert (canvas["data-view"], canvas["data-family"], canvas["data-metric"], canvas["data-at"], canvas["data-mode"],
            canvas["data-rows"], canvas["data-cols"]) == ("steps", "grad_reduced", "norm", "0", "change", "291", "200")
    groups = [a["data-group"] for a in dom.with_class("group-label")]
    assert groups == ["model.embed_tokens.weight", *[f"model.layers.{i}" for i in range(32)], "model.norm.weight",
                      "lm_head.weight"]
    assert {dom_text for dom_text in (a["title"] for a in dom.with_class("block-label"))} >= {"self_attn", "mlp"}
    ticks = [int(a["data-step"]) for a in dom.with_class("step-tick")]
    assert len(ticks) >= 4 and ticks == sorted(ticks) and ticks[0] >= 0 and ticks[-1] <= 199
    assert canvas["data-largest-row"].startswith("model.layers.12.") and canvas["data-largest-at"] == str(LLAMA_SPIKE)
    red, green, blue = _rgb(canvas["data-largest-rgb"])
    assert red > 100 and green < 80 and blue < 80, canvas["data-largest-rgb"]
    assert any(int(a["data-step"]) == LLAMA_SPIKE for a in dom.with_class("event-tick"))  # the spike events, marked
    links = [a["href"] for a in dom.with_class("event-link")]
    assert links and all("row=model.layers.12." in link and f"at={LLAMA_SPIKE}" in link for link in links)

    value = render(out, tmp_path, fragment="#mode=abs")
    canvas = value.with_class("view-canvas")[0]
    assert canvas["data-mode"] == "abs" and canvas["data-rows"] == "291"


@needs_browser
def test_7b_shape_other_views(tmp_path, llama_report):
    """module x rank at the spike's step (rank 0 stands out against the median over ranks) and rank x step of a
    spiked row, each reached by a link's fragment."""
    run, out = llama_report
    dom = render(out, tmp_path, fragment=f"#view=ranks&family=grad_reduced&metric=norm&step={LLAMA_SPIKE}")
    canvas = dom.with_class("view-canvas")[0]
    assert (canvas["data-view"], canvas["data-at"], canvas["data-rows"], canvas["data-cols"]) == (
        "ranks", str(LLAMA_SPIKE), "291", "4")
    assert canvas["data-largest-row"].startswith("model.layers.12.") and canvas["data-largest-at"] == "0"
    assert [int(a["data-rank"]) for a in dom.with_class("rank-tick")][:1] == [0]
    module = "0:model.layers.12.self_attn.q_proj.weight"  # the first spike event's row: a key row of the page
    dom = render(out, tmp_path, fragment=f"#view=module&family=grad_reduced&metric=norm&module={module}")
    canvas = dom.with_class("view-canvas")[0]
    assert (canvas["data-view"], canvas["data-rows"], canvas["data-cols"]) == ("module", "4", "200")
    assert canvas["data-largest-row"] == "rank 0" and canvas["data-largest-at"] == str(LLAMA_SPIKE)
    assert [a["data-group"] for a in dom.with_class("group-label")] == [f"rank {r}" for r in range(4)]
    assert any(int(a["data-step"]) == LLAMA_SPIKE for a in dom.with_class("event-cell") + dom.with_class("event-tick"))


@needs_browser
def test_serve_answers_a_drill_down_in_chromium(tmp_path, llama_report):
    """The served page, zoomed to steps 60..70 of rank 0: the grid comes from the server at one column per step."""
    from trainmon.tools.serve import Server, open_views

    run, _ = llama_report
    views = open_views(run)
    server = Server(views, "127.0.0.1", 0)
    server.start()
    try:
        dom = render(server.url, tmp_path, fragment="#view=steps&family=grad_reduced&metric=norm&rank=0&lo=60&hi=70")
    finally:
        server.stop()
        views.source.close()
    body = dom.having("body")[0]
    assert body.get("data-rendered") == "ok" and "data-js-error" not in body, body
    assert dom.having("div", id="hm-map")[0].get("data-ready") == "ok"
    canvas = dom.with_class("view-canvas")[0]
    assert (canvas["data-rows"], canvas["data-cols"]) == ("291", "11")
    assert canvas["data-largest-row"].startswith("model.layers.12.") and canvas["data-largest-at"] == str(LLAMA_SPIKE)
    assert [int(a["data-step"]) for a in dom.with_class("step-tick")] == list(range(60, 71, 2)) or \
        set(int(a["data-step"]) for a in dom.with_class("step-tick")) <= set(range(60, 71))


@needs_browser
def test_more_rows_than_fit_are_drawn_a_row_per_layer_and_block(tmp_path):
    """1,353 rows (150 layers): a row per layer and block, each the farthest cell of its rows, so one tensor's
    spike stays the largest change; a filter shows the rows themselves."""
    from benchmarks.synthetic_store import Spike, llama_names, write_store

    run = tmp_path / "run"
    names = llama_names(150)
    write_store(run, names, ranks=1, steps=60, spikes=[Spike(30, r"layers\.120\.mlp\.up_proj", 8.0)])
    out = run / "report.html"
    assert subprocess.run([sys.executable, "-m", "trainmon", "report", str(run), "-o", str(out)],
                          capture_output=True, timeout=300).returncode == 0
    canvas = render(out, tmp_path).with_class("view-canvas")[0]
    assert (canvas["data-rows"], canvas["data-condensed"]) == (str(1 + 150 * 4 + 2), str(len(names)))
    assert canvas["data-largest-row"] == "model.layers.120.mlp (3 rows)" and canvas["data-largest-at"] == "30"
    dom = render(out, tmp_path, fragment="#filter=model.layers.120.")
    canvas = dom.with_class("view-canvas")[0]
    assert (canvas["data-rows"], canvas["data-condensed"]) == ("9", "0")
    assert canvas["data-largest-row"] == "model.layers.120.mlp.up_proj.weight"
    assert sorted(a["title"] for a in dom.with_class("row-label")) == sorted(n for n in names if ".120." in n)
