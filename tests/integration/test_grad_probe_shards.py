"""trainmon.probe.shards: pieces of a parameter (ZeRO flat ranges, TP column blocks with a
distributed-optimizer range inside) give the whole parameter's L0 checksums, direction bits and
sample positions (numpy references of the whole tensor)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainmon.probe import device as dev
from trainmon.probe import shards as sh


def _flat_pieces(shape: tuple[int, ...], cuts: list[int]) -> list[sh.ShardSpec]:
    edges = [0, *cuts, int(np.prod(shape))]
    return [sh.ShardSpec.flat(shape, a, b - a) for a, b in zip(edges[:-1], edges[1:])]


def _tp_pieces(shape: tuple[int, ...], dim: int, parts: int, dp_cuts: list[int]) -> list[sh.ShardSpec]:
    """TP blocks along ``dim``, each cut further into distributed-optimizer ranges at ``dp_cuts``."""
    length = shape[dim] // parts
    out = []
    for p in range(parts):
        block = sh.ShardSpec.block(shape, dim, p * length, length)
        edges = [0, *dp_cuts, block.numel]
        out += [sh.ShardSpec.block(shape, dim, p * length, length, a, b - a) for a, b in zip(edges[:-1], edges[1:])]
    return out


def _piece_values(whole: torch.Tensor, spec: sh.ShardSpec) -> torch.Tensor:
    """Independent slicing: the block by narrow, then the range of its row-major flattening."""
    length = spec.shape[spec.dim] if spec.length < 0 else spec.length
    block = whole.reshape(spec.shape).narrow(spec.dim, spec.offset, length)
    return block.reshape(-1)[spec.start: spec.start + spec.numel]


LAYOUTS = [
    ("zero_unaligned", (13, 11), lambda s: _flat_pieces(s, [37, 70, 71])),
    ("zero_even", (8, 16), lambda s: _flat_pieces(s, [64])),
    ("zero_empty_piece", (3,), lambda s: _flat_pieces(s, [2, 3])),
    ("tp_column", (6, 40), lambda s: _tp_pieces(s, 1, 2, [33])),
    ("tp_row", (40, 6), lambda s: _tp_pieces(s, 0, 2, [7, 100])),
    ("tp_3d", (3, 8, 5), lambda s: _tp_pieces(s, 1, 4, [3])),
]


@pytest.mark.parametrize(("label", "shape", "cut"), LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_pieces_give_the_whole_parameters_checksums_and_bits(label, shape, cut):
    generator = torch.Generator().manual_seed(3)
    whole = torch.randn(shape, generator=generator)
    whole.view(-1)[::7] = 0.0
    pieces = cut(shape)
    assert sum(p.numel for p in pieces) == whole.numel()
    flat_whole = whole.reshape(-1)
    reference_signs = flat_whole.numpy().astype(np.float64) > 0
    # L0 checksums: shares add up (mod 2**64 / 2**32) to the whole tensor's
    words = raw = 0
    for spec in pieces:
        values = _piece_values(whole, spec).contiguous()
        if values.numel():
            words += int(sh.words_checksum(dev.pack_positive(values), values, spec))
            raw += int(dev.raw_checksum(values))
    want_words = int(dev.words_checksum(dev.pack_positive(flat_whole)))
    assert (words - want_words) % 2**64 == 0
    assert (raw - int(dev.raw_checksum(flat_whole))) % 2**32 == 0
    # global positions of every element, and the assembled direction bits
    for spec in pieces:
        got = whole.reshape(-1)[torch.from_numpy(spec.global_indices(np.arange(spec.numel)))]
        np.testing.assert_array_equal(got.numpy(), _piece_values(whole, spec).numpy())
    assembled = sh.assemble_bits(whole.numel(), [
        (dev.pack_positive(_piece_values(whole, s).contiguous()).numpy(), s.numel, sh.stored_positions(s, None)[1])
        for s in pieces])
    np.testing.assert_array_equal(assembled, np.packbits(reference_signs, bitorder="little"))
    # a fixed sample: each piece stores its sampled elements, placed at their sample ranks
    sample = sh.sample_global(whole.numel(), 17)
    if sample is None:  # a parameter of at most 17 elements is stored whole
        return
    parts = []
    for spec in pieces:
        local, ranks = sh.stored_positions(spec, sample)
        values = _piece_values(whole, spec)[torch.from_numpy(local)]
        parts.append((dev.pack_positive(values.contiguous()).numpy(), len(local), ranks))
    assert sum(p[1] for p in parts) == 17
    np.testing.assert_array_equal(sh.assemble_bits(17, parts), np.packbits(reference_signs[sample], bitorder="little"))


def test_combine_partials_max_min_and_sums():
    rows = torch.tensor([[[2.0, 5.0, -1.0, 4.0] + [1.0] * (sh.partial_width([0.0]) - 4)],
                         [[0.0, float("-inf"), float("inf"), 0.0] + [0.0] * (sh.partial_width([0.0]) - 4)],
                         [[3.0, 7.0, 0.5, 9.0] + [2.0] * (sh.partial_width([0.0]) - 4)]], dtype=torch.float64)
    combined = sh.combine_partials(rows)[0]
    assert combined[sh.NUMEL] == 5 and combined[sh.MAX] == 7 and combined[sh.MIN] == -1 and combined[sh.SUMSQ] == 13
    assert (combined[sh.PREV_DIFF:] == 3).all()
    checks = sh.combine_checksums(torch.tensor([[[2**31 - 1, 2**62]], [[5, 2**62]]], dtype=torch.int64))
    assert checks.tolist() == [[-(2**31) + 4, -(2**63)]]
