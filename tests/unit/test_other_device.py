"""A model on a GPU that is not the process's current device (HF ``device_map="auto"`` spreads one over every
GPU; a script may use ``cuda:1`` without ``torch.cuda.set_device``). Work queued for a tensor goes to its
device's stream, so the end-of-copy events (the step's transfer, the grad probe's copies) must be recorded
there, and Triton, which launches on the current
device, must be moved to the tensor's. GPUs cannot be made here, so these tests use stand-ins for the device
module and the current device; tests/gpu/test_cuda.py runs the real thing where there are two GPUs."""

from __future__ import annotations

import contextlib

import pytest
import torch

from trainmon.collect import buffer


class _Stream:
    def __init__(self, device: torch.device) -> None:
        self.device = device


class _Event:
    def __init__(self) -> None:
        self.stream: _Stream | None = None

    def record(self, stream: _Stream | None = None) -> None:
        self.stream = stream if stream is not None else _Stream(torch.device("cuda", 0))  # the current device's


class _Module:
    Event = _Event

    @staticmethod
    def current_stream(device: torch.device | None = None) -> _Stream:
        return _Stream(device if device is not None else torch.device("cuda", 0))


def test_the_copy_event_is_recorded_on_the_stream_of_the_tensors_device():
    event = buffer.copy_done(_Module, torch.device("cuda", 1))
    assert event.stream is not None and event.stream.device == torch.device("cuda", 1)


def test_triton_kernels_launch_on_the_tensors_device(monkeypatch):
    pytest.importorskip("triton", reason="needs the triton package (not installed with a CPU build of torch)")
    from trainmon.collect import triton_kernels

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    guard = triton_kernels.on_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    for same in (torch.device("cuda", 0), torch.device("cpu")):  # nothing to switch: no cost
        assert isinstance(triton_kernels.on_device(same), contextlib.nullcontext)


def test_the_grad_probes_copy_event_is_recorded_on_the_stream_of_the_tensors_device(monkeypatch):
    from trainmon.probe import collector

    monkeypatch.setattr(collector, "events_module", lambda device_type: _Module)
    event = collector.record_event(torch.device("cuda", 1))
    assert event.stream is not None and event.stream.device == torch.device("cuda", 1)
