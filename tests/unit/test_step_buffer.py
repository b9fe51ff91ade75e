"""StepBuffer.drop_rows: the rows of an abandoned micro-step go (also from the middle of a block), later rows'
micro-steps move down by one, and the transfer gives the remaining partials unchanged."""

from __future__ import annotations

import numpy as np
import torch

from trainmon.base.records import RowKey
from trainmon.collect.buffer import StepBuffer


def _buffer() -> tuple[StepBuffer, list[RowKey], np.ndarray]:
    buffer = StepBuffer()
    keys = [RowKey("actv", f"row{i}", micro, 0, i) for i, micro in enumerate([0, 0, 1, 1, 1, 2, 2])]
    values = np.arange(7 * 8, dtype=np.float32).reshape(7, 8)
    buffer.add(keys[0], torch.from_numpy(values[0].copy()))
    buffer.add_block(keys[1:4], torch.from_numpy(values[1:4].reshape(-1).copy()))  # rows 1-3: one block
    buffer.add_block(keys[4:], torch.from_numpy(values[4:].reshape(-1).copy()))
    return buffer, keys, values


def test_dropping_a_micro_step_cuts_blocks_and_renumbers_later_rows():
    buffer, keys, values = _buffer()
    buffer.drop_rows(2, 5, micro_step=1)  # micro-step 1's rows: 2-4, across both blocks
    host = buffer.transfer()
    assert [(k.name, k.micro_step) for k in host.keys] == [("row0", 0), ("row1", 0), ("row5", 1), ("row6", 1)]
    np.testing.assert_array_equal(host.partials, values[[0, 1, 5, 6]].astype(np.float64))


def test_dropping_nothing_or_past_the_end_keeps_the_rows():
    buffer, keys, values = _buffer()
    buffer.drop_rows(3, 3, micro_step=1)
    buffer.drop_rows(9, 12, micro_step=1)
    host = buffer.transfer()
    assert host.keys == keys
    np.testing.assert_array_equal(host.partials, values.astype(np.float64))
