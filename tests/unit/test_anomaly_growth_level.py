"""The ``growth`` and ``level`` detectors against hand-computed steps and an independent numpy reference."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from trainmon.anomaly.detectors import build_detectors
from trainmon.base.records import Row, RowKey, StepRecord
from trainmon.config import load_config
from trainmon.errors import ConfigError

NAN, INF = math.nan, math.inf


def fired_steps(spec: dict, values: list[float], name: str = "grad_norm") -> list[int]:
    detector = build_detectors([spec])[0]
    return [s for s, v in enumerate(values) if detector.update(StepRecord(s, 0, scalars={name: v}), "t")]


# ------------------------------------------------------------------------------------------------ growth
GROWTH = {"type": "growth", "series": ["grad_norm"], "window": 8, "blocks": 4, "factor": 2.0}


def test_growth_fires_on_a_staircase_climb_at_the_first_full_window():
    # blocks of 2: medians 1, 1.5, 2, 3 at step 7 (each >= 2^(1/6) = 1.12x the one before, 3x in all)
    assert fired_steps(GROWTH, [1, 1, 1.5, 1.5, 2, 2, 3, 3]) == [7]
    # one block that does not rise (1.5 -> 1.6 is 1.07x < 1.12x) stops it, however large the total rise
    assert fired_steps(GROWTH, [1, 1, 1.5, 1.5, 1.6, 1.6, 9, 9]) == []
    # 1.9x in all is below the factor 2
    assert fired_steps(GROWTH, [1, 1, 1.3, 1.3, 1.6, 1.6, 1.9, 1.9]) == []


def test_growth_ignores_a_level_shift_and_single_spikes():
    shift = [1.0] * 10 + [10.0] * 30  # windows across the jump hold two flat blocks
    assert fired_steps(GROWTH, shift) == []
    spiky = [1.0] * 40
    for s in (12, 19, 25, 33):  # one odd value per block of 3 never moves its median
        spiky[s] = 100.0
    assert fired_steps({**GROWTH, "window": 12}, spiky) == []


def test_growth_fires_once_per_rise_and_rearms_after_falling_back():
    climb = [1.2 ** s for s in range(12)]
    # step 7: medians 1.2^0.5 .. 1.2^6.5 (x2.99); next alarm when the last median doubled since: 1.2^10.5 at step 11
    assert fired_steps(GROWTH, climb) == [7, 11]
    again = climb[:8] + [0.5] * 8 + [1.2 ** s for s in range(8)]
    # falls back below 1.2^6.5 (re-armed at step 8), then climbs again from 0.5: at step 20 the medians are
    # 0.5, 0.75, 1.32, 1.90 (blocks [.5 .5] [.5 1] [1.2 1.44] [1.728 2.0736])
    assert fired_steps(GROWTH, again) == [7, 20]


def test_growth_persist_min_value_and_warmup():
    climb = [1.1 ** s for s in range(30)]
    # factor 2 with blocks of 2 over 1.1^6 = 1.77 is not reached; 1.1^8 = 2.14 needs medians 8 apart: window 12
    spec = {**GROWTH, "window": 12, "blocks": 4}  # blocks of 3: medians 1.1^1, 1.1^4, 1.1^7, 1.1^10 at step 11
    assert fired_steps(spec, climb)[0] == 11
    assert fired_steps({**spec, "persist": 3}, climb)[0] == 13
    assert fired_steps({**spec, "warmup": 20}, climb)[0] == 20
    assert fired_steps({**spec, "min_value": 5.0}, climb)[0] == 18  # last median 1.1^(s-1) > 5 from s - 1 = 17
    # skipped values do not enter the state
    assert fired_steps(GROWTH, [1, 1, NAN, 1.5, 1.5, -3, 2, 2, 0, 3, 3, INF]) == [10]


def _reference_growth(values: np.ndarray, window: int, blocks: int, factor: float) -> list[int]:
    """Block medians with numpy, the once-per-rise rule written out."""
    size = window // blocks
    kept = size * blocks
    rise = factor ** (1 / (2 * (blocks - 1)))
    out, fired_at, seen = [], 0.0, []
    for step, value in enumerate(values):
        seen.append(value)
        if len(seen) < kept:
            continue
        medians = np.median(np.asarray(seen[-kept:]).reshape(blocks, size), axis=1)
        if fired_at and medians[-1] < fired_at:
            fired_at = 0.0
        if (medians[-1] >= factor * medians[0] and np.all(medians[1:] >= medians[:-1] * rise)
                and (not fired_at or medians[-1] >= factor * fired_at)):
            out.append(step)
            fired_at = medians[-1]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_growth_matches_a_numpy_reference_on_random_walks(seed):
    rng = np.random.default_rng(seed)
    drift = rng.choice([0.0, 0.01, 0.03, -0.01])
    values = np.exp(np.cumsum(drift + 0.05 * rng.standard_normal(600)))
    spec = {"type": "growth", "series": ["grad_norm"], "window": 60, "blocks": 4, "factor": 1.5}
    assert fired_steps(spec, values.tolist()) == _reference_growth(values, 60, 4, 1.5)


def test_growth_on_rows_names_the_head_and_round_trips():
    def records(start: int, stop: int) -> list[StepRecord]:
        return [StepRecord(s, 0, rows=[Row(RowKey("attn", f"blocks.0.attn.head{h}", 0, 0, h), s,
                                           {"max_logit": (1.05 ** s if h == 2 else 3.0), "entropy": 1.0}, False)
                                       for h in range(4)]) for s in range(start, stop)]
    spec = {"type": "growth", "series": ["attn/*/max_logit"], "window": 20, "blocks": 4, "factor": 2.0}
    whole = build_detectors([spec])[0]
    events = [e for r in records(0, 80) for e in whole.update(r, "t")]
    assert {(e.family, e.name, e.metric) for e in events} == {("attn", "blocks.0.attn.head2", "max_logit")}
    # medians of blocks of 5 are the middle values: 1.05^2 .. 1.05^17 = 2.08x at the first full window (step 19)
    assert events[0].step == 19 and events[0].baseline == pytest.approx(1.05 ** 2)
    first, second = build_detectors([spec])[0], build_detectors([spec])[0]
    before = [e for r in records(0, 37) for e in first.update(r, "t")]
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    after = [e for r in records(37, 80) for e in second.update(r, "t")]
    assert [e.step for e in before + after] == [e.step for e in events]
    assert second.state_dict() == whole.state_dict()


def _heads(step: int, logits: list[float]) -> StepRecord:
    return StepRecord(step, 0, rows=[Row(RowKey("attn", f"blocks.{h // 2}.attn.head{h % 2}", 0, 0, h), step,
                                         {"max_logit": v}, False) for h, v in enumerate(logits)])


def test_growth_reduce_max_watches_the_largest_value_of_each_step():
    spec = {"type": "growth", "series": ["attn/*/max_logit"], "window": 20, "blocks": 4, "factor": 2.0,
            "reduce": "max"}
    # a small head triples while the largest stays flat: each head on its own fires, the largest does not
    small = [[3.0 * 1.06 ** s, 100.0, 50.0, 20.0] for s in range(60)]
    assert [r.step for r in map(_heads, range(60), small) if build_detectors([spec])[0].update(r, "")] == []
    per_head = build_detectors([{**spec, "reduce": "none"}])[0]
    assert any(per_head.update(_heads(s, v), "") for s, v in enumerate(small))
    # the largest value climbs while the head holding it changes: one series, the largest of each step (numpy)
    rng = np.random.default_rng(0)
    logits = np.exp(rng.normal(0, 0.3, (120, 4))) * 20
    logits[60:, :] *= 1.04 ** np.arange(60)[:, None] * rng.uniform(0.8, 1.0, (60, 4))
    detector = build_detectors([spec])[0]
    events = [e for s in range(120) for e in detector.update(_heads(s, logits[s].tolist()), "")]
    assert [e.step for e in events] == _reference_growth(logits.max(axis=1), 20, 4, 2.0)
    first = events[0]  # the event names the head that held the largest value at that step
    head = int(logits[first.step].argmax())
    assert first.name == f"blocks.{head // 2}.attn.head{head % 2}"
    assert first.value == pytest.approx(logits[first.step].max()) and "the largest of attn/*/max_logit" in first.message
    again = build_detectors([spec])[0]
    again.load_state_dict(json.loads(json.dumps(detector.state_dict())))
    assert again.state_dict() == detector.state_dict()


# ------------------------------------------------------------------------------------------------- level
LEVEL = {"type": "level", "series": ["precursors/*/eps_underflow"], "threshold": 0.5, "persist": 3}


def eps_records(values: list[float], name: str = "blocks.0.mlp.fc1.weight") -> list[StepRecord]:
    return [StepRecord(s, 0, rows=[Row(RowKey("precursors", name, 0, 0, 0), s, {"eps_underflow": v}, False)])
            for s, v in enumerate(values)]


def level_steps(spec: dict, values: list[float]) -> list[int]:
    detector = build_detectors([spec])[0]
    return [r.step for r in eps_records(values) if detector.update(r, "t")]


def test_level_fires_on_the_persist_th_value_once_per_excursion():
    values = [0, 0, 0.6, 0.6, 0.6, 0.6, 0.2, 0.7, 0.7, 0.4, 0.7, 0.7, 0.7, 1.0]
    assert level_steps(LEVEL, values) == [4, 12]
    assert level_steps({**LEVEL, "persist": 1}, values) == [2, 7, 10]
    assert level_steps({**LEVEL, "threshold": 0.6}, values) == [12]  # 0.6 itself is not above 0.6


def test_level_from_below_and_direction_down_and_warmup():
    high_from_start = [0.9] * 5 + [0.1] + [0.9] * 4
    assert level_steps(LEVEL, high_from_start) == [8]  # first seen on the quiet side at step 5
    assert level_steps({**LEVEL, "from_below": False}, high_from_start) == [2, 8]
    assert level_steps({**LEVEL, "warmup": 6, "from_below": False}, [0.9] * 10) == [8]  # counts from step 6
    falling = [5.0, 4.0, 0.5, 0.4, 0.3, 2.0]
    assert level_steps({**LEVEL, "threshold": 1.0, "direction": "down", "persist": 2}, falling) == [3]
    assert level_steps(LEVEL, [NAN, 0.0, INF, 0.9, NAN, 0.9, 0.9]) == [6]  # non-finite values are skipped


def test_level_events_and_state_round_trip():
    values = [0.0] * 3 + [0.8] * 4 + [0.0] + [0.95] * 5
    whole = build_detectors([LEVEL])[0]
    events = [e for r in eps_records(values) for e in whole.update(r, "t")]
    assert [(e.step, e.family, e.name, e.metric, e.value, e.baseline) for e in events] == [
        (5, "precursors", "blocks.0.mlp.fc1.weight", "eps_underflow", 0.8, 0.5),
        (10, "precursors", "blocks.0.mlp.fc1.weight", "eps_underflow", 0.95, 0.5)]
    assert "above 0.5 for 3 values in a row" in events[0].message
    first, second = build_detectors([LEVEL])[0], build_detectors([LEVEL])[0]
    records = eps_records(values)
    before = [e.step for r in records[:9] for e in first.update(r, "t")]
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    after = [e.step for r in records[9:] for e in second.update(r, "t")]
    assert before + after == [5, 10] and second.state_dict() == whole.state_dict()


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("spec, key, words", [
    ({"type": "level", "series": ["loss"]}, "anomaly.detectors[0].threshold", "is required"),
    ({"type": "level", "threshold": NAN}, "anomaly.detectors[0].threshold", "finite"),
    ({"type": "level", "threshold": 1, "direction": "both"}, "anomaly.detectors[0].direction", "up"),
    ({"type": "level", "threshold": 1, "persist": 0}, "anomaly.detectors[0].persist", ">= 1"),
    ({"type": "level", "threshold": 1, "treshold": 2}, "anomaly.detectors[0].treshold", "unknown key"),
    ({"type": "level", "threshold": 1, "series": ["precursors/*/norm"]}, "anomaly.detectors[0].series[0]",
     "eps_underflow"),
    ({"type": "growth", "factor": 1.0}, "anomaly.detectors[0].factor", "> 1"),
    ({"type": "growth", "window": 3}, "anomaly.detectors[0].window", ">= 4"),
    ({"type": "growth", "window": 10, "blocks": 6}, "anomaly.detectors[0].blocks", "2 values per block"),
    ({"type": "growth", "min_value": -1}, "anomaly.detectors[0].min_value", ">= 0"),
    ({"type": "growth", "series": []}, "anomaly.detectors[0].series", "at least one"),
    ({"type": "growth", "window": 100, "persit": 2}, "anomaly.detectors[0].persit", "unknown key"),
    ({"type": "growth", "reduce": "min"}, "anomaly.detectors[0].reduce", "max"),
])
def test_bad_specs_fail_at_construction_naming_the_key(spec, key, words):
    with pytest.raises(ConfigError) as info:
        load_config({"anomaly": {"detectors": [spec]}})
    assert key in str(info.value) and words in str(info.value), str(info.value)
