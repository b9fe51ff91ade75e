"""``trainmon analyse`` against a brute-force reference, corrupt lines, and the CLI."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.merge import StepRanges, analyse_run, parse_steps
from trainmon.tools.cli import main

PHASE_RANK = {"forward": 0, "loss": 1, "backward": 2, "communication": 3, "optimizer": 4}


def reference_key(e):
    """DESIGN.md: step, micro-step, phase, stage (ascending forward, descending backward), order."""
    back = e["phase"] == "backward"
    stage = (-e["vpp_stage"], -e["pp_stage"]) if back else (e["vpp_stage"], e["pp_stage"])
    return (e["step"], e["micro_step"], PHASE_RANK[e["phase"]], *stage, e["order"], e["rank"])


def write_run(root, ranks=6, per_rank=80, seed=0):
    rng = random.Random(seed)
    good = []
    for rank in range(ranks):
        lines = []
        for _ in range(per_rank):
            e = AnomalyEvent(rng.randrange(10), rng.randrange(2), rank, rng.choice(list(PHASE_RANK)), "actv",
                             f"layers.{rng.randrange(4)}.output", "norm", rng.choice([1.5, float("nan")]), 1.0,
                             rng.choice(["spike", "nonfinite"]), "m", rng.randrange(50), rank % 3,
                             rng.randrange(2), "2026-11-21T10:00:00.000Z")
            good.append(e.to_dict())
            # other writers may order keys differently: the slow path must read them too
            lines.append(json.dumps(e.to_dict(), sort_keys=True) if rng.random() < 0.1 else e.to_json())
        if rank == 2:
            lines.insert(5, '{"step": 1, "micro_ste')          # truncated (crash mid-write)
            lines.insert(9, "")                                 # blank lines are fine
            lines.insert(12, json.dumps({**good[-1], "step": "7"}))  # wrong type
        (root / f"rank{rank}").mkdir(parents=True)
        (root / f"rank{rank}" / "anomalies.jsonl").write_text("\n".join(lines) + "\n")
    return good


def test_analyse_matches_brute_force_reference(tmp_path):
    good = write_run(tmp_path)
    result = analyse_run(tmp_path, top=15)
    ordered = sorted(good, key=reference_key)
    assert [reference_key(e) for e in result["top"]] == [reference_key(e) for e in ordered[:15]]
    # first non-finite (the nonfinite detector, or a NaN/Inf value) and first spike (the rest), found apart;
    # the first origin is the first non-finite when there is one
    nonfinite = [e for e in ordered if e["detector"] == "nonfinite" or e["value"] == "nan"]
    spikes = [e for e in ordered if e not in nonfinite]
    assert reference_key(result["first_nonfinite"]) == reference_key(nonfinite[0])
    assert reference_key(result["first_spike"]) == reference_key(spikes[0])
    assert result["first_origin"] == result["first_nonfinite"]
    assert result["events"] == len(good) and result["files"] == 6
    firsts = {}
    for e in ordered:
        firsts.setdefault(e["step"], e)
    assert [reference_key(e) for e in result["first_by_step"]] == [reference_key(firsts[s]) for s in sorted(firsts)]
    assert result["counts"]["by_rank"] == {str(r): 80 for r in range(6)}
    assert sum(result["counts"]["by_detector"].values()) == len(good)
    assert [(c["file"], c["line"]) for c in result["corrupt"]] == [("rank2/anomalies.jsonl", 6),
                                                                  ("rank2/anomalies.jsonl", 13)]
    subset = analyse_run(tmp_path, top=1000, steps={3, 5})
    assert sorted(reference_key(e) for e in subset["top"]) == sorted(
        reference_key(e) for e in good if e["step"] in (3, 5))


def test_parse_steps():
    assert set(parse_steps("1,3,5-9")) == {1, 3, 5, 6, 7, 8, 9}
    assert str(parse_steps("9,5-7,1,8,3-3")) == "1,3,5-9"  # sorted and merged
    for bad in ("", "1,,2", "5-3", "a", "-1", "1-"):
        with pytest.raises(ValueError):
            parse_steps(bad)


def test_huge_step_ranges_stay_lazy_and_are_clipped_to_int64():
    """``--steps 0-99999999999999`` must not build a list; steps past int64 cannot occur in a run."""
    steps = parse_steps("0-99999999999999," + ",".join(["5-99999999999999999999999"] * 1000))
    assert steps.ranges == ((0, 2**63 - 1),)
    assert 2**63 - 1 in steps and 2**63 not in steps and -1 not in steps
    assert parse_steps("99999999999999999999999").ranges == ()
    sample = np.array([0, 4, 5, 9, 10, 2**62], dtype=np.int64)
    assert parse_steps("4-5,9,20-30").mask(sample).tolist() == [False, True, True, True, False, False]
    assert StepRanges.of({3, 1, 2, 7}) == parse_steps("1-3,7")


def test_analyse_with_a_huge_step_range(tmp_path):
    good = write_run(tmp_path, ranks=2, per_rank=20)
    result = analyse_run(tmp_path, top=1000, steps=parse_steps("3-99999999999999"))
    assert result["events"] == sum(1 for e in good if e["step"] >= 3)
    assert result["steps"] == "3-99999999999999"


def test_cli(tmp_path, capsys):
    write_run(tmp_path / "run", ranks=2, per_rank=10)
    assert main(["analyse", str(tmp_path / "run"), "--top", "3", "-o", str(tmp_path / "out")]) == 0
    out = capsys.readouterr()
    assert "first origin:" in out.out and "rank  step  micro  phase" in out.out
    written = json.loads((tmp_path / "out" / "anomaly_analyse.json").read_text())
    assert len(written["top"]) == 3
    assert main(["analyse", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["analyse", str(tmp_path / "run"), "--steps", "4-1"])
    assert info.value.code == 2


def test_garbled_middle_of_a_line_is_corrupt_not_counted(tmp_path):
    """The fast path must check the whole line, not only its start and closing brace."""
    events = [AnomalyEvent(step, 0, 0, "forward", "actv", f"layers.{step}.output", "norm", 2.0, 1.0, "spike",
                           "spike: forward output of layers.1 (norm) at step 4 is 2, baseline 1", step, 0, 0,
                           "2026-11-21T10:00:00.000Z") for step in range(8)]
    lines = [e.to_json() for e in events]
    middle = len(lines[5]) // 2
    lines[5] = lines[5][:middle] + '@#"}{' + lines[5][middle + 5:]  # bytes overwritten mid-line
    lines[6] = lines[6].replace('"value":2.0', '"value":"2.0x"')  # still JSON, wrong type
    lines[7] = lines[7].replace("baseline 1", "baseline\x01 1")  # a control character inside a string
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "anomalies.jsonl").write_text("\n".join(lines) + "\n")
    result = analyse_run(tmp_path, top=2)  # the garbled lines are not among the reported ones
    assert [c["line"] for c in result["corrupt"]] == [6, 7, 8] and result["corrupt_total"] == 3
    assert result["events"] == 5 and result["counts"]["by_step"] == {str(s): 1 for s in range(5)}
    assert [e["step"] for e in result["top"]] == [0, 1]
