"""trainmon on a real CUDA device: the Triton statistics kernels and monitored runs against float64 references.

Skipped without a CUDA device (CI has none). On a GPU machine: ``python -m pytest -m gpu tests/gpu``.
Every number is checked against float64 numpy computed from the tensors the run really used (copied to
the host by the test, never by trainmon). The synchronisation check uses CUDA's own sync detector
(``torch.cuda.set_sync_debug_mode``), not trainmon's bookkeeping.
"""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest
import torch

from tests.models import TinyNet, batch, loss_fn
from tests.reference import METRICS, assert_close, np_stats, precursors_np, read_family
from trainmon import TrainerMonitor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
ALL = {"enabled": True, "metrics": METRICS}
CUDA = "cuda"


def _values(row: np.ndarray) -> dict[str, float]:
    """An 8-slot partial ``[sum x^2 -> norm, sum, min, max, zeros, nans, infs, count]`` as metrics."""
    return {"norm": row[0], "mean": row[1] / row[7], "min": row[2], "max": row[3], "zeros": row[4] / row[7],
            "nans": row[5], "infs": row[6]}


def _assert_partials(rows: np.ndarray, tensors: list[torch.Tensor], eps: float, label: str) -> None:
    for row, tensor in zip(rows, tensors):
        assert row[7] == tensor.numel(), label
        want = np_stats(tensor.double().cpu().numpy(), eps=eps)
        got = _values(row.astype(np.float64))
        for metric in METRICS:
            assert np.isclose(got[metric], want[metric], rtol=2e-5, atol=1e-6, equal_nan=True), \
                (label, tensor.numel(), metric, got[metric], want[metric])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_partials_match_float64(dtype):
    from trainmon.collect import kernels
    from trainmon.collect.stats_base import StatsSpec

    kernel = kernels.partials_kernel(CUDA)
    assert kernel is not None, "the Triton kernels did not load on CUDA"
    g = torch.Generator().manual_seed(0)
    big = torch.randn(5_000_003, generator=g)  # hundreds of spans: the combine loop runs several times
    big[::7] = 0.0
    big[123] = 5e-4  # below eps: a "zero"
    special = torch.randn(300, generator=g)
    special[3], special[50], special[51] = float("nan"), float("inf"), -float("inf")
    only_inf = torch.ones(17)
    only_inf[2] = -float("inf")
    many = [torch.randn(int(n), generator=g) for n in torch.randint(1, 5000, (300,), generator=g)]
    tensors = [t.to(CUDA, dtype) for t in (big, special, only_inf, torch.tensor([2.5]), torch.zeros(1000), *many)]
    spec = StatsSpec.from_metrics(METRICS, eps=1e-3)
    rows = kernel(tensors, spec).view(-1, 8).cpu().numpy()
    assert kernels.partials_kernel(CUDA) is kernel, "the kernel gave up and fell back to plain torch ops"
    _assert_partials(rows, tensors, 1e-3, str(dtype))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_adam_update_and_ratio_match_float64(dtype):
    from trainmon.collect import kernels
    from trainmon.collect.adam import _adam_items
    from trainmon.collect.stats_base import StatsSpec

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device=CUDA).to(dtype)) for n in (3_000_001, 20_000, 257, 1)]
    with torch.no_grad():
        params[1][:50] = 0.0  # the ratio's param == 0 rule
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-6)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    assert kernels.adam_kernel_takes([p for p in params]), "the Triton Adam kernel is not used on CUDA"
    group = optimizer.param_groups[0]
    items = _adam_items([(p, optimizer.state[p], group) for p in params])
    coefficients = torch.tensor([[float(x) for x in item[3:9]] for item in items], dtype=torch.float64).to(CUDA)
    spec = StatsSpec.from_metrics(METRICS, eps=1e-8)
    with torch.no_grad():
        out = kernels.adam_partials([i[0] for i in items], [i[1] for i in items], [i[2] for i in items],
                                    coefficients, spec, spec, spec)
    assert out is not None, "the Triton Adam kernel failed"
    got = out.view(4, -1, 8).cpu().numpy()
    for i, p in enumerate(params):  # exp_avg and exp_avg_sq themselves, from the same read
        for part, family in ((2, "exp_avg"), (3, "exp_avg_sq")):
            _assert_partials(got[part, i:i + 1], [optimizer.state[p][family]], 1e-8, f"{dtype} {family} {i}")
    b1, b2 = group["betas"]
    for i, p in enumerate(params):  # the reference from the optimizer's own state, in float64
        state = optimizer.state[p]
        t = float(state["step"])
        m = state["exp_avg"].double().cpu().numpy() / (1 - b1 ** t)
        v = state["exp_avg_sq"].double().cpu().numpy() / (1 - b2 ** t)
        update = m / (np.sqrt(v) + group["eps"])
        pnp = p.detach().double().cpu().numpy()
        ratio = np.where(pnp != 0, update / np.where(pnp != 0, pnp, 1), 0.0)
        for half, reference in enumerate((update, ratio)):
            want = np_stats(reference, eps=1e-8)
            values = _values(got[half, i].astype(np.float64))
            for metric in METRICS:
                rtol = 1e-3 if dtype == torch.bfloat16 else 2e-5  # m, v in bf16: the kernel computes in fp32
                assert np.isclose(values[metric], want[metric], rtol=rtol, atol=1e-5), \
                    (dtype, i, half, metric, values[metric], want[metric])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_precursors_match_float64(dtype):
    """The precursor rows from the Adam kernel's one read of m, v, p and the gradient (docs/precursors.md)."""
    from trainmon.base.precursors import finalize_precursors
    from trainmon.collect.adam import precursor_partials

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device=CUDA).to(dtype)) for n in (3_000_001, 20_000, 257, 1)]
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
            p.grad.view(-1)[:7] = 0.0  # elements without a gradient
        optimizer.step()
    group = optimizer.param_groups[0]
    with torch.no_grad():
        got = precursor_partials([(p, optimizer.state[p], group) for p in params], [p.grad for p in params])
    for i, p in enumerate(params):
        row = got[i]
        assert row is not None and row.device.type == "cuda"
        values, _ = finalize_precursors(row[:8].cpu().numpy()[None], row[8:].cpu().numpy()[None])
        state = optimizer.state[p]
        want = precursors_np(p.grad.double().cpu().numpy(), state["exp_avg"].double().cpu().numpy(),
                             state["exp_avg_sq"].double().cpu().numpy(), p.detach().double().cpu().numpy(),
                             float(state["step"]), group["betas"], group["eps"], group["lr"])
        for metric, value in want.items():
            assert np.isclose(values[metric][0], value, rtol=1e-3, atol=1e-6), (dtype, i, metric, values[metric], value)


def _run_with_references(tmp_path, dtype: torch.dtype, steps: int = 3, async_results: bool = False,
                         device: str = CUDA):
    torch.manual_seed(0)
    model = TinyNet(vocab=64, d=128).to(device, dtype)
    with torch.no_grad():
        model.layers[0].fc1.bias.zero_()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"], "activations": ALL,
              "weight_grads": ALL, "params": ALL, "async_results": async_results,
              "optimizer_states": {"metrics": METRICS, "states": ["exp_avg", "exp_avg_sq", "update", "ratio"]}}
    ref: dict[tuple[str, str, int], np.ndarray] = {}
    outputs: dict[str, np.ndarray] = {}

    def capture(name):
        def hook(module, args, out):
            outputs[name] = out.detach().double().cpu().numpy()
        return hook

    handles = [m.register_forward_hook(capture(n)) for n, m in model.named_modules() if n and "." in n]
    monitor = TrainerMonitor(config).attach(model, optimizer)
    for step in range(steps):
        tokens, targets = (t.to(device) for t in batch(step, vocab=64))
        loss = loss_fn(model, tokens, targets)
        loss.float().backward()
        for key, value in outputs.items():
            ref[("actv", f"{key}.output", step)] = value
        for name, p in model.named_parameters():
            ref[("grad", name, step)] = p.grad.double().cpu().numpy()
            ref[("param", name, step)] = p.detach().double().cpu().numpy()
        optimizer.step()
        b1, b2 = optimizer.param_groups[0]["betas"]
        for name, p in model.named_parameters():
            state = optimizer.state[p]
            m = state["exp_avg"].double().cpu().numpy()
            v = state["exp_avg_sq"].double().cpu().numpy()
            ref[("exp_avg", name, step)], ref[("exp_avg_sq", name, step)] = m, v
            update = (m / (1 - b1 ** (step + 1))) / (np.sqrt(v / (1 - b2 ** (step + 1))) + 1e-8)
            pnp = p.detach().double().cpu().numpy()
            ref[("update", name, step)] = update
            ref[("ratio", name, step)] = np.where(pnp != 0, update / np.where(pnp != 0, pnp, 1), 0.0)
        optimizer.zero_grad()
        monitor.step(loss=loss)
    monitor.close()
    for handle in handles:
        handle.remove()
    return model, ref, tmp_path / "run" / "rank0"


@pytest.mark.parametrize("async_results", [False, True], ids=["finished-now", "async-results"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_family_on_cuda_matches_float64(tmp_path, dtype, async_results):
    """Activations are grouped from the second step on (the first measures them in their hooks)."""
    model, ref, rank_dir = _run_with_references(tmp_path, dtype, async_results=async_results)
    n_params = len(list(model.parameters()))
    rtol = 1e-5 if dtype == torch.float32 else 1e-3  # bf16 update/ratio: m, v are bf16, computed in fp32
    for family, kind in [("grad_unreduced", "grad"), ("grad_reduced", "grad"), ("param", "param"),
                         ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("update", "update"),
                         ("ratio", "ratio")]:
        frame = read_family(rank_dir, family)
        assert len(frame) == 3 * n_params, family
        for _, row in frame.iterrows():
            family_rtol = rtol if kind in ("update", "ratio") else 1e-5
            assert_close(row, np_stats(ref[(kind, row["name"], row["step"])]), METRICS, rtol=family_rtol,
                         atol=1e-6, label=f"{dtype} {family} {row['name']}")
    frame = read_family(rank_dir, "actv")
    checked = 0
    for _, row in frame.iterrows():
        key = ("actv", row["name"], row["step"])
        if key in ref:
            assert_close(row, np_stats(ref[key]), METRICS, atol=1e-6, label=f"{dtype} actv {row['name']}")
            checked += 1
    assert checked >= 3 * 8, checked


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("async_results", [False, True], ids=["finished-now", "async-results"])
def test_a_model_on_another_gpu_than_the_current_one_matches_float64(tmp_path, async_results):
    """The model on the last GPU, the current device left at 0 (as HF device_map="auto" leaves it for later
    layers): Triton must launch on the tensors' device, and the copy's event wait for the tensors' stream."""
    assert torch.cuda.current_device() == 0
    device = f"cuda:{torch.cuda.device_count() - 1}"
    model, ref, rank_dir = _run_with_references(tmp_path, torch.bfloat16, async_results=async_results, device=device)
    for family, kind in [("grad_reduced", "grad"), ("exp_avg", "exp_avg"), ("update", "update")]:
        frame = read_family(rank_dir, family)
        assert len(frame) == 3 * len(list(model.parameters())), family
        for _, row in frame.iterrows():
            assert_close(row, np_stats(ref[(kind, row["name"], row["step"])]), METRICS,
                         rtol=1e-3 if kind == "update" else 1e-5, atol=1e-6, label=f"{family} {row['name']}")


def _sync_warnings(step) -> int:
    """How many synchronising CUDA calls ``step()`` made, by CUDA's own detector."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_synchronisation_per_collected_step_and_none_otherwise(tmp_path, dtype):
    torch.manual_seed(0)
    data = [tuple(t.to(CUDA) for t in batch(step, vocab=64)) for step in range(6)]

    def run(monitor_config):
        model = TinyNet(vocab=64, d=128).to(CUDA, dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        monitor = None
        if monitor_config is not None:
            monitor = TrainerMonitor(monitor_config).attach(model, optimizer)
        counts = []
        for tokens, targets in data:
            def step(tokens=tokens, targets=targets):
                loss = loss_fn(model, tokens, targets)
                loss.float().backward()
                optimizer.step()
                optimizer.zero_grad()
                if monitor is not None:
                    monitor.step(loss=loss)
            counts.append(_sync_warnings(step))
        if monitor is not None:
            monitor.close()
        return counts

    run(None)  # CUDA's own lazy set-up (cuBLAS handles, workspaces) syncs once per process: not counted
    baseline = run(None)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"], "step_interval": 2,
              "activations": ALL, "weight_grads": ALL, "params": ALL,
              "optimizer_states": {"metrics": METRICS, "states": ["exp_avg", "exp_avg_sq", "update", "ratio"]}}
    monitored = run(config)
    extra = [m - b for m, b in zip(monitored, baseline)]
    assert extra == [1, 0, 1, 0, 1, 0], (baseline, monitored)  # steps 0, 2, 4 collected: one each; else none
    # async_results: the copy to pinned memory and its event; the next step waits on that event only (not flagged)
    monitored = run({**config, "step_interval": 1, "async_results": True})
    extra = [m - b for m, b in zip(monitored, baseline)]
    assert extra == [0] * 6, (baseline, monitored)


def test_gpt_bf16_all_families_rows_and_no_fallback(tmp_path, caplog):
    """A bf16 GPT with every family: rows for every module and no kernel falling back to plain ops."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from tiny_gpt import TinyGPT, gpt_loss, make_batch

    torch.manual_seed(0)
    model = TinyGPT(vocab=512, d=256, layers=4, heads=4, seq=128).to(CUDA, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"], "activations": ALL,
              "weight_grads": ALL, "optimizer_states": {"metrics": METRICS}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for step in range(3):
            tokens, targets = (t.to(CUDA) for t in make_batch(step, 4, 128, 512))
            loss = gpt_loss(model, tokens, targets)
            loss.float().backward()
            grads = {name: p.grad.double().cpu().numpy() for name, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
            frame_step = step
    assert "Triton statistics kernels failed" not in caplog.text
    frame = read_family(tmp_path / "run" / "rank0", "grad_reduced")
    last = frame[frame["step"] == frame_step]
    assert len(last) == len(grads)
    for _, row in last.iterrows():
        assert_close(row, np_stats(grads[row["name"]]), METRICS, atol=1e-6, label=row["name"])
    assert len(read_family(tmp_path / "run" / "rank0", "actv")) > 0


class _SideStream(torch.nn.Module):
    """fc1 on the default stream, fc2 on a side stream (the user synchronises around it), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = torch.nn.Linear(512, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 1)
        self.side = torch.cuda.Stream()
        self.seen: dict[str, np.ndarray] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            y = self.fc2(h)  # its forward hook runs with the side stream current
            self.seen["fc2.output"] = y.detach().double().cpu().numpy()
        torch.cuda.current_stream().wait_stream(self.side)
        return self.head(torch.relu(y))


def test_activations_made_on_a_side_stream_match_float64(tmp_path):
    """Grouped activations are read at the flush on the current stream, which first waits for the stream each
    tensor was made on (``grouped._follow_streams``)."""
    torch.manual_seed(0)
    model = _SideStream().to(CUDA)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"], "activations": ALL,
              "weight_grads": {"enabled": False}, "optimizer_states": {"enabled": False}}
    seen = {}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for step in range(3):
            x = torch.randn(256, 512, device=CUDA)
            model(x).square().mean().backward()
            seen[step] = model.seen["fc2.output"]
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    actv = read_family(tmp_path / "run" / "rank0", "actv")
    rows = actv[actv.name == "fc2.output"]
    assert list(rows.step) == [0, 1, 2]
    for _, row in rows.iterrows():
        assert_close(row, np_stats(seen[row["step"]]), METRICS, rtol=1e-5, atol=1e-6, label=f"step {row['step']}")
