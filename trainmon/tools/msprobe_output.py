"""Reading msprobe's monitor output folders (framework-free), for ``trainmon csv2tb`` and ``trainmon analyse``.

msprobe writes under ``$MONITOR_OUTPUT_DIR`` (default ``./monitor_output``):

- ``{time}-rank{R}-{id}/{family}_{a}-{b}.csv``: one folder per rank and process, one file per
  family and block of ``step_count_per_record`` steps. Two header layouts exist:
  msprobe 1.2.x ``[vpp_stage,]module_name,step,input.{op}...,output.{op}...`` (activations; the
  module name ends in ``_{micro_step}``) and ``[vpp_stage,]param_name,step,{op}...``; newer msprobe
  (8.x to 26.x) ``vpp_stage,name,step[,micro_step],{op}...`` with the ``shape`` and ``dtype`` columns.
- ``anomaly_detected/rank{R}/anomaly.json``: msprobe's anomaly events (``alert.dump``), one JSON
  object keyed by ``{tag}_step_{s}_call_{c}``; msprobe's own analyser writes
  ``anomaly_analyse.json`` next to them, which trainmon never overwrites.

Rows are given trainmon's TensorBoard tags ``{family}/{name}/{metric}`` with msprobe's names
(squashed when msprobe's ``squash_name`` was on, see docs/msprobe.md); events get trainmon's event fields.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Collection, Container, Iterator
from pathlib import Path
from typing import Any

from trainmon.anomaly.events import decode_float, reports_nonfinite
from trainmon.anomaly.firsts import check_detectors, headline
from trainmon.base.inputs import is_dir, read_regular
from trainmon.base.records import ACTIVATION_KINDS, activation_row

RANK_FOLDER = re.compile(r"([\w-]{0,20})-rank(\d{1,5})-.*")
"""msprobe's per-rank output folder (``OUTPUT_DIR_PATTERN`` in msprobe's constants)."""
CSV_FILE = re.compile(r"(.+)_(\d+)-(\d+)\.csv")
ANOMALY_FOLDER = "anomaly_detected"
ANOMALY_FILE = "anomaly.json"
_NAME_COLUMNS = ("name", "module_name", "param_name")
_NOT_METRICS = ("shape", "dtype")
_KINDS = (*ACTIVATION_KINDS["actv"], *ACTIVATION_KINDS["actv_grad"])


# ----------------------------------------------------------------------------------- CSV
def is_rank_folder(folder: Path) -> bool:
    """A msprobe rank folder: its name matches ``{time}-rank{R}-{id}`` and it holds msprobe CSV files."""
    return bool(RANK_FOLDER.fullmatch(folder.name)) and is_dir(folder) and any(_csv_files(folder))


def rank_folders(folder: Path) -> list[Path]:
    """The msprobe rank folders of ``folder``: itself if it is one, else its children that are (by name)."""
    if is_rank_folder(folder):
        return [folder]
    try:
        children = sorted(p for p in folder.iterdir() if RANK_FOLDER.fullmatch(p.name) and is_dir(p))
    except (OSError, ValueError):
        return []
    return [p for p in children if any(_csv_files(p)) or any(p.glob("events.out.tfevents.*"))]


def _csv_files(folder: Path) -> Iterator[Path]:
    try:
        yield from (p for p in sorted(folder.iterdir()) if CSV_FILE.fullmatch(p.name))
    except (OSError, ValueError):
        return


def csv_family(path: Path) -> str | None:
    """``grad_reduced_0-99.csv`` -> ``grad_reduced`` (None: not a msprobe CSV name)."""
    match = CSV_FILE.fullmatch(path.name)
    return match.group(1) if match else None


def layout_of(header: list[str]) -> str | None:
    """``"msprobe 1.2"`` or ``"msprobe 8.x-26.x"`` for a msprobe CSV header, else None."""
    fixed = header[1:] if header[:1] == ["vpp_stage"] else header
    if fixed[:2] in (["module_name", "step"], ["param_name", "step"]):
        return "msprobe 1.2"
    if header[:3] == ["vpp_stage", "name", "step"]:
        return "msprobe 8.x-26.x"
    return None


def msprobe_rows(header: list[str], row: list[str], family: str) -> Iterator[tuple[str, str, str, str]]:
    """``(name, metric, value text, step text)`` of one msprobe CSV row, in trainmon's names:
    activation rows ``{module}.{input|output|input_grad|output_grad}`` (``.{i}`` for the i-th tensor
    of several, newer layout), parameter rows by parameter name; ``shape``/``dtype`` are skipped.

    Raises:
        ValueError: the row has no name or step column.
    """
    columns = dict(zip(header, row))
    name_column = next((c for c in _NAME_COLUMNS if c in columns), None)
    if name_column is None or "step" not in columns:
        raise ValueError("no name or step column")
    name, step = columns[name_column], columns["step"]
    fixed = {"vpp_stage", name_column, "step", "micro_step"}
    metrics = [c for c in header if c not in fixed and c not in _NOT_METRICS]
    if name_column == "module_name":  # 1.2: "{module}_{micro_step}", columns "{kind}.{op}"
        module = name.rsplit("_", 1)[0] if re.search(r"_\d+$", name) else name
        for column in metrics:
            kind, _, op = column.partition(".")
            yield activation_row(module, kind), op or kind, columns[column], step
        return
    if family in ("actv", "actv_grad"):
        name = _newer_activation_name(name, family)
    for column in metrics:
        yield name, column, columns[column], step


def _newer_activation_name(name: str, family: str) -> str:
    """msprobe 8.x+: ``layers.0.input`` / ``layers.0.input_1`` (second of several tensors); in
    ``actv_grad`` the same words name the gradients."""
    match = re.fullmatch(r"(.*)\.(input|output)(?:_(\d+))?", name)
    if match is None:
        return name
    kind = match.group(2) + ("_grad" if family == "actv_grad" else "")
    return activation_row(match.group(1), kind, match.group(3))


# ----------------------------------------------------------------------------------- anomaly.json
def anomaly_files(folder: Path) -> list[Path]:
    """msprobe ``anomaly.json`` files under ``folder`` (``$MONITOR_OUTPUT_DIR``, its
    ``anomaly_detected/`` or one ``rank{R}/`` of it), by rank."""
    candidates: list[Path] = []
    if re.fullmatch(r"rank\d+", folder.name) and (folder / ANOMALY_FILE).exists():
        return [folder / ANOMALY_FILE]
    for base in (folder / ANOMALY_FOLDER, folder):
        try:
            ranks = [p for p in base.iterdir() if re.fullmatch(r"rank\d+", p.name) and (p / ANOMALY_FILE).exists()]
        except (OSError, ValueError):
            continue
        candidates = sorted((p / ANOMALY_FILE for p in ranks), key=lambda p: int(p.parent.name[4:]))
        if candidates:
            break
    return candidates


_STAGE = {"input": 0, "output": 0, "actv": 0, "input_grad": 1, "output_grad": 1, "actv_grad": 1,
          "pre_grad": 1, "post_grad": 1, "acc_grad": 1, "exp_avg": 2, "efxp_avg_sq": 2, "exp_avg_sq": 2}
"""msprobe's train stage of a tag (``TRAIN_STAGE``): 0 forward, 1 backward, 2 optimizer, -1 otherwise."""
_FAMILY = {"input": "actv", "output": "actv", "actv": "actv", "input_grad": "actv_grad", "output_grad": "actv_grad",
           "actv_grad": "actv_grad", "pre_grad": "grad_unreduced", "acc_grad": "grad_unreduced",
           "post_grad": "grad_reduced", "exp_avg": "exp_avg", "efxp_avg_sq": "exp_avg_sq", "exp_avg_sq": "exp_avg_sq",
           "param_origin": "param", "param_updated": "param_updated"}
_PHASE = {0: "forward", 1: "backward", 2: "optimizer", -1: "optimizer"}
_FIELDS = {"rank": int, "step": int, "micro_step": int, "pp_stage": int, "vpp_stage": int, "call_id": int,
           "tag_name": str, "message": str}


def read_anomalies(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The events of one ``anomaly.json`` as trainmon event dicts, and the problems (one text each).

    Each event gets ``msprobe_key``: msprobe's own earliest-first key (step, micro-step, train
    stage, pipeline position, call id), by which ``trainmon analyse`` orders msprobe's events.
    """
    problems: list[str] = []
    try:
        data = json.loads(read_regular(path).decode("utf-8", errors="replace"))
    except OSError as exc:
        return [], [f"cannot read: {exc.strerror or exc}"]
    except (ValueError, RecursionError) as exc:
        return [], [f"not JSON: {str(exc)[:100]}"]
    if not isinstance(data, dict):
        return [], [f"expected a JSON object, got {type(data).__name__}"]
    events = []
    for key, item in data.items():
        try:
            events.append(_event(item))
        except (ValueError, TypeError, KeyError) as exc:
            problems.append(f"entry {str(key)[:80]!r}: {exc}")
    return events, problems


def _event(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise TypeError("not a JSON object")
    for field, kind in _FIELDS.items():
        if not isinstance(item[field], kind) or isinstance(item[field], bool):
            raise TypeError(f"field {field!r} must be {kind.__name__}")
    tag_name = item["tag_name"]
    name, _, tag = tag_name.partition("/")
    tag = tag.rpartition("/")[2] or "param"  # 1.2.1 tags a parameter by its name alone
    plain = name.split(":", 1)[1] if ":" in name else name
    stage = _STAGE.get(tag, -1)
    family = _FAMILY.get(tag, "param" if tag == "param" else "other")
    if tag in _KINDS:  # 1.2: "{module}_{micro_step}/rank{R}/{kind}"
        row = activation_row(plain.rsplit("_", 1)[0] if re.search(r"_[0-9]+$", plain) else plain, tag)
    elif tag == "other" or family == "other":
        row = f"{plain}/{tag}"
    elif family in ("actv", "actv_grad"):  # 8.x+: "{module}.input[_i]:{micro_step}/rank{R}/actv"
        row = _newer_activation_name(plain.split(":")[0], family)
    else:
        row = plain
    message = item["message"]
    metric = re.search(r"'(\w+)'\)", message)
    values = re.search(r"current value (\S+), history mean (\S+?)\.?$", message)
    rule = re.match(r"Rule (\w+)", message)
    sign = 1 if stage == 0 else -1
    return {
        "step": item["step"], "micro_step": item["micro_step"], "rank": item["rank"], "phase": _PHASE[stage],
        "pp_stage": item["pp_stage"], "vpp_stage": item["vpp_stage"], "order": item["call_id"],
        "detector": rule.group(1) if rule else "msprobe", "family": family, "name": row,
        "metric": metric.group(1) if metric else "value",
        "value": _number(values.group(1)) if values else "nan",
        "baseline": _number(values.group(2)) if values else "nan",
        "message": message, "msprobe_tag": tag_name,
        "msprobe_key": [item["step"], item["micro_step"], stage, sign * item["vpp_stage"], sign * item["pp_stage"],
                        item["call_id"], item["rank"]],
    }


def _number(text: str) -> float | str:
    try:
        value = float(text.rstrip(",."))
    except ValueError:
        return "nan"
    return value if math.isfinite(value) else str(value).lower()


def analyse_msprobe(folder: Path, files: list[Path], top: int, steps: Container[int] | None = None,
                    detectors: Collection[str] | None = None) -> dict[str, Any]:
    """``trainmon analyse`` of msprobe's ``anomaly.json`` files: the result of
    :func:`trainmon.anomaly.merge.analyse_run`, ordered by msprobe's own rule (its
    ``GradAnomalyData.__lt__``: step, micro-step, train stage, pipeline position, call id).

    Raises:
        UnknownDetectorError: a name in ``detectors`` is no detector (see
            :func:`~trainmon.anomaly.firsts.check_detectors`).
    """
    events: list[dict[str, Any]] = []
    corrupt: list[dict[str, Any]] = []
    present: set[str] = set()
    for path in files:
        found, problems = read_anomalies(path)
        label = str(path.relative_to(folder)) if path.is_relative_to(folder) else str(path)
        present.update(e["detector"] for e in found)
        events += [e for e in found if (steps is None or e["step"] in steps)
                   and (detectors is None or e["detector"] in detectors)]
        corrupt += [{"file": label, "line": 0, "error": problem} for problem in problems]
    check_detectors(detectors, present)
    events.sort(key=lambda e: e["msprobe_key"])
    first_by_step: dict[int, dict[str, Any]] = {}
    for event in events:
        first_by_step.setdefault(event["step"], event)
    first_nonfinite = next((e for e in events if _nonfinite(e)), None)
    return {
        "run_dir": str(folder), "layout": "msprobe anomaly.json", "files": len(files), "events": len(events),
        "steps": str(steps) if steps is not None else None,
        "detectors": sorted(detectors) if detectors is not None else None, "detectors_present": sorted(present),
        "first_origin": headline(first_nonfinite, events), "first_nonfinite": first_nonfinite,
        "first_spike": next((e for e in events if not _nonfinite(e)), None),
        "top": events[:top], "first_by_step": list(first_by_step.values()),
        "counts": {"by_rank": {str(k): v for k, v in sorted(Counter(e["rank"] for e in events).items())},
                   "by_step": {str(k): v for k, v in sorted(Counter(e["step"] for e in events).items())},
                   "by_detector": dict(sorted(Counter(e["detector"] for e in events).items()))},
        "corrupt": corrupt, "corrupt_total": len(corrupt),
    }


def _nonfinite(event: dict[str, Any]) -> bool:
    """A non-finite event of msprobe: its ``AnomalyNan`` rule, or a NaN/Inf current value in the message (an
    event whose message has no value to read gets the value ``nan`` and is not counted as non-finite)."""
    readable = "current value " in event["message"]
    return reports_nonfinite(event["detector"], decode_float(event["value"]) if readable else 0.0)
