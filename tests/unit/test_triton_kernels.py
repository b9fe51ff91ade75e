"""The Triton (CUDA) kernels of the statistics operators, run on CPU tensors under Triton's interpreter.

Skipped where Triton is not installed (it is not a dependency: CUDA without Triton uses plain torch
ops). Each check runs in a child process because ``TRITON_INTERPRET`` is read when kernels are
defined.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
ROOT = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent('''
    import numpy as np, torch
    from tests.reference import METRICS, np_stats
    from trainmon.collect import kernels, triton_kernels
    from trainmon.collect.adam import _adam_items, _adam_torch
    from trainmon.collect.stats import StatsSpec

    def close(got, want, label):
        p = np.asarray(got, np.float64)
        values = {"norm": p[0], "mean": p[1] / p[7], "min": p[2], "max": p[3], "zeros": p[4] / p[7],
                  "nans": p[5], "infs": p[6]}
        for metric in METRICS:
            assert np.isclose(values[metric], want[metric], rtol=2e-5, atol=1e-6, equal_nan=True), \\
                (label, metric, values[metric], want[metric])

    spec = StatsSpec.from_metrics(METRICS, eps=1e-3)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        big = torch.randn(40_000, generator=g)
        big[::7] = 0.0
        big[123] = 5e-4  # below eps: a "zero"
        special = torch.randn(300, generator=g)
        special[3], special[50], special[51] = float("nan"), float("inf"), -float("inf")
        only_inf = torch.ones(17)
        only_inf[2] = -float("inf")
        tensors = [t.to(dtype) for t in (big, special, only_inf, torch.tensor([2.5]), torch.zeros(1000))]
        out = triton_kernels.partials_triton(tensors, kernels.spec_flags(spec), spec.eps).view(-1, 8).numpy()
        for row, tensor in zip(out, tensors):
            assert row[7] == tensor.numel()
            close(row, np_stats(tensor.double().numpy(), eps=1e-3), (dtype, tensor.numel()))
        off = triton_kernels.partials_triton(tensors[:2], [0, 0, 0, 0, 0], 1e-3).view(-1, 8).numpy()
        assert (off[:, [0, 1, 4, 5, 6]] == 0).all() and np.isnan(off[1, 2]) and off[0, 7] == 40_000

    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in (20_000, 257, 1)]
        with torch.no_grad():
            params[0][:50] = 0.0
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            optimizer.step()
        group = optimizer.param_groups[0]
        items = _adam_items([(p, optimizer.state[p], group) for p in params])
        coefficients = torch.tensor([[item[3], item[4]] for item in items], dtype=torch.float64)
        spec = StatsSpec.from_metrics(METRICS, eps=1e-8)
        with torch.no_grad():
            got = triton_kernels.adam_triton([i[0] for i in items], [i[1] for i in items], [i[2] for i in items],
                                             coefficients, kernels.spec_flags(spec), kernels.spec_flags(spec), 1e-8)
            want_u, want_r = _adam_torch(items, spec, spec, torch.device("cpu"))
        got = got.view(2, -1, 8).numpy()
        for half, want in enumerate((want_u, want_r)):
            np.testing.assert_allclose(got[half], want.view(-1, 8).numpy(), rtol=2e-5, atol=1e-6)
        only_update = triton_kernels.adam_triton([i[0] for i in items], [i[1] for i in items], [],
                                                 coefficients, kernels.spec_flags(spec), [], 1e-8)
        assert not only_update.view(2, -1, 8)[1].any()
    print("ok")
''')


def test_triton_kernels_match_the_references_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]
