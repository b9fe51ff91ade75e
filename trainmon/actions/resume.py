"""Reading a rollback back (``{run}/rollback.json``): where the resumed run starts and which data it leaves out.

:func:`read_rollback` finds the newest rollback of a run (or of a folder of runs), with the data every rank's
rollback of the same launch names; the :class:`Rollback` it returns is what the resumed run needs: the checkpoint,
the step to start at, and the skip list to hand to :class:`~trainmon.actions.skip_list.SkipSampler` and to
``monitor.resume``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from trainmon.actions.skip_list import SkipList, batch_identity
from trainmon.base.inputs import find_runs, is_dir, read_regular

ROLLBACK_FILE = "rollback.json"
"""The rollback of a run, in the run directory (then ``rollback.1.json``, ...: never replaced)."""
VERSION = 1
"""The version of the file's layout."""


@dataclass
class Rollback:
    """A rollback read back from ``rollback.json`` (:func:`read_rollback`): where to resume and what to skip.

    Attributes:
        path: the file read.
        step: the step at whose end the run stopped.
        rank: the rank that stopped it.
        exit_code: the process's exit status.
        reason: the first event's message.
        checkpoint: the last healthy checkpoint, as given to ``monitor.state_dict(checkpoint=...)`` (None: none was
            named; ``resume_step`` 0 then means "from the start").
        resume_step: the first step to run again (``attach(start_step=...)``; the checkpoint's ``state["step"]``);
            None when no healthy state is known.
        skip: the data the resumed run must not train on: the data the stopped run skipped itself (it resumed from
            an earlier rollback) and that of the flagged steps from ``resume_step`` on.
        start_step: the stopped run's first step.
        time: when it stopped (ISO-8601 UTC).
    """

    path: Path
    step: int
    rank: int
    exit_code: int
    reason: str
    checkpoint: str | None
    resume_step: int | None
    skip: SkipList = field(default_factory=SkipList)
    start_step: int = 0
    time: str = ""

    @classmethod
    def from_dict(cls, data: object, path: Path) -> Rollback:
        """Raises ValueError naming ``path`` when ``data`` is not a rollback."""

        def bad(what: str) -> ValueError:
            return ValueError(f"{path}: not a trainmon rollback ({what})")

        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise bad(f"expected an object with version {VERSION}")
        ints = {key: data.get(key) for key in ("step", "rank", "exit_code", "start_step")}
        if any(isinstance(v, bool) or not isinstance(v, int) for v in ints.values()):
            raise bad("step, rank, exit_code and start_step must be integers")
        resume, checkpoint = data.get("resume_step"), data.get("checkpoint")
        if resume is not None and (isinstance(resume, bool) or not isinstance(resume, int) or resume < 0):
            raise bad(f"resume_step must be null or an integer >= 0, got {resume!r}")
        if checkpoint is not None and not isinstance(checkpoint, str):
            raise bad(f"checkpoint must be null or a string, got {checkpoint!r}")
        entries = data.get("skip", [])
        if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("step"), int)
                                                    for e in entries):
            raise bad("skip must be a list of entries with an integer step")
        try:
            for entry in entries:
                entry["batch"] = batch_identity(entry.get("batch"))
        except (TypeError, ValueError) as exc:
            raise bad(str(exc)) from None
        return cls(path=path, step=ints["step"], rank=ints["rank"], exit_code=ints["exit_code"],  # type: ignore[arg-type]
                   reason=str(data.get("reason", "")), checkpoint=checkpoint, resume_step=resume,
                   skip=SkipList(entries), start_step=ints["start_step"], time=str(data.get("time", "")))  # type: ignore[arg-type]


def read_rollback(path: str | Path, checkpoint: str | Path | None = None) -> Rollback | None:
    """The newest rollback under ``path``, or None when there is none.

    Each rank that stops writes its own file; the newest one is taken, with the skip entries of the other ranks'
    files of the same launch (the same ``start_step``) added, and the earliest of their checkpoints.

    Args:
        path: a ``rollback*.json`` file, a run directory (``{output_dir}/{run_name}``) or an output directory
            holding runs (the newest rollback of any of them).
        checkpoint: only a rollback that names this checkpoint (compared as resolved paths).

    Raises:
        ValueError: a rollback file that is not one (names the file).
        OSError: a file cannot be read.
    """
    path = Path(path)
    if not is_dir(path):
        return _read_file(path)
    files = _rollback_files(path) or [f for run in find_runs(path) for f in _rollback_files(run)]
    rollbacks = [_read_file(f) for f in files]
    if checkpoint is not None:
        wanted = Path(checkpoint).resolve()
        rollbacks = [r for r in rollbacks if r.checkpoint is not None and Path(r.checkpoint).resolve() == wanted]
    if not rollbacks:
        return None
    newest = max(rollbacks, key=lambda r: (r.time, str(r.path)))
    launch = [r for r in rollbacks if r.path.parent == newest.path.parent and r.start_step == newest.start_step]
    first = min(launch, key=lambda r: (r.resume_step is not None, r.resume_step or 0))  # unknown first, then earliest
    skip = SkipList()
    for other in launch:
        skip = skip.union(other.skip)
    return Rollback(newest.path, newest.step, newest.rank, newest.exit_code, newest.reason, first.checkpoint,
                    first.resume_step, skip, newest.start_step, newest.time)


def _rollback_files(run_dir: Path) -> list[Path]:
    try:
        return sorted(p for p in run_dir.glob("rollback*.json") if p.is_file())
    except OSError:
        return []


def _read_file(path: Path) -> Rollback:
    try:
        data = json.loads(read_regular(path))
    except ValueError as exc:
        raise ValueError(f"{path}: not a trainmon rollback (not JSON: {exc})") from None
    return Rollback.from_dict(data, path)
