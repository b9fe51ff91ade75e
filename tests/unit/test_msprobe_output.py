"""``trainmon analyse`` and ``trainmon csv2tb`` on msprobe's output folders.

tests/data/msprobe_output/ holds output of msprobe's own monitor, trimmed to a few files:
``msprobe-1.2.1/`` from the mindstudio-probe 1.2.1 wheel, ``msprobe-26.2.0/`` from the 26.2.0 wheel
(both run on CPU on a small model: embedding, layers.0-1 (fc1, tanh, fc2), head; targets
``{"layers.0": {}}``, every family, ``alert.dump``). ``anomaly_detected/rank0/anomaly.json`` keeps one
event per tag kind and step; ``anomaly_detected/anomaly_analyse.json`` is what msprobe's own
analyser (``anomaly_analyse.py`` / ``anomaly_processor.py``, top 8) wrote for it: the order trainmon
must reproduce, and a file trainmon must never overwrite.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from trainmon.tools.cli import main
from trainmon.tools.msprobe_output import read_anomalies

DATA = Path(__file__).resolve().parents[1] / "data" / "msprobe_output"
VERSIONS = ("msprobe-1.2.1", "msprobe-26.2.0")


@pytest.fixture(params=VERSIONS)
def output_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A copy of one msprobe ``$MONITOR_OUTPUT_DIR``."""
    return Path(shutil.copytree(DATA / request.param, tmp_path / request.param))


@pytest.mark.parametrize("where", ["", "anomaly_detected", "anomaly_detected/rank0"])
def test_analyse_reads_msprobe_events_in_msprobes_order(output_dir: Path, where: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    theirs_path = output_dir / "anomaly_detected" / "anomaly_analyse.json"
    before = theirs_path.read_bytes()
    folder = output_dir / where
    assert main(["analyse", str(folder), "--top", "8"]) == 0
    out = capsys.readouterr().out
    assert "read msprobe's anomaly events: 1 anomaly.json file" in out and "no anomalies recorded" not in out
    assert theirs_path.read_bytes() == before  # msprobe's own analysis is never overwritten
    result = json.loads((folder / "trainmon_anomaly_analyse.json").read_text())
    assert result["written_by"] == "trainmon analyse" and result["layout"] == "msprobe anomaly.json"
    theirs = json.loads(before)
    assert [f"{e['msprobe_tag']}@{e['step']}" for e in result["top"]] == [
        f"{e['tag_name']}@{e['step']}" for e in theirs.values()]
    assert result["events"] == len(json.loads((output_dir / "anomaly_detected/rank0/anomaly.json").read_text()))
    # Running again replaces trainmon's own file, and nothing else.
    assert main(["analyse", str(folder), "--top", "3"]) == 0
    assert len(json.loads((folder / "trainmon_anomaly_analyse.json").read_text())["top"]) == 3


def test_analyse_never_overwrites_a_file_it_did_not_write(output_dir: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    theirs = output_dir / "anomaly_detected" / "anomaly_analyse.json"
    before = theirs.read_bytes()
    assert main(["analyse", str(output_dir), "-o", str(theirs)]) == 2
    err = capsys.readouterr().err
    assert "was not written by trainmon analyse" in err and len(err.strip().splitlines()) == 1
    assert theirs.read_bytes() == before
    # A trainmon run whose folder holds someone else's anomaly_analyse.json: refused the same way.
    run = tmp_path / "run"
    (run / "rank0").mkdir(parents=True)
    (run / "rank0" / "anomalies.jsonl").write_text("")
    (run / "anomaly_analyse.json").write_text('{"mine": 1}')
    assert main(["analyse", str(run)]) == 2
    assert (run / "anomaly_analyse.json").read_text() == '{"mine": 1}'
    (run / "anomaly_analyse.json").unlink()
    assert main(["analyse", str(run)]) == 0
    assert "read trainmon's anomaly events" in capsys.readouterr().out
    assert main(["analyse", str(run)]) == 0  # its own file is replaced


def _event(tag: str, step: int = 1, call_id: int = 0, pp_stage: int = 0, rank: int = 0) -> dict:
    return {"rank": rank, "step": step, "micro_step": 0, "pp_stage": pp_stage, "vpp_stage": 0, "call_id": call_id,
            "tag_name": tag, "message": f"Rule AnomalyTurbulence reports anomaly signal in ('{tag}', 'norm') at "
                                        f"step {step}.", "group_mates": [0]}


def test_msprobe_order_stage_then_pipeline_then_call_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """msprobe's GradAnomalyData.__lt__: step, micro-step, train stage (-1 for tags it does not know,
    e.g. a parameter, first), pipeline stage ascending in forward and descending otherwise, call id."""
    events = {
        "a": _event("0:1.fc1.weight/rank0/post_grad", call_id=5, pp_stage=0),
        "b": _event("0:1.fc1.weight/rank1/post_grad", call_id=9, pp_stage=1, rank=1),
        "c": _event("0:layers.0_0/rank0/output", call_id=7),
        "d": _event("0:1.fc1.weight", call_id=8),  # a parameter (param_distribution): train stage -1
        "e": _event("0:1.fc1.weight/rank0/efxp_avg_sq", call_id=1),
        "f": _event("0:layers.0_0/rank0/input", step=0, call_id=99),
        "broken": {"rank": "zero"},
    }
    (tmp_path / "anomaly_detected" / "rank0").mkdir(parents=True)
    (tmp_path / "anomaly_detected" / "rank0" / "anomaly.json").write_text(json.dumps(events))
    assert main(["analyse", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "corrupt" not in captured.out and "broken" in captured.err
    result = json.loads((tmp_path / "trainmon_anomaly_analyse.json").read_text())
    assert [e["msprobe_tag"] for e in result["top"]] == [
        "0:layers.0_0/rank0/input", "0:1.fc1.weight", "0:layers.0_0/rank0/output", "0:1.fc1.weight/rank1/post_grad",
        "0:1.fc1.weight/rank0/post_grad", "0:1.fc1.weight/rank0/efxp_avg_sq"]
    families = {e["msprobe_tag"]: (e["family"], e["name"], e["phase"]) for e in result["top"]}
    assert families["0:layers.0_0/rank0/output"] == ("actv", "layers.0.output", "forward")
    assert families["0:1.fc1.weight/rank0/efxp_avg_sq"] == ("exp_avg_sq", "1.fc1.weight", "optimizer")
    assert families["0:1.fc1.weight"] == ("param", "1.fc1.weight", "optimizer")
    assert result["corrupt_total"] == 1


def test_newer_msprobe_events_carry_values() -> None:
    events, problems = read_anomalies(DATA / "msprobe-26.2.0" / "anomaly_detected" / "rank0" / "anomaly.json")
    assert not problems
    first = min(events, key=lambda e: e["msprobe_key"])
    assert (first["family"], first["name"], first["metric"]) == ("actv", "layers.0.input", "mean")
    assert isinstance(first["value"], float) and isinstance(first["baseline"], float)


def _scalars(events_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (path,) = events_dir.glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_csv2tb_reads_both_msprobe_layouts(output_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (rank_folder,) = [p for p in output_dir.iterdir() if "-rank0-" in p.name]
    assert main(["csv2tb", str(output_dir), "--per-tensor"]) == 0
    out = capsys.readouterr().out
    layout = "msprobe 1.2 CSV" if output_dir.name == "msprobe-1.2.1" else "msprobe 8.x-26.x CSV"
    assert f"read {layout}" in out
    scalars = _scalars(output_dir / "tensorboard" / rank_folder.name)
    actv = pd.read_csv(rank_folder / "actv_0-0.csv")
    if layout == "msprobe 1.2 CSV":  # module_name "layers.0_0" (micro-step 0), columns "input.norm", ...
        expected = float(actv.loc[actv["module_name"] == "layers.0_0", "output.norm"].iloc[0])
    else:  # name "layers.0.output", column "norm"
        expected = float(actv.loc[actv["name"] == "layers.0.output", "norm"].iloc[0])
    assert scalars["actv/layers.0.output/norm"] == [(0, pytest.approx(expected, rel=1e-6))]
    assert any(tag.startswith("actv_grad/layers.0.input_grad/") for tag in scalars)
    assert not any("shape" in tag or "dtype" in tag for tag in scalars)
    grads = pd.read_csv(rank_folder / "grad_reduced_0-0.csv")
    name_column = "param_name" if "param_name" in grads else "name"
    first = grads.iloc[0]
    assert scalars[f"grad_reduced/{first[name_column]}/max"] == [(0, pytest.approx(float(first['max']), rel=1e-6))]
    assert scalars["grad_reduced/max_max"] == [(0, pytest.approx(float(grads["max"].max()), rel=1e-6))]
    # Only some families; and nothing msprobe wrote is touched.
    assert main(["csv2tb", str(rank_folder), "--families", "other"]) == 0
    tags = _scalars(rank_folder / "tensorboard" / rank_folder.name)
    assert tags and all(tag.startswith("other/") for tag in tags)


def test_msprobe_output_without_anomaly_events_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copytree(DATA / "msprobe-1.2.1", tmp_path / "out", ignore=shutil.ignore_patterns("anomaly_detected"))
    assert main(["analyse", str(tmp_path / "out")]) == 2
    assert "msprobe output without anomaly events" in capsys.readouterr().err
