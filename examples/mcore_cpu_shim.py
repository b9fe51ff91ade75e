"""CPU-ONLY TEST SHIM for Megatron-Core 0.16 (not part of trainmon; never use it on a GPU machine).

Megatron's model, DDP, optimizers and pipeline schedule assume CUDA in a few places. This shim
patches torch and Megatron *globally* so that they run on CPU with gloo: keep it in test
helpers and example scripts that run in their own process. Recipe from shared/ENV.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import megatron.core.utils as mu
import torch
from megatron.core.tensor_parallel import random as mrandom
from torch.overrides import TorchFunctionMode


def _cpu_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    n = math.prod(tensor_shape)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < n:
        self.buffer[(name, dtype)] = buf = torch.empty(n, dtype=dtype)
    return buf[:n].view(*tensor_shape)


class _CudaToCpu(TorchFunctionMode):
    """Turns ``device="cuda"`` / an int device in factory calls into ``cpu``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        d = kwargs.get("device")
        if isinstance(d, int) or (isinstance(d, str) and d.startswith("cuda")) or (
                isinstance(d, torch.device) and d.type == "cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def apply(seed: int = 123, full: bool = True) -> Callable[[], None]:
    """Patch for CPU; returns the seeding function to call after ``initialize_model_parallel``."""
    mu.GlobalMemoryBuffer.get_tensor = _cpu_get_tensor
    if full:
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *a, **k: None
        orig_type = torch.Tensor.type

        def _type(self, *a, **k):  # Megatron optimizers accept only 'torch.cuda.*Tensor'
            t = orig_type(self, *a, **k)
            return t.replace("torch.", "torch.cuda.", 1) if not (a or k) and not t.startswith("torch.cuda.") else t

        torch.Tensor.type = _type
        # Activation recomputation saves and restores the CUDA RNG state: there is none on CPU
        # (the CPU state is saved and restored separately by Megatron).
        mrandom._get_cuda_rng_state = lambda *a, **k: None
        mrandom._set_cuda_rng_state = lambda *a, **k: None
        _CudaToCpu().__enter__()

    def seed_all() -> None:
        mrandom.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
        torch.manual_seed(seed)

    return seed_all
