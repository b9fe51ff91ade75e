"""Shortcuts of the CPU statistics that must give the very values of the general code, bit for bit: the chunked
min/max of large arrays (:func:`trainmon.collect.stats_base.bounds`) and the one-chunk combination of the Adam
kernel (:func:`trainmon.collect.kernels.combine_chunks`) and its update/param ratio without its zero fix-up where it
changes nothing (:func:`trainmon.collect.kernels.ratio_into`)."""

from __future__ import annotations

import numpy as np
import pytest

from trainmon.base.records import combine_partials
from trainmon.collect.kernels import combine_chunks, ratio_into
from trainmon.collect.stats_base import BOUNDS_CHUNK, bounds


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("case", ["plain", "signed_zeros", "relu", "nan", "inf"])
def test_bounds_are_min_and_max_bit_for_bit(dtype, case):
    rng = np.random.default_rng(0)
    for n in (7, 3 * BOUNDS_CHUNK, 3 * BOUNDS_CHUNK + 1, 5 * BOUNDS_CHUNK + 123):
        values = rng.standard_normal(n).astype(dtype)
        if case == "signed_zeros":  # the extreme is a zero, of both signs: which one depends on the reading order
            values = -np.abs(values)
            values[rng.integers(0, n, 9)] = 0.0
            values[rng.integers(0, n, 9)] = -0.0
        elif case == "relu":
            values = np.maximum(values, 0)
            values[rng.integers(0, n, 9)] = -0.0
        elif case == "nan":
            values[rng.integers(0, n, 2)] = np.nan
        elif case == "inf":
            values[rng.integers(0, n, 2)] = np.inf
            values[rng.integers(0, n, 2)] = -np.inf
        lo, hi = bounds(values)
        assert type(lo) is type(values.min()) and type(hi) is type(values.max())
        assert np.asarray(lo).tobytes() == np.asarray(values.min()).tobytes()
        assert np.asarray(hi).tobytes() == np.asarray(values.max()).tobytes()
        strided = values[::2]  # not contiguous: read whole
        assert np.asarray(bounds(strided)[0]).tobytes() == np.asarray(strided.min()).tobytes()


def test_one_chunk_combines_as_combine_partials_bit_for_bit():
    rng = np.random.default_rng(0)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 3.4e38, 5e-324]
    for _ in range(20000):
        part = rng.standard_normal((1, 8)) * 10.0 ** rng.integers(-40, 40)
        for j in range(8):
            if rng.random() < 0.25:
                part[0, j] = special[rng.integers(len(special))]
        if rng.random() < 0.5:
            part[0, 7] = float(rng.integers(0, 3))
        for dtype in (np.float32, np.float64):
            want, got = np.zeros(8, dtype), np.zeros(8, dtype)
            with np.errstate(all="ignore"):
                want[:] = combine_partials(part[:, None, :])[0]
                combine_chunks(part, got)
            assert want.tobytes() == got.tobytes(), (part, want, got)
    two = rng.standard_normal((2, 8))
    want, got = np.zeros(8), np.zeros(8)
    want[:] = combine_partials(two[:, None, :])[0]
    combine_chunks(two, got)
    assert want.tobytes() == got.tobytes()


def test_ratio_skips_its_fix_up_only_where_it_changes_nothing():
    rng = np.random.default_rng(2)
    for case in ("plain", "zero_params", "negative_zero", "nan_update", "huge"):
        update = rng.standard_normal(4096).astype(np.float32)
        param = rng.standard_normal(4096).astype(np.float32)
        if case == "zero_params":
            param[rng.integers(0, 4096, 7)] = 0.0
        elif case == "negative_zero":
            param[rng.integers(0, 4096, 7)] = -0.0
            update[:3] = 0.0
        elif case == "nan_update":
            update[5] = np.nan
        elif case == "huge":
            param[9] = 1e-45  # update / param overflows to Inf: a value, not a zero parameter
        want = np.empty_like(update)  # the general code: divide, then 0 where the parameter is 0
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            np.divide(update, param, out=want)
        np.copyto(want, 0.0, where=param == 0)
        got = np.empty_like(update)
        with np.errstate(over="ignore"):
            lo, hi = ratio_into(update, param, got)
        assert got.tobytes() == want.tobytes(), case
        assert np.asarray(lo).tobytes() == np.asarray(want.min()).tobytes(), case
        assert np.asarray(hi).tobytes() == np.asarray(want.max()).tobytes(), case
