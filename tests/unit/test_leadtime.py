"""The lead-time benchmark's arithmetic (``benchmarks/leadtime.py``) on hand-made losses and event lists: the loss
event rule, lead times, early alarms, false alarms per 10,000 healthy steps, the threshold chosen under a budget."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.leadtime import (  # noqa: E402
    RunAlarms,
    from_ranges,
    loss_event,
    outcome,
    poisson_upper,
    summarise,
    to_ranges,
    tune,
)


def test_event_is_the_first_high_loss_of_the_window_whose_median_crosses() -> None:
    losses = [1.0] * 150 + [1.2, 1.35, 1.1, 1.4, 1.5, 1.6] + [2.0] * 10
    # the median of 5 first exceeds 1.5x the level (1.0) at step 157 (1.4, 1.5, 1.6, 2.0, 2.0: 1.6); the first
    # loss above 1.5 of steps 153-157 is step 155 (1.5 is not above)
    assert loss_event(losses) == 155


def test_one_odd_batch_is_no_event_and_a_fall_is_none_either() -> None:
    losses = [1.0] * 200
    losses[150] = 5.0
    losses[170] = 4.0
    assert loss_event(losses) is None
    assert loss_event([2.0] * 110 + [0.1] * 100) is None


def test_nonfinite_loss_is_the_event_at_its_step_even_early() -> None:
    assert loss_event([1.0] * 20 + [math.inf]) == 20
    assert loss_event([1.0] * 200 + [math.nan] + [1.0] * 5) == 200


def test_event_needs_the_level_window_first() -> None:
    assert loss_event([10.0] + [1.0] * 50 + [3.0] * 10) is None  # steps before 104: no level yet
    assert loss_event([1.0] * 104 + [3.0] * 5) == 104


def test_checking_the_last_step_after_each_step_finds_what_a_full_scan_finds() -> None:
    losses = [1.0 + 0.01 * (i % 7) for i in range(300)] + [1.0 + 0.02 * k for k in range(60)]
    found = None
    for n in range(1, len(losses) + 1):
        found = loss_event(losses[:n], last_only=True)
        if found is not None:
            break
    assert found == loss_event(losses) is not None


def test_lead_is_event_minus_first_alarm_in_the_window() -> None:
    run = RunAlarms("lr_ramp", 600, onset=300, event=500, alarms=[410, 470, 495, 500])
    result = outcome(run, window=100)
    assert result is not None and result.lead == 90 and not result.early  # 410 is inside [400, 500]
    result = outcome(run, window=50)
    assert result is not None and result.lead == 30 and result.early  # 410 is before [450, 500]


def test_window_starts_at_the_onset_and_alarms_after_the_event_do_not_count() -> None:
    run = RunAlarms("repeated_batch", 400, onset=300, event=330, alarms=[300, 331])
    result = outcome(run, window=100)
    assert result is not None and result.lead == 30 and not result.early
    missed = outcome(RunAlarms("repeated_batch", 400, onset=300, event=330, alarms=[331, 340]), window=100)
    assert missed is not None and missed.lead is None and not missed.early


def test_runs_without_an_event_and_healthy_runs_have_no_outcome() -> None:
    assert outcome(RunAlarms("eps_underflow", 700, onset=300, event=None, alarms=[310])) is None
    assert outcome(RunAlarms("healthy", 2500, healthy_alarms=3)) is None


def test_runs_without_an_event_report_their_first_alarm_after_the_onset() -> None:
    runs = [RunAlarms("eps_underflow", 700, onset=300, alarms=[312, 350]),
            RunAlarms("eps_underflow", 700, onset=300, alarms=[450]),  # past the window: not reported
            RunAlarms("eps_underflow", 700, onset=325, alarms=[])]
    summary = summarise(runs, window=100)
    assert summary.after_onset == {"eps_underflow": [12]}
    assert summary.runs["eps_underflow"] == 3 and summary.recall("eps_underflow") == (0, 0)


def test_summary_counts_healthy_steps_of_healthy_runs_and_before_each_onset() -> None:
    runs = [
        RunAlarms("healthy", 2500, healthy_alarms=1),
        RunAlarms("healthy", 2500, onset=300),  # a healthy variant with a schedule change: every step is healthy
        RunAlarms("lr_ramp", 520, onset=300, event=500, healthy_alarms=1, alarms=[480]),
        RunAlarms("lr_ramp", 540, onset=325, event=520, alarms=[]),
        RunAlarms("eps_underflow", 750, onset=300, event=None, alarms=[]),
        RunAlarms("logit_growth", 460, onset=300, event=440, alarms=[305, 430, 431]),
    ]
    summary = summarise(runs, window=100)
    healthy_steps = 2500 + 2500 + 300 + 325 + 300 + 300
    assert summary.healthy_steps == healthy_steps
    assert summary.false_alarms == 2
    assert summary.fa_per_10k == pytest.approx(2e4 / healthy_steps)
    assert summary.recall("lr_ramp") == (1, 2) and summary.leads["lr_ramp"] == [20]
    assert summary.median_lead("logit_growth") == 10 and summary.early["logit_growth"] == 1
    assert summary.runs["eps_underflow"] == 1 and summary.recall("eps_underflow") == (0, 0)
    assert summary.median_lead("eps_underflow") is None
    assert summary.fa_upper_95 == pytest.approx(1e4 * poisson_upper(2) / healthy_steps)


def test_tune_takes_the_most_sensitive_threshold_within_the_budget() -> None:
    def healthy(alarms: int) -> RunAlarms:
        return RunAlarms("healthy", 20_000, healthy_alarms=alarms)

    by_threshold = {"3": summarise([healthy(9)]), "6": summarise([healthy(2)]), "10": summarise([healthy(0)])}
    assert tune(by_threshold, budget=1.0) == "6"  # 2 alarms in 20,000 steps: exactly 1 per 10,000
    assert tune(by_threshold, budget=0.5) == "10"
    assert tune({"3": summarise([healthy(9)])}, budget=1.0) is None


def test_poisson_upper_bound_matches_the_chi_square_values() -> None:
    # one-sided 95% upper bounds of a Poisson mean (Garwood): 0 -> 2.996, 1 -> 4.744, 5 -> 10.513
    assert [round(poisson_upper(k), 3) for k in (0, 1, 5)] == [2.996, 4.744, 10.513]


def test_ranges_round_trip() -> None:
    steps = [1, 2, 3, 7, 9, 10]
    assert to_ranges(steps) == [[1, 3], [7, 7], [9, 10]]
    assert from_ranges(to_ranges(steps)) == steps
    assert to_ranges([]) == []
