"""``trainmon analyse`` / ``trainmon report``: the first non-finite and the first spike apart, and ``--detector``.

Issue 30: with a spike rule firing from step 1, the analysis named a step-1 spike as the first origin of a
NaN at step 60. References are brute force over the events written (``write_run``), not trainmon's merge.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_anomaly_analyse import reference_key, write_run
from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.firsts import UnknownDetectorError
from trainmon.anomaly.merge import analyse_run
from trainmon.tools.cli import main

MSPROBE = Path(__file__).parents[1] / "data" / "msprobe_output" / "msprobe-26.2.0"


def is_nonfinite(event: dict) -> bool:
    return event["detector"] == "nonfinite" or event["value"] in ("nan", "inf", "-inf")


def write_turbulent_run(root: Path, steps: int = 70, nan_step: int = 60) -> Path:
    """One rank: a spike on every step from step 1 (several rows), a NaN loss from ``nan_step`` on."""
    lines = []
    for step in range(1, steps):
        for order in range(3):
            lines.append(AnomalyEvent(step, 0, 0, "forward", "actv", f"layers.{order}.output", "norm", 2.0 + step, 1.0,
                                      "spike", f"spike at step {step}", order).to_json())
        if step >= nan_step:
            lines.append(AnomalyEvent(step, 0, 0, "loss", "scalars", "loss", "value", float("nan"), float("nan"),
                                      "nonfinite", f"first non-finite value at step {step}", 5).to_json())
    (root / "rank0").mkdir(parents=True)
    (root / "rank0" / "anomalies.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_detector_filter_matches_brute_force(tmp_path):
    good = write_run(tmp_path, ranks=4, per_rank=60, seed=3)
    for wanted in ({"spike"}, {"nonfinite"}, {"spike", "nonfinite"}):
        result = analyse_run(tmp_path, top=1000, detectors=wanted)
        chosen = sorted((e for e in good if e["detector"] in wanted), key=reference_key)
        assert [reference_key(e) for e in result["top"]] == [reference_key(e) for e in chosen]
        assert result["counts"]["by_detector"] == {d: sum(e["detector"] == d for e in good) for d in sorted(wanted)}
        assert result["detectors"] == sorted(wanted) and result["detectors_present"] == ["nonfinite", "spike"]
        for key, flag in (("first_nonfinite", True), ("first_spike", False)):
            expected = next((e for e in chosen if is_nonfinite(e) == flag), None)
            assert (result[key] and reference_key(result[key])) == (expected and reference_key(expected))
    # a detector trainmon has but the run never fired: an empty selection, not an error
    empty = analyse_run(tmp_path, detectors={"loss_spike"})
    assert empty["events"] == 0 and empty["first_origin"] is None and empty["top"] == []
    with pytest.raises(UnknownDetectorError, match=r"unknown detector 'spikes'; the run's events come from "
                                                   r"nonfinite, spike \(trainmon's detectors: "):
        analyse_run(tmp_path, detectors={"spikes"})


def test_cli_names_first_nonfinite_and_first_spike_apart(tmp_path, capsys):
    run = write_turbulent_run(tmp_path / "run")
    assert main(["analyse", str(run), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "; first origin: first non-finite value at step 60" in out
    assert "first non-finite: step 60, rank 0 [nonfinite]: first non-finite value at step 60" in out
    assert "first spike: step 1, rank 0 [spike]: spike at step 1" in out
    written = json.loads((run / "anomaly_analyse.json").read_text())
    assert (written["first_origin"]["step"], written["first_origin"]["detector"]) == (60, "nonfinite")
    assert written["first_nonfinite"] == written["first_origin"]
    assert (written["first_spike"]["step"], written["first_spike"]["name"]) == (1, "layers.0.output")
    assert [e["step"] for e in written["top"]] == [1, 1]  # the table stays earliest first

    # repeatable and comma lists
    assert main(["analyse", str(run), "--detector", "nonfinite", "-o", str(tmp_path / "nf.json")]) == 0
    assert "first spike: none" in capsys.readouterr().out
    nonfinite_only = json.loads((tmp_path / "nf.json").read_text())
    assert nonfinite_only["events"] == 10 and nonfinite_only["detectors"] == ["nonfinite"]
    for argv in (["--detector", "spike,nonfinite"], ["--detector", "spike", "--detector", "nonfinite"]):
        assert main(["analyse", str(run), *argv, "-o", str(tmp_path / "both.json")]) == 0
        both = json.loads((tmp_path / "both.json").read_text())
        assert both["events"] == 69 * 3 + 10 and both["detectors"] == ["nonfinite", "spike"]
    capsys.readouterr()
    assert main(["analyse", str(run), "--detector", "loss_spike", "-o", str(tmp_path / "ls.json")]) == 0
    assert "no anomalies from the selected detectors" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    (["--detector", "nonfinte"], "trainmon analyse: error: --detector: unknown detector 'nonfinte'; the run's events "
                                 "come from nonfinite, spike (trainmon's detectors: growth, level, loss_spike, "
                                 "nonfinite, spike)"),
    (["--detector", "spike,,nonfinite"], "--detector: expected detector names"),
    (["--detector", ""], "--detector: expected detector names"),
])
def test_unknown_or_empty_detector_exits_2_writing_nothing(tmp_path, argv, expected):
    run = write_turbulent_run(tmp_path / "run")
    done = subprocess.run([sys.executable, "-m", "trainmon", "analyse", str(run), *argv], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and expected in done.stderr, done.stderr
    assert not (run / "anomaly_analyse.json").exists()


def _page(path: Path) -> dict:
    match = re.search(r'<script id="report-data" type="application/json">(.*?)</script>', path.read_text(), re.S)
    return json.loads(match.group(1))


def test_report_names_both_and_filters_by_detector(tmp_path, capsys):
    run = write_turbulent_run(tmp_path / "run")
    out = run / "report.html"
    assert main(["report", str(run)]) == 0
    anomalies = _page(out)["anomalies"]
    assert (anomalies["first_origin"]["step"], anomalies["first_nonfinite"]["step"]) == (60, 60)
    assert (anomalies["first_spike"]["step"], anomalies["first_spike"]["detector"]) == (1, "spike")
    assert 'id: key.replace("_", "-") + "-text"' in out.read_text()  # drawn as #first-nonfinite-text, #first-spike-text

    assert main(["report", str(run), "--detector", "spike", "-o", str(tmp_path / "spikes.html")]) == 0
    spikes = _page(tmp_path / "spikes.html")["anomalies"]
    assert spikes["first_nonfinite"] is None and spikes["first_origin"]["step"] == 1
    assert spikes["events"] == 69 * 3 and spikes["detectors"] == ["spike"]
    assert {m["step"] for m in spikes["markers"]} == set(range(1, 70))

    before = out.read_bytes()
    capsys.readouterr()
    assert main(["report", str(run), "--detector", "turbulence"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--detector: unknown detector 'turbulence'" in err
    assert out.read_bytes() == before  # report.html untouched


def test_msprobe_events_by_rule_name(tmp_path, capsys):
    """msprobe's own anomaly.json (real output): its AnomalyTurbulence events are spikes, filtered by rule name."""
    assert main(["analyse", str(MSPROBE), "--detector", "AnomalyTurbulence", "-o", str(tmp_path / "a.json")]) == 0
    result = json.loads((tmp_path / "a.json").read_text())
    assert result["events"] > 0 and result["first_nonfinite"] is None
    assert result["first_spike"] == result["first_origin"] == result["top"][0]
    assert main(["analyse", str(MSPROBE), "--detector", "AnomalyTurbulance", "-o", str(tmp_path / "b.json")]) == 2
    assert "the run's events come from AnomalyTurbulence" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()
