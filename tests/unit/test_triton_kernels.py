"""The Triton kernels without a GPU: the launchers CUDA calls (``partials_triton``, ``adam_triton``: span tables,
both span kernels, ``_combine_spans``) run in Triton's interpreter on CPU tensors against float64 numpy, and
every kernel compiles for sm_80 and sm_90 (ptxas ships with Triton). Both need the ``triton`` package, which
CPU builds of torch do not install: the tests skip without it. scripts/test.sh's Triton lane runs the
monitored loops through the same launchers; on a GPU, tests/gpu/test_cuda.py runs the compiled kernels
against float64."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.reference import np_stats

pytest.importorskip("triton", reason="needs the triton package (not installed with a CPU build of torch)")

ROOT = Path(__file__).resolve().parents[2]

# Runs in a subprocess: TRITON_INTERPRET must be set before the kernels are decorated. It calls the launchers
# CUDA calls (span tables, both kernels, _combine_spans), on CPU tensors.
_INTERPRETED = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    import trainmon.collect.triton_kernels as tk
    import trainmon.collect.triton_adam as ta

    rng = np.random.default_rng(0)
    cases = []
    for case in range(14):
        dtype = [torch.float32, torch.bfloat16, torch.float16][case % 3]
        sizes = [int(rng.choice([1, 3, 1024, 16385, 40000])) for _ in range(1 + case % 3)]
        if case >= 12:  # 193 spans of one tensor: more than _combine_spans's ROWS (128)
            sizes = [3 * 2**20 + 5, 7]
        xs = []
        for n in sizes:
            x = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype)
            x[int(rng.integers(0, n))] = 0.0
            if case % 4 == 1 or case == 13:
                x[int(rng.integers(n // 2, n))] = float("nan")  # past the 128th span of the large tensor
            if case % 4 == 2 or case == 13:
                x[int(rng.integers(0, n))] = float("-inf")
            xs.append(x[1:] if case % 5 == 4 and n > 1 else x)  # an unaligned view
        got = tk.partials_triton(xs, [1, 1, 1, 1, 1], 1e-3).view(-1, 8).double().tolist()
        cases.append({"kind": "partials", "values": [x.double().tolist() for x in xs], "got": got})
    for case in range(3):  # finite values whose float32 squares overflow (up to 1e37): the norm stays finite
        sizes = [[3], [40000, 7], [2**18 + 5]][case]
        xs = []
        for n in sizes:
            x = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 1e35)
            x[int(rng.integers(0, n))] = -1e37
            xs.append(x[1:] if case == 1 else x)
        got = tk.partials_triton(xs, [1, 1, 1, 1, 1], 1e-3).view(-1, 8).double().tolist()
        cases.append({"kind": "partials", "values": [x.double().tolist() for x in xs], "got": got})
    for case in range(6):
        dtype = [torch.float32, torch.bfloat16][case % 2]
        sizes = [int(rng.choice([5, 1024, 16385, 40000])) for _ in range(1 + case % 2)]
        ms = [torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 1e-3).to(dtype) for n in sizes]
        vs = [torch.from_numpy(rng.standard_normal(n).astype(np.float32) ** 2 * 1e-6).to(dtype) for n in sizes]
        ps = [torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype) for n in sizes]
        for p in ps:
            p[0] = 0.0  # the ratio is 0 there
        if case in (3, 5):
            ms[0][1] = float("nan")
        if case == 4:
            vs[0][2] = float("inf")  # the update is 0 there (finite): only v's own sums see it
        # (scale, eps', lr, 1 - beta2^t, sign, decay) as adam.py makes them: maximize with coupled decay in case 5
        sign, decay = (-1.0, 0.1) if case == 5 else (1.0, 0.0)
        coefficients = torch.tensor([[1.7, 1e-8, 1e-3, 0.25, sign, decay] for _ in sizes], dtype=torch.float64)
        states = [1, 1, 1, 1, 1] if case % 3 else []  # exp_avg and exp_avg_sq from the same read, or not
        gs = []
        if case >= 2:  # the precursors from the same read, with m, v, p and the gradient
            gs = [torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 1e-3).to(dtype) for n in sizes]
            gs[0][0] = 0.0  # r is 0 there, even where v is 0 too
            vs[0][0] = 0.0
            vs[-1][-1] = 1e-18  # sqrt(v_hat) < eps: counted
        out = ta.adam_triton(ms, vs, ps, gs, coefficients, [1, 1, 1, 1, 1], [1, 1, 1, 1, 1], states, 1e-3)
        got = out.view(6 if gs else 4, len(sizes), 8).double().tolist()
        if not states:
            assert not any(any(row) for part in got[2:4] for row in part)  # not asked: left 0
        cases.append({"kind": "adam", "m": [t.double().tolist() for t in ms], "v": [t.double().tolist() for t in vs],
                      "p": [t.double().tolist() for t in ps], "g": [t.double().tolist() for t in gs], "got": got,
                      "states": bool(states), "sign": sign, "decay": decay})
    json.dump(cases, sys.stdout)
""")

METRICS = ["norm", "sum", "min", "max", "zeros", "nans", "infs", "numel"]


def _check(got: list[float], reference: np.ndarray, rtol: float, label: str) -> None:
    want = np_stats(reference, eps=1e-3)
    want = {**want, "sum": float(np.sum(reference)), "zeros": want["zeros"] * reference.size,
            "numel": reference.size}
    for metric, value in zip(METRICS, got):
        expected = want[metric]
        assert np.isclose(value, expected, rtol=rtol, atol=1e-6, equal_nan=True), (label, metric, value, expected)


def test_kernels_in_the_interpreter_match_float64():
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", _INTERPRETED], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = json.loads(done.stdout)
    for i, case in enumerate(cases):
        if case["kind"] == "partials":
            for j, values in enumerate(case["values"]):
                _check(case["got"][j], np.asarray(values), 1e-5, f"partials case {i} tensor {j}")
            continue
        for j in range(len(case["m"])):
            m, v, p = (np.asarray(case[key][j]) for key in ("m", "v", "p"))
            update = m / (np.sqrt(v) + 1e-8) * 1.7
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio = np.where(p != 0, update / np.where(p != 0, p, 1.0), 0.0)
            _check(case["got"][0][j], update, 1e-4, f"update case {i} tensor {j}")
            _check(case["got"][1][j], ratio, 1e-4, f"ratio case {i} tensor {j}")
            if case["states"]:
                _check(case["got"][2][j], m, 1e-5, f"exp_avg case {i} tensor {j}")
                _check(case["got"][3][j], v, 1e-5, f"exp_avg_sq case {i} tensor {j}")
            if case["g"]:
                _check_precursors(case["got"][4][j], case["got"][5][j], m, v, p, np.asarray(case["g"][j]),
                                  case["sign"], case["decay"], f"precursors case {i} tensor {j}")


def _check_precursors(head: list[float], tail: list[float], m: np.ndarray, v: np.ndarray, p: np.ndarray,
                      g: np.ndarray, sign: float, decay: float, label: str) -> None:
    """The kernel's precursor head and tail against float64 sums of the same arrays (coefficients above:
    scale 1.7, eps' 1e-8, lr 1e-3, 1 - beta2^t = 0.25); NaN where an input is NaN."""
    update = m / (np.sqrt(v) + 1e-8) * 1.7
    g = sign * g + (decay * (p + 1e-3 * update) if decay else 0.0)  # the gradient the moments took
    with np.errstate(invalid="ignore", divide="ignore"):
        stale = np.where(g != 0, g * g / np.maximum(v, 1e-16), 0.0) * 0.25
    want_head = [np.linalg.norm(update), update @ g, 0.0, stale.max(), m @ g, stale.sum(), np.sum(v < 1e-16), m.size]
    want_tail = [np.linalg.norm(p), 1e-3 * m.size, 0.0, 0.0, g @ g, m @ m, 0.0, m.size]
    for slot, (got, want) in enumerate(zip(head + tail, want_head + want_tail)):
        scale = max(abs(want), np.linalg.norm(update) * np.linalg.norm(g) if slot == 1 else 0.0)
        assert np.isclose(got, want, rtol=1e-4, atol=1e-6 * scale + 1e-12, equal_nan=True), (label, slot, got, want)


def test_every_kernel_compiles_for_sm80_and_sm90():
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trainmon.collect import triton_adam as ta
    from trainmon.collect import triton_kernels as tk

    span = {"table": "*i64", "n_tensors": "i32", "n_spans": "i32", "spans": "*fp32", "threshold": "fp32"}
    adam = {"table": "*i64", "coefficients": "*fp32", "n_tensors": "i32", "n_spans": "i32", "spans": "*fp32",
            "threshold": "fp32", "state_threshold": "fp32"}
    combine_precursors = {"first": "*i64", "numels": "*i64", "spans": "*fp32", "coefficients": "*fp64",
                          "heads": "*fp32", "tails": "*fp32"}
    combine = {"first": "*i64", "numels": "*i64", "spans": "*fp32", "out": "*fp32"}
    kernels = []
    for dtype in (tl.float16, tl.bfloat16, tl.float32):
        for flag in (False, True):
            kernels.append((tk._span_partials, span, {"DTYPE": dtype, "BLOCK": tk.BLOCK, "ITERS": 16,
                                                      "ALIGNED": flag, "ZEROS": flag}))
            for states in (False, True):
                for precursors in (False, True):
                    kernels.append((ta._adam_span_partials, adam, {
                        "M_DTYPE": dtype, "V_DTYPE": tl.float32, "P_DTYPE": dtype, "RATIO": flag, "STATES": states,
                        "BLOCK": ta.ADAM_BLOCK // (2 if states else 1) // (2 if precursors else 1), "ITERS": 32,
                        "ALIGNED": flag, "ZEROS": not flag, "PRECURSORS": precursors, "G_DTYPE": dtype,
                        "STRIDE": 48 if precursors else 32}))
    kernels.append((tk.combine_spans, combine, {"STRIDE": 8, "NORM": True, "SUM": True, "ZEROS": True, "NANS": True,
                                                 "INFS": True, "ROWS": 128}))
    kernels.append((ta._combine_precursors, combine_precursors, {"STRIDE": 48, "ROWS": 128}))
    for arch in (80, 90):
        for fn, signature, constexprs in kernels:
            signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", arch, 32), options={"num_warps": tk.WARPS})
            assert compiled.asm["cubin"], (fn.__name__, arch, constexprs)


def test_a_triton_kernel_that_raises_is_given_up_for_plain_torch_ops(monkeypatch, caplog):
    """A kernel that cannot run (a Triton or driver version mismatch, say) costs no row: one warning, then the
    plain torch ops give the same values, for the statistics and the Adam update alike."""
    import torch

    from trainmon.collect import kernels, stats, triton_kernels
    from trainmon.collect.adam import adam_partials_many
    from trainmon.collect.stats_base import StatsSpec

    for table in (kernels.PARTIALS, kernels.ADAM, kernels.ADAM_DIRECT):
        monkeypatch.setitem(table, "cpu", None)
    kernels.use_triton("cpu")

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(triton_kernels, "partials_triton", broken)
    x = torch.linspace(-2, 3, 1000, dtype=torch.bfloat16)
    spec = StatsSpec.from_metrics(["norm", "min", "max", "mean", "nans", "infs"], 1e-8)
    with caplog.at_level("WARNING", logger="trainmon"):
        got = stats.device_partials([x], spec)
    assert "Triton statistics kernels failed" in caplog.text
    assert "cpu" not in kernels.PARTIALS  # given up: the plain torch ops from now on
    want = np_stats(x.double().numpy())
    assert np.isclose(float(got[0]), want["norm"], rtol=1e-5) and float(got[2]) == want["min"]

    kernels.use_triton("cpu")
    monkeypatch.setitem(kernels.ADAM_DIRECT, "cpu", broken)  # the launcher as use_triton registers it, raising
    param = torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
    state = {"exp_avg": torch.randn(64, dtype=torch.bfloat16) * 1e-3,
             "exp_avg_sq": torch.rand(64, dtype=torch.bfloat16) * 1e-6, "step": torch.tensor(3.0)}
    _, blocks = adam_partials_many([(param, state, {"betas": (0.9, 0.999), "eps": 1e-8})], spec, None, spec)
    (_, update, _, states, _), = blocks
    assert "cpu" not in kernels.ADAM_DIRECT
    assert states is None  # the plain torch ops do not measure exp_avg/exp_avg_sq: the collector records them
    m, v = state["exp_avg"].double().numpy() / (1 - 0.9**3), state["exp_avg_sq"].double().numpy() / (1 - 0.999**3)
    assert np.isclose(float(update[0]), np.linalg.norm(m / (np.sqrt(v) + 1e-8)), rtol=1e-3)
