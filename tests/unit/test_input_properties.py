"""Property tests of every reader of user input: a result or the module's documented error, never
another exception (and, with inputs kept small, never a hang).

- config: random dicts shaped like the schema, random YAML/JSON text -> MonitorConfig or ConfigError
- CSV (csv2tb): random and mutated files -> rows or CsvFormatError
- anomalies.jsonl (analyse): random and mutated files -> a result (corrupt lines are reported, never raised)
- direction files (grad-compare): random and mutated files -> a header and bits, or DirectionFormatError
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.merge import analyse_run
from trainmon.config import MonitorConfig, load_config
from trainmon.errors import ConfigError
from trainmon.probe.storage import DirectionFile, DirectionFormatError, read_direction_header, write_direction_file
from trainmon.tools.readers import CsvFormatError, read_scalars

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])

# --------------------------------------------------------------------------- config
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12),
                    st.sampled_from(["norm", "csv", "re:(", "*", "L2", "spike", "log", "", "re:^a"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _section(cls: type) -> st.SearchStrategy[dict]:
    """Dicts with the section's own keys (and now and then a wrong one), values of any JSON type."""
    hints = typing.get_type_hints(cls)
    keys = [f.name for f in dataclasses.fields(cls)]

    def value_for(name: str) -> st.SearchStrategy:
        if dataclasses.is_dataclass(hints[name]):
            return _section(hints[name]) | json_values
        if name == "detectors":
            return st.lists(st.fixed_dictionaries({"type": st.sampled_from(["nonfinite", "spike", "loss_spike", "x"])},
                                                  optional={"series": json_values, "window": json_values,
                                                            "alpha": json_values, "threshold": json_values,
                                                            "level_window": json_values, "bogus": json_values}),
                            max_size=3) | json_values
        return json_values

    entries = st.one_of(*[st.tuples(st.just(k), value_for(k)) for k in keys],
                        st.tuples(st.text(max_size=6), json_values))
    return st.lists(entries, max_size=5).map(dict)


@settings(FAST, max_examples=100)
@given(data=_section(MonitorConfig))
def test_config_dicts_give_a_config_or_config_error(data):
    try:
        config = load_config(data)
    except ConfigError as exc:
        assert exc.key and str(exc).startswith(exc.key)
    else:
        assert isinstance(config, MonitorConfig)


_yaml_fragments = st.sampled_from(["step_interval: 2\n", "sinks: [csv]\n", "anomaly:\n  actions: [log]\n",
                                   "  log_limit: 3\n", "- 1\n", "&a [*a]\n", "<<: *a\n", "[", "{", "}", "]", ": ",
                                   "'", '"', "\t", "!!python/object:os.system\n", "? [a]\n", "dump: {depth: 99}\n",
                                   "\\u0000", "ranks: [0, 0]\n", "step_interval: 2\n", "\ufeff", "---\n", "..."])


@FAST
@given(pieces=st.lists(_yaml_fragments | st.text(max_size=10), max_size=12), suffix=st.sampled_from([".yaml", ".json"]))
def test_config_text_gives_a_config_or_config_error(tmp_path_factory, pieces, suffix):
    path = tmp_path_factory.mktemp("config") / f"monitor{suffix}"
    path.write_text("".join(pieces), encoding="utf-8")
    try:
        assert isinstance(load_config(path), MonitorConfig)
    except ConfigError as exc:
        assert exc.key


@FAST
@given(blob=st.binary(max_size=300), suffix=st.sampled_from([".yaml", ".json"]))
def test_config_bytes_give_a_config_or_config_error(tmp_path_factory, blob, suffix):
    path = tmp_path_factory.mktemp("config") / f"monitor{suffix}"
    path.write_bytes(blob)
    try:
        assert isinstance(load_config(path), MonitorConfig)
    except ConfigError as exc:
        assert exc.key


# --------------------------------------------------------------------------- mutations of valid files
def _mutate(data: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    """Apply (position, delete-length, insert) edits: byte flips, cuts, insertions, truncation."""
    out = bytearray(data)
    for position, delete, insert in edits:
        at = position % (len(out) + 1)
        out[at:at + delete] = insert
    return bytes(out)


edits = st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 8),
                           st.binary(max_size=4) | st.sampled_from([b"\x00", b"\n", b'"', b",", b"-", b"9" * 25,
                                                                    b"[" * 50, b"\xff", b"nan", b"{"])),
                 min_size=1, max_size=4)

# --------------------------------------------------------------------------- CSV (csv2tb)
GOOD_CSV = (b"vpp_stage,name,step,micro_step,norm,nans\n0,fc.weight,0,0,1.5,0\n0,fc.weight,1,0,nan,2\n"
            b"0,\"a,b\",2,0,-inf,0\n")


def _read_csv(path: Path, family: str) -> None:
    try:
        rows = list(read_scalars(path))
    except CsvFormatError as exc:
        assert str(path) in str(exc)
        return
    for tag, value, step in rows:
        assert tag.startswith(f"{family}/") and isinstance(value, float) and 0 <= step < 2**63


@FAST
@given(blob=st.binary(max_size=400), family=st.sampled_from(["grad_reduced", "scalars"]))
def test_csv_random_bytes(tmp_path_factory, blob, family):
    path = tmp_path_factory.mktemp("csv") / f"{family}.csv"
    path.write_bytes(blob)
    _read_csv(path, family)


@FAST
@given(changes=edits, family=st.sampled_from(["grad_reduced", "scalars"]))
def test_csv_mutated(tmp_path_factory, changes, family):
    path = tmp_path_factory.mktemp("csv") / f"{family}.csv"
    base = GOOD_CSV if family != "scalars" else b"step,name,value\n0,loss,1.5\n1,loss,nan\n"
    path.write_bytes(_mutate(base, changes))
    _read_csv(path, family)


# --------------------------------------------------------------------------- anomalies.jsonl (analyse)
def _event_lines(n: int) -> bytes:
    events = [AnomalyEvent(step, step % 2, 0, ["forward", "backward", "optimizer"][step % 3], "actv", f"l{step}.output",
                           "norm", [1.5, float("nan")][step % 2], 1.0, "spike", "m", step, 0, 0,
                           "2026-11-21T10:00:00.000Z") for step in range(n)]
    return ("\n".join(e.to_json() for e in events) + "\n").encode()


def _analyse(root: Path, lines: int) -> None:
    result = analyse_run(root, top=3)
    assert result["files"] == 1
    assert result["events"] + result["corrupt_total"] <= max(lines, 1) + 1
    assert result["events"] >= len(result["top"])


@FAST
@given(blob=st.binary(max_size=400))
def test_jsonl_random_bytes(tmp_path_factory, blob):
    root = tmp_path_factory.mktemp("run")
    (root / "rank0").mkdir()
    (root / "rank0" / "anomalies.jsonl").write_bytes(blob)
    _analyse(root, blob.count(b"\n") + 1)


@FAST
@given(changes=edits, n=st.integers(1, 5))
def test_jsonl_mutated(tmp_path_factory, changes, n):
    root = tmp_path_factory.mktemp("run")
    (root / "rank0").mkdir()
    blob = _mutate(_event_lines(n), changes)
    (root / "rank0" / "anomalies.jsonl").write_bytes(blob)
    _analyse(root, blob.count(b"\n") + 1)


# --------------------------------------------------------------------------- direction files (grad-compare)
def _direction_file(path: Path, n: int) -> None:
    header = {"name": "w", "vpp_stage": 0, "step": 3, "shape": [n], "numel": n, "count": n, "sample": None}
    write_direction_file(path, header, np.packbits(np.arange(n) % 3 > 0, bitorder="little"))


def _read_direction(path: Path) -> None:
    try:
        info = read_direction_header(path)
    except DirectionFormatError as exc:
        assert str(path) in str(exc)
        return
    assert isinstance(info, DirectionFile)
    assert isinstance(info.header["name"], str) and 0 <= info.header["count"] < 2**63
    assert isinstance(info.key, tuple)
    try:
        bits = info.bits()
    except DirectionFormatError as exc:
        assert str(path) in str(exc)
        return
    assert bits.dtype == np.uint8 and bits.size == (info.header["count"] + 7) // 8


@FAST
@given(blob=st.binary(max_size=300), prefix=st.booleans())
def test_direction_random_bytes(tmp_path_factory, blob, prefix):
    path = tmp_path_factory.mktemp("probe") / "w.bits"
    path.write_bytes((b"TMGS\x01\x00\x00\x00" if prefix else b"") + blob)
    _read_direction(path)


@FAST
@given(changes=edits, n=st.integers(0, 40))
def test_direction_mutated(tmp_path_factory, changes, n):
    path = tmp_path_factory.mktemp("probe") / "w.bits"
    _direction_file(path, n)
    path.write_bytes(_mutate(path.read_bytes(), changes))
    _read_direction(path)


@FAST
@given(header=st.dictionaries(st.sampled_from(["name", "step", "shape", "count", "vpp_stage", "sample", "x"]),
                              json_values, max_size=7),
       extra=st.binary(max_size=20))
def test_direction_random_headers(tmp_path_factory, header, extra):
    path = tmp_path_factory.mktemp("probe") / "w.bits"
    blob = json.dumps(header).encode()
    path.write_bytes(b"TMGS\x01\x00\x00\x00" + len(blob).to_bytes(4, "little") + blob + extra)
    _read_direction(path)
