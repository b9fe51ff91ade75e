"""``trainmon analyse`` in SQL over a run's store (trainmon/tools/store_analyse.py), against independent references:
the JSON reader's answer from the same ``anomalies.jsonl`` files (itself checked against a brute-force sort), and
float64 numpy for the first non-finite row, the spread across ranks and the robust z scores, computed from the
values the sink was given."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.merge import analyse_run, parse_steps
from trainmon.base.records import Row, RowKey, StepRecord
from trainmon.sinks.parquet import ParquetSink
from trainmon.tools.cli import main
from trainmon.tools.store_analyse import analyse_store

PHASE_RANK = {"forward": 0, "loss": 1, "backward": 2, "communication": 3, "optimizer": 4}  # DESIGN.md + design.md
RANKS, STEPS = 5, 8
FAMILIES = {"actv": "forward", "actv_grad": "backward", "grad_reduced": "optimizer"}
NAMES = {"actv": ["layers.0.output", "layers.1.output", "head.output"],
         "actv_grad": ["layers.1.output_grad", "layers.0.output_grad"],
         "grad_reduced": ["layers.0.weight", "layers.1.weight"]}
OUTLIER_RANK = 3


def _norm(rng: np.random.Generator, family: str, index: int, step: int, rank: int) -> float:
    base = 1.5 + index + 0.1 * step
    if family == "grad_reduced":  # the same on every rank (after the all-reduce), but rank 4 once
        return base * (1.25 if (rank, step, index) == (4, 5, 1) else 1.0)
    value = base * float(np.exp(0.05 * rng.standard_normal()))
    return value * 8.0 if rank == OUTLIER_RANK and step % 2 == 0 else value


def _rows(rng: np.random.Generator, rank: int, step: int) -> list[Row]:
    """Rows of one step of one rank; ``actv_grad`` only on ranks 0-1 (groups of 2 ranks: a spread, no z)."""
    rows, order = [], 0
    for micro_step in range(2):
        for family in FAMILIES:
            if (family == "actv_grad" and rank > 1) or (family == "grad_reduced" and micro_step == 0):
                continue
            for index, name in enumerate(NAMES[family]):
                norm = _norm(rng, family, index, step, rank)
                nonfinite = (rank, step, family, name) in {(2, 6, "actv", "head.output"), (1, 6, "actv_grad", name),
                                                           (0, 7, "grad_reduced", "layers.1.weight")}
                if nonfinite and family != "actv_grad":
                    norm = math.nan
                rows.append(Row(RowKey(family, name, micro_step, 0, order), step,
                                {"norm": norm, "max": norm / 2, "nans": float(nonfinite)}, nonfinite))
                order += 1
    return rows


def _event(rng: random.Random, rank: int) -> AnomalyEvent:
    return AnomalyEvent(rng.randrange(STEPS), rng.randrange(2), rank, rng.choice(list(PHASE_RANK)), "actv",
                        f"layers.{rng.randrange(3)}.output", "norm", rng.choice([1.5, float("nan"), float("inf")]),
                        1.0, rng.choice(["spike", "nonfinite", "loss_spike"]), f"m{rng.randrange(99)}",
                        rng.randrange(6), rank % 2, rng.randrange(2), "2026-11-21T10:00:00.000Z")


def write_store(root: Path, seed: int = 0) -> dict[tuple[int, int], list[Row]]:
    """A 5-rank run with a store: rows per rank and step (returned: the truth), events in ``anomalies.jsonl``
    (stored at close; more appended after, read from the file), ties of equal keys included."""
    rng, pick = np.random.default_rng(seed), random.Random(seed)
    written = {}
    for rank in range(RANKS):
        rank_dir = root / f"rank{rank}"
        rank_dir.mkdir(parents=True)
        lines = []
        for _ in range(40):
            event = _event(pick, rank)
            lines.append(event.to_json())
            if pick.random() < 0.2:  # another detector on the same observation: the same sort key
                lines.append(AnomalyEvent(**{**event.to_dict(), "detector": "spike", "value": 2.0,
                                             "baseline": 1.0}).to_json())
        (rank_dir / "anomalies.jsonl").write_text("\n".join(lines) + "\n")
        sink = ParquetSink(rank_dir, roll_seconds=0.0)
        for step in range(STEPS):
            rows = written[rank, step] = _rows(rng, rank, step)
            sink.write(StepRecord(step=step, rank=rank, rows=rows, scalars={"loss": 1.0}, pp_stage=rank // 2))
            sink.flush()
        sink.close()
        with (rank_dir / "anomalies.jsonl").open("a") as handle:  # written after the store took the file
            handle.write("\n".join(_event(pick, rank).to_json() for _ in range(5)) + "\n")
    return written


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("store_analyse") / "run"
    return root, write_store(root)


def _flat(written: dict, steps=None) -> list[dict]:
    return [{"rank": rank, "step": step, "family": row.family, "name": row.name, "micro_step": row.key.micro_step,
             "vpp_stage": row.key.vpp_stage, "pp_stage": rank // 2, "order": row.key.order, "phase": row.key.phase,
             "norm": row.values["norm"], "nonfinite": row.nonfinite}
            for (rank, step), rows in written.items() if steps is None or step in steps for row in rows]


EVENT_KEYS = ("files", "events", "steps", "detectors", "detectors_present", "first_origin", "first_nonfinite",
              "first_spike", "top", "first_by_step", "counts")


@pytest.mark.parametrize("options", [{}, {"top": 7}, {"steps": parse_steps("2-4,6")}, {"detectors": ["spike"]},
                                     {"steps": parse_steps(",".join(str(s) for s in range(0, 400, 2)))},
                                     {"steps": parse_steps("100-200")}])
def test_events_equal_the_json_readers_answer(store, options):
    root, _ = store
    want = analyse_run(root, top=options.get("top", 20), steps=options.get("steps"), detectors=options.get("detectors"))
    got = analyse_store(root, top=options.get("top", 20), steps=options.get("steps"),
                        detectors=options.get("detectors"), rows=False)
    assert want["corrupt"] == [] and want["events"] > 0 or "steps" in options
    for key in EVENT_KEYS:
        assert got[key] == want[key], key
    assert len(got["top"]) == min(options.get("top", 20), want["events"])


def test_the_first_nonfinite_row_is_the_earliest_in_execution_order(store):
    root, written = store
    rows = [r for r in _flat(written) if r["nonfinite"]]

    def key(r):
        sign = -1 if r["phase"] == "backward" else 1
        return (r["step"], r["micro_step"], PHASE_RANK[r["phase"]], sign * r["vpp_stage"], sign * r["pp_stage"],
                r["order"], r["rank"])

    first = min(rows, key=key)
    got = analyse_store(root)
    found = got["first_nonfinite_row"]
    assert {k: found[k] for k in ("rank", "step", "family", "name", "micro_step", "order", "phase")} == {
        k: first[k] for k in ("rank", "step", "family", "name", "micro_step", "order", "phase")}
    # rank 2's forward comes before rank 1's backward of the same micro-step: the phase orders before the rank
    assert (found["family"], found["step"], found["rank"], found["micro_step"]) == ("actv", 6, 2, 0)
    assert found["values"]["nans"] == 1.0
    assert got["nonfinite_rows"] == {"rows": len(rows), "ranks": len({r["rank"] for r in rows})}


def _groups(written: dict, steps=None) -> dict[tuple, dict[int, float]]:
    groups: dict[tuple, dict[int, float]] = {}
    for r in _flat(written, steps):
        if math.isfinite(r["norm"]):
            key = (r["family"], r["name"], r["step"], r["micro_step"], r["vpp_stage"])
            groups.setdefault(key, {})[r["rank"]] = r["norm"]
    return groups


def _reference_spread(written: dict, top: int, steps=None) -> list[dict]:
    out = []
    for (family, name, step, micro, vpp), by_rank in _groups(written, steps).items():
        if len(by_rank) < 2:
            continue
        ranks, norms = np.array(list(by_rank)), np.array(list(by_rank.values()), dtype=np.float64)
        median, spread = float(np.median(norms)), float(norms.max() - norms.min())
        relative = spread / abs(median) if median else (math.inf if spread else 0.0)
        low = int(ranks[norms == norms.min()].min())
        high = int(ranks[norms == norms.max()].min())
        out.append({"family": family, "name": name, "step": step, "micro_step": micro, "vpp_stage": vpp,
                    "ranks": len(norms), "min": float(norms.min()), "median": median, "max": float(norms.max()),
                    "spread": spread, "relative_spread": relative, "min_rank": low, "max_rank": high})
    out.sort(key=lambda g: (-g["relative_spread"], -g["spread"], g["step"], g["family"], g["name"], g["micro_step"]))
    return out[:top]


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, rel=1e-12), key
        else:
            assert got[key] == value, key


@pytest.mark.parametrize("steps", [None, parse_steps("0-3")])
def test_spread_across_ranks_against_numpy(store, steps):
    root, written = store
    got = analyse_store(root, top=12, steps=steps)["spread"]
    want = _reference_spread(written, 12, steps)
    assert len(got) == len(want) == 12
    for g, w in zip(got, want):
        _same(g, w)
    assert any(g["ranks"] == 2 for g in _reference_spread(written, 10**6))  # actv_grad: ranks 0 and 1 only


def _reference_z(written: dict, top: int) -> dict:
    per_rank: dict[int, list] = {}
    groups = outlying = 0
    for (family, name, step, micro, vpp), by_rank in _groups(written).items():
        if len(by_rank) < 3:
            continue
        ranks, norms = np.array(list(by_rank)), np.array(list(by_rank.values()), dtype=np.float64)
        order = np.argsort(ranks)
        ranks, norms = ranks[order], norms[order]
        median = np.median(norms)
        deviation = np.abs(norms - median)
        mad, mean_ad = np.median(deviation), deviation.mean()
        robust = 1.4826 * mad if mad > 0 else 1.2533 * mean_ad if mean_ad > 0 else None
        if robust is None:
            continue
        scale = max(robust, 0.01 * abs(median))
        groups += 1
        z = (norms - median) / scale
        far = int(np.argmax(deviation))
        outlier = abs(z[far]) >= 3.5
        outlying += int(outlier)
        for i, rank in enumerate(ranks.tolist()):
            per_rank.setdefault(rank, []).append((abs(z[i]), i == far and outlier, step, family, name, norms[i],
                                                  median, z[i], micro, vpp))
    ranked = []
    for rank, items in per_rank.items():
        worst = max(items, key=lambda item: (item[0], -item[2]))
        ranked.append({"rank": rank, "outliers": sum(item[1] for item in items), "groups": len(items),
                       "mean_abs_z": float(np.mean([item[0] for item in items])),
                       "max_abs_z": float(worst[0]),
                       "worst": {"family": worst[3], "name": worst[4], "step": worst[2], "micro_step": worst[8],
                                 "vpp_stage": worst[9], "norm": float(worst[5]), "median": float(worst[6]),
                                 "z": float(worst[7])}})
    ranked.sort(key=lambda r: (-r["outliers"], -r["mean_abs_z"], r["rank"]))
    return {"metric": "norm", "threshold": 3.5, "min_ranks": 3, "groups": groups, "groups_with_outlier": outlying,
            "ranks": ranked[:top]}


def test_deviating_ranks_against_numpy(store):
    root, written = store
    got = analyse_store(root, top=10)["deviating_ranks"]
    want = _reference_z(written, 10)
    assert {k: v for k, v in got.items() if k != "ranks"} == {k: v for k, v in want.items() if k != "ranks"}
    assert [r["rank"] for r in got["ranks"]] == [r["rank"] for r in want["ranks"]]
    for g, w in zip(got["ranks"], want["ranks"]):
        _same({k: v for k, v in g.items() if k != "worst"}, {k: v for k, v in w.items() if k != "worst"})
        _same(g["worst"], w["worst"])
    assert got["ranks"][0]["rank"] == OUTLIER_RANK and got["ranks"][0]["outliers"] > 0
    # the replicated family: every rank agrees (no scale, left out) but rank 4 at step 5 (the mean-AD fallback)
    rank4 = next(r for r in got["ranks"] if r["rank"] == 4)
    assert rank4["outliers"] >= 1


def test_cli_prints_the_row_sections_and_writes_them(store, tmp_path, capsys):
    root, _ = store
    assert main(["analyse", str(root), "-o", str(tmp_path / "out.json"), "--top", "4"]) == 0
    out = capsys.readouterr().out
    assert "from the store (SQL)" in out and "first non-finite row: step 6" in out
    assert "largest spreads of a tensor's norm across ranks" in out and "ranks that deviate most" in out
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["written_by"] == "trainmon analyse" and len(written["top"]) == 4
    assert len(written["spread"]) == 4 and written["deviating_ranks"]["ranks"][0]["rank"] == OUTLIER_RANK
    assert json.loads(json.dumps(written)) == written  # NaN and Inf as strings: valid JSON


def test_a_run_without_a_store_has_null_row_sections(store, tmp_path, capsys):
    root, _ = store
    copy = tmp_path / "run"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("store"))
    assert main(["analyse", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "read trainmon's anomaly events: 5 rank*/anomalies.jsonl files" in out and "trainmon convert" in out
    written = json.loads((copy / "anomaly_analyse.json").read_text())
    assert written["spread"] is None and written["first_nonfinite_row"] is None


def test_a_corrupt_part_is_one_line_exit_2(store, tmp_path, capsys):
    root, _ = store
    broken = tmp_path / "run"
    shutil.copytree(root, broken)
    part = sorted((broken / "store" / "actv" / "rank=2").glob("*.parquet"))[0]
    part.write_bytes(b"PAR1 not parquet")
    assert main(["analyse", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and err.startswith("trainmon analyse: error:"), err
    assert not (broken / "anomaly_analyse.json").exists()


def test_no_duckdb_spill_folder_in_the_working_directory(store, tmp_path, monkeypatch):
    root, _ = store
    monkeypatch.chdir(tmp_path)
    analyse_store(root)
    assert list(tmp_path.iterdir()) == []


def test_a_table_named_with_quotes_is_quoted(store, tmp_path):
    """Table names are folder names: any text; SQL never takes one as code."""
    root, _ = store
    odd = tmp_path / "run"
    shutil.copytree(root, odd)
    (odd / "store" / "actv").rename(odd / "store" / "a'c\"tv")
    got = analyse_store(odd)
    assert got["first_nonfinite_row"]["family"] == "a'c\"tv"
    assert "a'c\"tv" in {g["family"] for g in analyse_store(odd, top=1000)["spread"]}
