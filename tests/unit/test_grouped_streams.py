"""Grouped activations read kept tensors on the stream current at the flush: that stream waits once for each
other stream the tensors were made on, and each such tensor is marked used by it. Streams need a GPU, so
this test uses stand-ins for the streams and tensors (CUDA objects cannot be made here); the real thing runs in
tests/gpu/test_cuda.py::test_activations_made_on_a_side_stream_match_float64."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from trainmon.collect import grouped


class _Stream:
    def __init__(self, name: str) -> None:
        self.name, self.waited_for = name, []

    def wait_stream(self, other: _Stream) -> None:
        self.waited_for.append(other.name)


def _tensor(used_by: list) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device("cuda", 0), record_stream=lambda stream: used_by.append(stream.name))


def test_the_flush_stream_waits_once_per_other_stream_and_marks_those_tensors(monkeypatch):
    default, side, other = _Stream("default"), _Stream("side"), _Stream("other")
    monkeypatch.setattr(grouped, "_current_stream", lambda device: default)
    marks: list[list[str]] = [[] for _ in range(5)]
    tensors = [_tensor(m) for m in marks]
    grouped._follow_streams(tensors, [default, side, side, None, other])
    assert default.waited_for == ["side", "other"]  # once per stream, none for its own
    assert marks == [[], ["default"], ["default"], [], ["default"]]  # only tensors made on another stream


def test_cpu_tensors_have_no_stream():
    assert grouped._current_stream(torch.device("cpu")) is None
