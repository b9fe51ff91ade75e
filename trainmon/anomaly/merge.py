"""Reading and merging every rank's ``anomalies.jsonl`` of a run (framework-free): :func:`analyse_run`.

The checked line readers (one regex per file, a validating slow path per line) and the merge, over the steps to keep
(:class:`~trainmon.anomaly.step_ranges.StepRanges`, :func:`parse_steps`: :mod:`trainmon.anomaly.step_ranges`):
events ordered earliest first with the DESIGN.md rule (see :mod:`trainmon.anomaly.ordering`). Only the top ``K``
events, the earliest event of every step, the first non-finite and the first spike (:mod:`trainmon.anomaly.firsts`),
and counts are kept in memory, so a 1,024-rank run with 1,000 events per rank is merged in seconds. Corrupt lines
are reported with their file and line number and skipped. ``trainmon analyse`` (:mod:`trainmon.tools.analyse`)
prints and writes the result; ``trainmon report`` draws it.
"""

from __future__ import annotations

import heapq
import json
import os
import re
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np

from trainmon.anomaly.events import NONFINITE_DETECTORS, decode_float
from trainmon.anomaly.firsts import check_detectors, headline
from trainmon.anomaly.ordering import PHASE_RANK, sort_key_fields
from trainmon.anomaly.step_ranges import StepRanges
from trainmon.anomaly.step_ranges import parse_steps as parse_steps  # also its address before the split (docs, tests)
from trainmon.base.inputs import INT64_MAX, read_regular
from trainmon.base.progress import Bar

_INT_FIELDS = ("step", "micro_step", "rank", "order", "pp_stage", "vpp_stage")
_STR_FIELDS = ("phase", "family", "name", "metric", "detector", "message")
_MAX_CORRUPT_KEPT = 1000
_NONFINITE_TEXT = frozenset({'"nan"', '"inf"', '"-inf"', "nan", "inf", "-inf"})  # a value as a line spells it
RANK_DIR = re.compile(r"rank(\d+)$")
"""A rank directory's name (``rank{R}``)."""


def _check(event: Any) -> tuple[int, ...]:
    """Fully validate one parsed event; return its earliest-first sort key."""
    if not isinstance(event, dict):
        raise ValueError(f"expected a JSON object, got {type(event).__name__}")
    for name in _INT_FIELDS:
        value = event.get(name, 0) if name in ("pp_stage", "vpp_stage") else event[name]
        if type(value) is not int:
            raise ValueError(f"field {name!r} must be an integer, got {str(value)[:50]}")
        if not -INT64_MAX <= value <= INT64_MAX:
            raise ValueError(f"field {name!r} is out of the int64 range: {str(value)[:50]}...")
    for name in _STR_FIELDS:
        if type(event[name]) is not str:
            raise ValueError(f"field {name!r} must be a string, got {event[name]!r}")
    if event["phase"] not in PHASE_RANK:
        raise ValueError(f"unknown phase {event['phase']!r}")
    decode_float(event["value"])
    decode_float(event["baseline"])
    return sort_key_fields(event["step"], event["micro_step"], event["phase"], event.get("pp_stage", 0),
                           event.get("vpp_stage", 0), event["order"], event["rank"])


def find_files(run_dir: Path) -> list[Path]:
    """``rank{R}/anomalies.jsonl`` files of a run, by rank (or the file of one rank directory)."""
    if RANK_DIR.match(run_dir.name) and os.path.lexists(run_dir / "anomalies.jsonl"):
        return [run_dir / "anomalies.jsonl"]
    found = []
    for path in run_dir.glob("rank*/anomalies.jsonl"):
        match = RANK_DIR.match(path.parent.name)
        if match:
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


# A line as AnomalyEvent.to_json writes it (events.WRITE_ORDER, compact separators, ASCII): the
# sort-key fields first, then every other field in order, each checked for its JSON type. One regex
# per file reads a whole file several times faster than json.loads per line. A line that does not
# match it entirely (another writer's key order or spacing, corruption anywhere in the line) takes
# the slow path: json.loads and a full check, else it is reported as corrupt. The events that are
# reported (top K, first per step) are always fully parsed and validated. An event whose step's data is known
# ends with a flat ``"batch"`` object (no nested object: lists of ranges and numbers).
_INT = r"(0|[1-9]\d{0,17})"  # at most 18 digits: always an int64 (longer: the checked slow path)
_STRING = r'"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*"'
_FLOAT = r'(?:-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?|"nan"|"inf"|"-inf")'
_FAST = re.compile(
    rf'^\{{"step":{_INT},"micro_step":{_INT},"rank":{_INT},"phase":"([a-z]+)","pp_stage":{_INT},'
    rf'"vpp_stage":{_INT},"order":{_INT},"detector":"(\w+)","family":{_STRING},"name":{_STRING},'
    rf'"metric":{_STRING},"value":({_FLOAT}),"baseline":{_FLOAT},"message":{_STRING},"time":{_STRING}'
    r'(?:,"batch":\{[^{}\n]*\})?\}$',
    re.M)
_Fields: TypeAlias = tuple[str, ...]  # (step, micro_step, rank, phase, pp_stage, vpp_stage, order, detector, value)


def _slow_line(line: str) -> _Fields:
    match = _FAST.match(line)
    if match and match.group(4) in PHASE_RANK:
        return match.groups()
    event = _loads(line)
    _check(event)
    return (str(event["step"]), str(event["micro_step"]), str(event["rank"]), event["phase"],
            str(event.get("pp_stage", 0)), str(event.get("vpp_stage", 0)), str(event["order"]), event["detector"],
            str(event["value"]))


def _loads(line: str) -> Any:
    """``json.loads`` that reports a too deeply nested line as a ValueError, not a RecursionError."""
    try:
        return json.loads(line)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


class _Merger:
    """Folds files into the top-K heap, the first event per step, counts and corrupt lines."""

    def __init__(self, top: int, steps: StepRanges | None, detectors: frozenset[str] | None = None) -> None:
        self.top = top
        self.steps = steps
        self.detectors = detectors
        self.present: set[str] = set()  # every detector of the files, selected or not
        self.heap: list[tuple[tuple[int, ...], int, dict[str, Any]]] = []  # keys negated: a max-heap
        self.first_by_step: dict[int, tuple[tuple[int, ...], str, int, str]] = {}
        self.first_of: dict[bool, tuple[tuple[int, ...], str, int, str]] = {}  # non-finite? -> earliest
        self.by_rank: Counter[int] = Counter()
        self.by_step: Counter[int] = Counter()
        self.by_detector: Counter[str] = Counter()
        self.by_rank_step: Counter[tuple[int, int]] | None = None  # with analyse_run(rank_steps=True)
        self.events = 0
        self.corrupt: list[dict[str, Any]] = []
        self.corrupt_total = 0
        self._seen = 0

    def bad(self, label: str, line: int, error: str) -> None:
        self.corrupt_total += 1
        if len(self.corrupt) < _MAX_CORRUPT_KEPT:
            self.corrupt.append({"file": label, "line": line, "error": printable(error[:200])})

    def scan(self, path: Path, label: str) -> None:
        try:
            text = read_regular(path).decode("utf-8", errors="replace")
        except OSError as exc:
            self.bad(label, 0, f"cannot read: {exc.strerror or exc}")
            return
        numbered = [(n, line) for n, line in enumerate(text.split("\n"), start=1) if line.strip()]
        fields = _FAST.findall(text)
        if len(fields) != len(numbered) or not set(f[3] for f in fields) <= PHASE_RANK.keys():
            fields, kept = [], []
            for number, line in numbered:
                try:
                    fields.append(_slow_line(line))
                    kept.append((number, line))
                except (ValueError, KeyError, TypeError) as exc:
                    self.bad(label, number, f"missing field {exc}" if isinstance(exc, KeyError) else str(exc))
            numbered = kept
        if fields:
            self._fold(fields, numbered, label)

    def _fold(self, fields: list[_Fields], numbered: list[tuple[int, str]], label: str) -> None:
        columns = list(zip(*fields))
        # One C-level parse of the six integer columns (much faster than int() or astype per value).
        text = ",".join(",".join(columns[i]) for i in (0, 1, 2, 4, 5, 6))
        ints = np.fromstring(text, dtype=np.int64, sep=",").reshape(6, -1)
        step, micro, rank, pp_stage, vpp_stage, order = ints
        phase = np.array([PHASE_RANK[p] for p in columns[3]], dtype=np.int64)
        detectors: Sequence[str] = columns[7]
        self.present.update(detectors)
        nonfinite = np.fromiter((d in NONFINITE_DETECTORS or v in _NONFINITE_TEXT
                                 for d, v in zip(detectors, columns[8])), dtype=bool, count=len(detectors))
        if self.steps is not None or self.detectors is not None:
            keep = self.steps.mask(step) if self.steps is not None else np.ones(len(step), dtype=bool)
            if self.detectors is not None:
                keep &= np.fromiter((d in self.detectors for d in detectors), dtype=bool, count=len(detectors))
            step, micro, rank, pp_stage, vpp_stage, order, phase, nonfinite = (
                a[keep] for a in (step, micro, rank, pp_stage, vpp_stage, order, phase, nonfinite))
            numbered = [item for item, k in zip(numbered, keep.tolist()) if k]
            detectors = [d for d, k in zip(detectors, keep.tolist()) if k]
            if not numbered:
                return
        self.events += len(step)
        self.by_detector.update(detectors)
        for counter, values in ((self.by_rank, rank), (self.by_step, step)):
            unique, counts = np.unique(values, return_counts=True)
            counter.update(dict(zip(unique.tolist(), counts.tolist())))
        if self.by_rank_step is not None:
            pairs, counts = np.unique(np.stack([rank, step], axis=1), axis=0, return_counts=True)
            self.by_rank_step.update(dict(zip(map(tuple, pairs.tolist()), counts.tolist())))
        sign = np.where(phase == PHASE_RANK["backward"], -1, 1)
        keys = np.stack([step, micro, phase, sign * vpp_stage, sign * pp_stage, order, rank], axis=1)
        ranking = np.lexsort(keys.T[::-1])
        for index in ranking[: self.top].tolist():
            self._offer_top(tuple(keys[index].tolist()), numbered[index], label)
        first_steps, first_at = np.unique(step[ranking], return_index=True)
        for step_value, at in zip(first_steps.tolist(), first_at.tolist()):
            index = int(ranking[at])
            key = tuple(keys[index].tolist())
            known = self.first_by_step.get(step_value)
            if known is None or key < known[0]:
                self.first_by_step[step_value] = (key, label, *numbered[index])
        for kind in (True, False):  # the earliest non-finite event, the earliest spike
            hits = ranking[nonfinite[ranking] == kind]
            if len(hits):
                key = tuple(keys[int(hits[0])].tolist())
                if kind not in self.first_of or key < self.first_of[kind][0]:
                    self.first_of[kind] = (key, label, *numbered[int(hits[0])])

    def _offer_top(self, key: tuple[int, ...], numbered: tuple[int, str], label: str) -> None:
        entry_key = tuple(-k for k in key)
        if len(self.heap) >= self.top and (entry_key, -self._seen) <= self.heap[0][:2]:
            return
        event = self._full(label, *numbered)
        if event is None:
            return
        entry = (entry_key, -self._seen, event)
        self._seen += 1
        if len(self.heap) < self.top:
            heapq.heappush(self.heap, entry)
        else:
            heapq.heapreplace(self.heap, entry)

    def _full(self, label: str, number: int, line: str) -> dict[str, Any] | None:
        """A reported event: parsed and validated in full (None, and reported, if corrupt)."""
        try:
            event: dict[str, Any] = _loads(line)  # a dict: _check says so
            _check(event)
        except (ValueError, KeyError, TypeError) as exc:
            self.bad(label, number, f"missing field {exc}" if isinstance(exc, KeyError) else str(exc))
            return None
        return event

    def first_events(self) -> list[dict[str, Any]]:
        out = []
        for _, (_, label, number, line) in sorted(self.first_by_step.items()):
            event = self._full(label, number, line)
            if event is not None:
                out.append(event)
        return out

    def first(self, nonfinite: bool) -> dict[str, Any] | None:
        """The earliest non-finite event (``True``) or spike (``False``), or None."""
        found = self.first_of.get(nonfinite)
        return self._full(*found[1:]) if found is not None else None


def analyse_run(run_dir: str | Path, top: int = 20, steps: StepRanges | Iterable[int] | None = None,
                progress: bool = False, rank_steps: bool = False,
                detectors: Collection[str] | None = None) -> dict[str, Any]:
    """Merge the anomalies of every rank of a run.

    Args:
        run_dir: ``{output_dir}/{run_name}``, holding ``rank{R}/anomalies.jsonl``.
        top: how many earliest events to keep.
        steps: only these steps (None: all): a :class:`StepRanges` (see :func:`parse_steps`) or ints.
        progress: draw a progress bar (files, rate, ETA, events) on stderr when it is a terminal.
        rank_steps: also count events per (rank, step): ``counts["by_rank_step"]``, a list of
            ``[rank, step, events]`` (the cross-rank timeline of ``trainmon report``).
        detectors: only the events of these detectors (None: all), e.g. ``{"nonfinite"}``.

    Returns:
        ``{"run_dir", "files", "events", "steps", "detectors", "detectors_present", "first_origin",
        "first_nonfinite", "first_spike", "top", "first_by_step", "counts": {"by_rank", "by_step",
        "by_detector"}, "corrupt", "corrupt_total"}``; events as they appear in ``anomalies.jsonl``
        (non-finite values as "nan"/"inf" strings); ``steps`` is the selection as text (``"1,3,5-9"``)
        or None, ``detectors`` the selected detectors or None. ``first_nonfinite`` is the earliest
        non-finite event (see :func:`~trainmon.anomaly.events.reports_nonfinite`), ``first_spike`` the
        earliest of the other detectors', ``first_origin`` the first non-finite when there is one, else
        the earliest event (:func:`~trainmon.anomaly.firsts.headline`).

    Raises:
        FileNotFoundError: ``run_dir`` is not a directory.
        ~trainmon.anomaly.firsts.UnknownDetectorError: a name in ``detectors`` is neither a detector of
            the run's events nor one trainmon or msprobe has.

    Example:
        >>> analyse_run("/nonexistent")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        FileNotFoundError: run directory /nonexistent does not exist
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"run directory {root} does not exist")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    if steps is not None and not isinstance(steps, StepRanges):
        steps = StepRanges.of(steps)
    files = find_files(root)
    merger = _Merger(top, steps, frozenset(detectors) if detectors is not None else None)
    if rank_steps:
        merger.by_rank_step = Counter()
    with Bar(len(files), "analyse", enabled=None if progress else False) as bar:
        for path in files:
            merger.scan(path, str(path.relative_to(root)))
            bar.advance(events=merger.events)
    check_detectors(detectors, merger.present)
    ordered = [event for _, _, event in sorted(merger.heap, reverse=True)]
    first_nonfinite, first_spike = merger.first(True), merger.first(False)
    return {
        "run_dir": str(root),
        "files": len(files),
        "events": merger.events,
        "steps": str(steps) if steps is not None else None,
        "detectors": sorted(detectors) if detectors is not None else None,
        "detectors_present": sorted(merger.present),
        "first_origin": headline(first_nonfinite, ordered),
        "first_nonfinite": first_nonfinite,
        "first_spike": first_spike,
        "top": ordered,
        "first_by_step": merger.first_events(),
        "counts": {"by_rank": {str(k): v for k, v in sorted(merger.by_rank.items())},
                   "by_step": {str(k): v for k, v in sorted(merger.by_step.items())},
                   "by_detector": dict(sorted(merger.by_detector.items())),
                   **({"by_rank_step": [[r, s, n] for (r, s), n in sorted(merger.by_rank_step.items())]}
                      if merger.by_rank_step is not None else {})},
        "corrupt": merger.corrupt,
        "corrupt_total": merger.corrupt_total,
    }


def printable(text: str) -> str:
    """Control characters escaped: a crafted file cannot break the table or drive the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


__all__ = ["RANK_DIR", "analyse_run", "find_files", "printable"]
