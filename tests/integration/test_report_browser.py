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


def render(page: Path, tmp_path: Path, screenshot: Path | None = None) -> _Elements:
    """The DOM of ``page`` after its scripts ran in headless Chromium."""
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1280,2000"]
    args += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    done = subprocess.run([*args, page.resolve().as_uri()], capture_output=True, text=True, timeout=120)
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

    # The heatmap drawn first: family actv, metric norm, rank 0; one row per row name of actv.csv.
    actv = pd.read_csv(run / "rank0" / "actv.csv", keep_default_na=False, na_values=["nan"])
    canvas = dom.having("canvas", data_family="actv", data_metric="norm")[0]
    names = list(dict.fromkeys(actv["name"]))
    assert int(canvas["data-rows"]) == len(names) and int(canvas["data-cols"]) == actv["step"].nunique() == STEPS
    assert len([a for a in dom.with_class("row-label") if a["data-family"] == "actv"]) == len(names)
    bad_cells = actv.assign(bad=~np.isfinite(actv["norm"])).groupby(["name", "step"])["bad"].any().sum()
    assert bad_cells > 0 and int(canvas["data-nonfinite"]) == bad_cells

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
