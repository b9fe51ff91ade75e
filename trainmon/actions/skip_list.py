"""Which data a step trained on, and the skip list: the data of the steps a run should not train on again.

**The identity of a step's data** (:func:`batch_identity`), as the loop gives it (``monitor.step(batch=...)``,
``monitor.batch(...)``) or a trainer's callback finds it, is a small JSON object:

- ``{"samples": [[start, end], ...]}``: sample indices (of the dataset the sampler draws from), as sorted,
  merged half-open ranges. From a sample range ``(start, end)`` (a tuple: Megatron's consumed samples before and
  after the step), a ``range``, one index, or a sequence / numpy array / CPU tensor of indices (a shuffled batch).
- ``{"batches": [[epoch, first, end], ...]}``: the data loader's batches ``first .. end - 1`` of that epoch (HF
  Trainer, Lightning), counted in the loader's own order.

**The skip list** is ``{run}/rank{R}/skip_list.jsonl``: one line per step whose data should not be trained on
again (skipped by the step guard, or flagged by a detector of ``anomaly.rollback.detectors``), with the step, the
reason and the data's identity; appended on a writer thread (:class:`~trainmon.actions.rollback.RollbackKeeper`),
never rewritten. :class:`SkipList` reads it back (every rank's), and :class:`SkipSampler` drops its samples from a
sampler, so a resumed run never sees them. Framework-free: a sampler is any iterable of indices.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from trainmon.base.inputs import rank_dirs_of, read_regular

SKIP_LIST_FILE = "skip_list.jsonl"
"""The file of a rank's skip list, in ``{run}/rank{R}/``."""
_IDENTITY_KEYS = ("samples", "batches")
Range = tuple[int, int]


# ----------------------------------------------------------------------------- the identity of a step's data
def batch_identity(value: object) -> dict[str, Any] | None:
    """The JSON identity of a batch (see the module docstring).

    Args:
        value: None; a sample range ``(start, end)`` (a tuple of two ints, end excluded); a ``range``; one sample
            index; a sequence, numpy array or CPU tensor of sample indices (any order, repeats allowed); or an
            identity dict (``{"samples": [[a, b], ...]}`` and/or ``{"batches": [[epoch, first, end], ...]}``).

    Raises:
        TypeError: another type, a float, or a tensor on a device (copying it would make the step wait for the
            device: pass the indices the sampler gave, on the CPU).
        ValueError: a negative index, a range whose end is before its start, or a malformed identity dict.

    Example:
        >>> batch_identity((8, 16)), batch_identity([5, 3, 4, 9])
        ({'samples': [[8, 16]]}, {'samples': [[3, 6], [9, 10]]})
        >>> batch_identity({"batches": [[0, 4, 5]]})
        {'batches': [[0, 4, 5]]}
    """
    if value is None:
        return None
    if isinstance(value, Mapping):
        return _checked_identity(value)
    if isinstance(value, bool):
        raise TypeError(f"batch: expected sample indices or a (start, end) range, got {value!r}")
    if isinstance(value, int):
        return {"samples": _ranges_of([(value, value + 1)])}
    if isinstance(value, tuple) and len(value) == 2 and all(_is_int(v) for v in value):
        start, end = int(value[0]), int(value[1])
        if end < start:
            raise ValueError(f"batch: the sample range (start, end) ends before it starts: {value!r}")
        return {"samples": _ranges_of([(start, end)] if end > start else [])}
    if isinstance(value, range) and value.step == 1:
        return {"samples": _ranges_of([(value.start, value.stop)] if value.stop > value.start else [])}
    return {"samples": _index_ranges(value)}


def merge_identities(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """The identity of the data of both (the micro-batches of one step).

    Example:
        >>> merge_identities({"samples": [[0, 4]]}, {"samples": [[4, 8]], "batches": [[0, 1, 2]]})
        {'samples': [[0, 8]], 'batches': [[0, 1, 2]]}
    """
    if first is None or second is None:
        return first if second is None else second
    merged: dict[str, Any] = {}
    if "samples" in first or "samples" in second:
        merged["samples"] = _ranges_of(first.get("samples", []) + second.get("samples", []))
    if "batches" in first or "batches" in second:
        merged["batches"] = _batch_ranges(first.get("batches", []) + second.get("batches", []))
    return merged


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _index_ranges(value: object) -> list[list[int]]:
    """Sorted merged ranges of the indices in ``value`` (a sequence, numpy array or CPU tensor)."""
    device = getattr(value, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise TypeError(f"batch: sample indices must be on the CPU (a {device} tensor would make the step wait for "
                        "the device); pass the indices the sampler gave")
    if hasattr(value, "detach"):  # a torch tensor: a zero-copy view of its CPU memory
        value = value.detach().numpy()
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray, range)):
        raise TypeError(f"batch: expected sample indices or a (start, end) range, got {type(value).__name__}")
    array = np.asarray(value)
    if array.size == 0:
        return []
    if array.dtype.kind not in "iu":
        raise TypeError(f"batch: sample indices must be integers, got {array.dtype} values")
    indices = np.unique(array.astype(np.int64, copy=False).ravel())
    if indices[0] < 0:
        raise ValueError(f"batch: sample indices must be >= 0, got {int(indices[0])}")
    last = np.flatnonzero(np.diff(indices) != 1)  # the last index of each run but the final one
    starts = indices[np.concatenate(([0], last + 1))]
    ends = indices[np.concatenate((last, [indices.size - 1]))] + 1
    result: list[list[int]] = np.stack([starts, ends], axis=1).tolist()
    return result


def _ranges_of(ranges: Iterable[Sequence[Any]] | npt.NDArray[np.int64]) -> list[list[int]]:
    """Sorted, merged ``[start, end)`` ranges (empty ones dropped): in Python for a few, with numpy for many (a
    shuffled batch of 1,024 samples is about as many ranges)."""
    if not isinstance(ranges, np.ndarray):
        ranges = list(ranges)
        if len(ranges) <= 16:
            return _few_ranges_of(ranges)
    table = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    table = table[table[:, 1] > table[:, 0]]
    if not len(table):
        return []
    if table[:, 0].min() < 0:
        raise ValueError(f"batch: sample indices must be >= 0, got {int(table[:, 0].min())}")
    table = table[np.argsort(table[:, 0], kind="stable")]
    reach = np.maximum.accumulate(table[:, 1])  # the furthest end so far
    new = np.ones(len(table), dtype=bool)
    new[1:] = table[1:, 0] > reach[:-1]  # a gap before it: a new range begins
    starts = table[new, 0]
    ends = reach[np.flatnonzero(np.append(new[1:], True))]
    merged: list[list[int]] = np.stack([starts, ends], axis=1).tolist()
    return merged


def _few_ranges_of(ranges: list[Sequence[Any]]) -> list[list[int]]:
    merged: list[list[int]] = []
    for start, end in sorted((int(a), int(b)) for a, b in ranges if int(b) > int(a)):
        if start < 0:
            raise ValueError(f"batch: sample indices must be >= 0, got {start}")
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _batch_ranges(batches: Iterable[Sequence[int]]) -> list[list[int]]:
    """Sorted, merged ``[epoch, first, end)`` batch ranges."""
    by_epoch: dict[int, list[tuple[int, int]]] = {}
    for epoch, first, end in batches:
        by_epoch.setdefault(int(epoch), []).append((first, end))
    return [[epoch, first, end] for epoch in sorted(by_epoch) for first, end in _ranges_of(by_epoch[epoch])]


def _checked_identity(value: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(value) - set(_IDENTITY_KEYS)
    if unknown or not value:
        raise ValueError(f"batch: an identity dict has the keys {list(_IDENTITY_KEYS)}, got {sorted(map(str, value))}")
    identity: dict[str, Any] = {}
    if "samples" in value:
        ranges = value["samples"]
        if not isinstance(ranges, Sequence) or not all(
                isinstance(r, Sequence) and len(r) == 2 and all(_is_int(v) for v in r) for r in ranges):
            raise ValueError(f"batch: 'samples' must be a list of [start, end] ranges, got {ranges!r}")
        identity["samples"] = _ranges_of(ranges)
    if "batches" in value:
        ranges = value["batches"]
        if not isinstance(ranges, Sequence) or not all(
                isinstance(r, Sequence) and len(r) == 3 and all(_is_int(v) and v >= 0 for v in r) for r in ranges):
            raise ValueError(f"batch: 'batches' must be a list of [epoch, first, end] ranges, got {ranges!r}")
        identity["batches"] = _batch_ranges(ranges)
    return identity


# ----------------------------------------------------------------------------- the skip list
class SkipList:
    """The entries of one or more skip lists: each a step whose data is not to be trained on again.

    An entry is a dict: ``step``, ``rank``, ``reason`` (the detector, e.g. ``nonfinite``, or ``step_guard
    (nonfinite)``), ``applied`` (whether the step's update was applied), ``message``, ``time`` and ``batch`` (the
    data's identity, None where the loop gave none).

    Args:
        entries: the entries (as :meth:`read` and a rollback's ``skip`` hold them).

    Example:
        >>> skip = SkipList([{"step": 7, "batch": {"samples": [[56, 64]]}}, {"step": 9, "batch": None}])
        >>> skip.samples(), skip.steps(), 60 in skip
        ([(56, 64)], [7, 9], True)
    """

    def __init__(self, entries: Iterable[Mapping[str, Any]] = ()) -> None:
        self.entries: list[dict[str, Any]] = [dict(entry) for entry in entries]
        self._samples: list[Range] | None = None

    @classmethod
    def read(cls, run_dir: str | Path) -> SkipList:
        """Every rank's ``skip_list.jsonl`` of a run, by rank and line (a run without one: empty).

        A last line cut short (a crash while writing) is left out.

        Raises:
            ValueError: a line that is not an entry (names the file and the line).
            OSError: a file cannot be read.
        """
        entries: list[dict[str, Any]] = []
        for rank_dir in rank_dirs_of(Path(run_dir)):
            path = rank_dir / SKIP_LIST_FILE
            if path.exists():
                entries += read_entries(path)
        return cls(entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.entries)

    def __contains__(self, index: object) -> bool:
        """Whether the sample ``index`` is skipped."""
        if not _is_int(index):
            return False
        ranges = self.samples()
        at = bisect.bisect_right([start for start, _ in ranges], int(index)) - 1  # type: ignore[call-overload]
        return at >= 0 and int(index) < ranges[at][1]  # type: ignore[call-overload]

    def steps(self) -> list[int]:
        """The steps of the entries, sorted, once each."""
        return sorted({int(entry["step"]) for entry in self.entries})

    def samples(self) -> list[Range]:
        """The skipped sample indices as sorted, merged ``(start, end)`` ranges."""
        if self._samples is None:
            ranges = [r for entry in self.entries for r in (entry.get("batch") or {}).get("samples", [])]
            self._samples = [(start, end) for start, end in _ranges_of(ranges)]
        return self._samples

    def batches(self) -> dict[int, list[Range]]:
        """The skipped batches of the data loader: ``{epoch: [(first, end), ...]}``, sorted and merged."""
        found: dict[int, list[Range]] = {}
        rows = [r for entry in self.entries for r in (entry.get("batch") or {}).get("batches", [])]
        for epoch, first, end in _batch_ranges(rows):
            found.setdefault(epoch, []).append((first, end))
        return found

    def after(self, step: int) -> SkipList:
        """The entries of steps ``>= step``."""
        return SkipList(entry for entry in self.entries if int(entry["step"]) >= step)

    def union(self, other: Iterable[Mapping[str, Any]]) -> SkipList:
        """Both lists' entries (an entry of the same step, rank and data once)."""
        seen, entries = set(), []
        for entry in [*self.entries, *other]:
            key = (entry.get("step"), entry.get("rank"), json.dumps(entry.get("batch"), sort_keys=True))
            if key not in seen:
                seen.add(key)
                entries.append(entry)
        return SkipList(entries)


def read_entries(path: Path) -> list[dict[str, Any]]:
    """The entries of one ``skip_list.jsonl`` (see :meth:`SkipList.read`)."""
    text = read_regular(path).decode("utf-8", errors="replace")
    lines = text.split("\n")
    complete = lines[:-1] if not text.endswith("\n") else lines  # the last line of a crash: cut short
    entries = []
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: not a skip-list entry ({exc})") from None
        if not isinstance(entry, dict) or not _is_int(entry.get("step")):
            raise ValueError(f"{path}:{number}: not a skip-list entry (an object with an integer 'step')")
        batch = entry.get("batch")
        if batch is not None:
            if not isinstance(batch, Mapping):
                raise ValueError(f"{path}:{number}: 'batch' must be an object or null, got {batch!r}")
            try:
                entry["batch"] = batch_identity(batch)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
        entries.append(entry)
    return entries


def skip_list_of(skip: object) -> SkipList:
    """A :class:`SkipList` from a skip list, a rollback (its ``skip``), entries, or ``(start, end)`` sample ranges;
    None: empty."""
    if skip is None:
        return SkipList()
    if isinstance(skip, SkipList):
        return skip
    inner = getattr(skip, "skip", None)
    if isinstance(inner, SkipList):  # a trainmon.actions.rollback.Rollback
        return inner
    items = list(skip)  # type: ignore[call-overload]
    if all(isinstance(item, Mapping) for item in items):
        return SkipList(items)
    identity = batch_identity({"samples": [list(item) for item in items]})
    return SkipList([{"step": -1, "batch": identity}])


class SkipSampler:
    """A sampler that leaves out the samples of a skip list, in the inner sampler's order otherwise.

    Wrap the sampler of the resumed run's data loader: ``DataLoader(data, sampler=SkipSampler(sampler,
    rollback), batch_size=...)``. When the skipped samples are exactly the batches of the skipped steps (the
    identities a loop gives), every other batch is the batch it would have been, one step earlier per batch skipped.

    Args:
        sampler: any iterable of sample indices (a torch ``Sampler``, a ``range``, a list).
        skip: what to leave out: a :class:`~trainmon.actions.rollback.Rollback`, a :class:`SkipList`, its
            entries, or ``(start, end)`` sample ranges; None leaves nothing out.

    Example:
        >>> list(SkipSampler(range(10), [(2, 4), (7, 8)]))
        [0, 1, 4, 5, 6, 8, 9]
        >>> len(SkipSampler(range(10), [(2, 4), (7, 8)]))
        7
    """

    def __init__(self, sampler: Iterable[int], skip: object) -> None:
        self.sampler = sampler
        self.skip = skip_list_of(skip)
        ranges = self.skip.samples()
        self._starts = [start for start, _ in ranges]
        self._ends = [end for _, end in ranges]

    def __iter__(self) -> Iterator[int]:
        starts, ends = self._starts, self._ends
        if not starts:
            yield from self.sampler
            return
        for index in self.sampler:
            at = bisect.bisect_right(starts, index) - 1
            if at < 0 or index >= ends[at]:
                yield index

    def __len__(self) -> int:
        """Exact for a sampler that yields each index of ``range(n)`` once (a ``range``, torch's
        ``SequentialSampler``, ``RandomSampler`` without replacement); otherwise the inner sampler's length (an upper
        bound: the epoch ends a little before the loop expects)."""
        total = len(self.sampler)  # type: ignore[arg-type]
        n = _permutation_size(self.sampler)
        if n is None:
            return total
        return total - sum(max(0, min(end, n) - start) for start, end in zip(self._starts, self._ends) if start < n)

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the inner sampler (``DistributedSampler``), when it has ``set_epoch``."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)


def _permutation_size(sampler: object) -> int | None:
    """``n`` when ``sampler`` yields every index of ``range(n)`` exactly once, else None (not known)."""
    if isinstance(sampler, range):
        return len(sampler) if sampler.start == 0 and sampler.step == 1 else None
    kind = type(sampler)
    if kind.__module__.startswith("torch.utils.data") and kind.__name__ in ("SequentialSampler", "RandomSampler"):
        source = getattr(sampler, "data_source", None)
        size = len(source) if source is not None and hasattr(source, "__len__") else None
        replacement = bool(getattr(sampler, "replacement", False))
        if size is not None and not replacement and len(sampler) == size:  # type: ignore[arg-type]
            return size
    return None
