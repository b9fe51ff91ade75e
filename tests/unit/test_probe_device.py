"""Device building blocks of the grad probe against numpy: packed signs, bit agreement, samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainmon.probe import device as dev

# The CPU fast paths (numpy) and the device kernels (used on GPU/NPU, run here on CPU tensors).
PACKERS = {"pack_signs": lambda x: dev.pack_signs(x > 0), "pack_positive": dev.pack_positive,
           "device_kernels": lambda x: dev._pack_torch(x > 0)}


@pytest.mark.parametrize("pack", PACKERS.values(), ids=PACKERS.keys())
def test_pack_signs_matches_numpy_packbits(pack):
    for n in (1, 7, 8, 9, 63, 64, 65, 1000):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        x[::5] = 0.0  # exact zeros count as "not positive"
        packed = pack(x)
        want = np.packbits(x.numpy() > 0, bitorder="little")
        assert packed.numel() == 8 * dev.packed_words(n)
        np.testing.assert_array_equal(packed.numpy()[: (n + 7) // 8], want, err_msg=f"n={n}")
        assert not packed.numpy()[(n + 7) // 8:].any()  # zero padding


@pytest.mark.parametrize("differing", [dev.differing_bits, dev._differing_torch], ids=["cpu", "device_kernels"])
def test_differing_bits_counts_sign_changes(differing):
    g = torch.Generator().manual_seed(1)
    for n in (5, 64, 777):
        a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
        b[: n // 3] = a[: n // 3]  # some agreement
        a[-1], b[-1] = -1.0, 1.0  # a top-bit difference (negative int64 word paths)
        got = int(differing(dev.pack_signs(a > 0), dev.pack_signs(b > 0)))
        assert got == int(np.sum((a.numpy() > 0) != (b.numpy() > 0))), n


def test_sample_is_fixed_sorted_and_stratified():
    first = dev.sample_indices(10_000, 100, torch.device("cpu"))
    again = dev.sample_indices(10_000, 100, torch.device("cpu"))
    assert torch.equal(first, again)
    idx = first.numpy()
    assert len(np.unique(idx)) == 100 and (np.diff(idx) > 0).all()
    assert (idx // 100 == np.arange(100)).all()  # one index per stratum of 100 elements
    assert torch.equal(dev.sample_indices(5, 10, torch.device("cpu")), torch.arange(5))


def test_interval_counts_right_closed_and_nan_in_none():
    x = torch.tensor([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0, float("nan")])
    counts = [int(c) for c in dev.interval_counts(x, [-1.0, 0.0, 1.0])]
    # (-inf,-1]: -2,-1   (-1,0]: 0   (0,1]: 0.5,1   (1,inf): 3   NaN: none
    assert counts == [2, 1, 2, 1]


def test_checksums_are_order_independent_and_detect_one_ulp():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    y = x.clone()
    y[17] = torch.nextafter(y[17], torch.tensor(float("inf")))
    assert int(dev.raw_checksum(x)) == int(dev.raw_checksum(x.clone()))
    assert int(dev.raw_checksum(x)) != int(dev.raw_checksum(y))
    swapped = x.clone()
    swapped[[3, 900]] = swapped[[900, 3]]
    if (x[3] > 0) != (x[900] > 0):
        assert int(dev.words_checksum(dev.pack_signs(x > 0))) != int(dev.words_checksum(dev.pack_signs(swapped > 0)))
