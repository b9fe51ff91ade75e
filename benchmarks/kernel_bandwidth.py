"""Bandwidth of the statistics kernels on a GPU, against ``torch._foreach_norm`` on the same tensors.

    python benchmarks/kernel_bandwidth.py [--dtype bfloat16] [--model 1b] [--repeats 20]

The group is the parameters of benchmarks/overhead.py's GPT (``1b``: 245 tensors, 1.14 B elements,
2.3 GB in bf16), filled with normal values. For each kernel: the median time of ``--repeats`` calls
(CUDA events, after 3 warm-up calls), and the bytes it must read divided by that time:
- ``partials``: ``trainmon::partials`` with 6 metrics (norm min max mean nans infs): one read of the group;
- ``partials+zeros``: the same with ``zeros`` (the zero test per element);
- ``adam``: ``trainmon::adam_partials`` (update and ratio): reads m, v and the parameter;
- ``adam+states``: the same, with the statistics of m and v themselves (what a step with ``exp_avg``,
  ``exp_avg_sq``, ``update`` and ``ratio`` runs);
- ``_foreach_norm``: torch's multi-tensor L2 norm, the bandwidth a simple reduction reaches;
- ``with a NaN``: ``partials`` when one tensor holds a NaN (its spans are read twice).
Needs CUDA (exits 2 without it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from benchmarks.overhead import MODELS
from trainmon.collect import kernels
from trainmon.collect.stats_base import StatsSpec

METRICS6 = ["norm", "min", "max", "mean", "nans", "infs"]


def _time(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--model", choices=sorted(MODELS), default="1b")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_bandwidth.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    from tiny_gpt import TinyGPT

    dtype = getattr(torch, args.dtype)
    shape, _ = MODELS[args.model]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = TinyGPT(**shape).to(dtype)
    xs = [p.detach().normal_() for p in model.parameters()]
    nbytes = sum(x.numel() * x.element_size() for x in xs)
    spec, spec_zeros = StatsSpec.from_metrics(METRICS6, 1e-8), StatsSpec.from_metrics([*METRICS6, "zeros"], 1e-8)
    partials = kernels.partials_kernel("cuda")
    if partials is None:
        print("kernel_bandwidth.py: no fused CUDA kernel (is Triton installed?)", file=sys.stderr)
        return 2
    ms = [x.clone().mul_(1e-3) for x in xs]
    vs = [x.clone().square_().mul_(1e-6) for x in xs]
    gs = [x.clone().mul_(1e-2) for x in xs]
    # (scale, eps', lr, 1 - beta2^t, sign, decay) per tensor
    coefficients = torch.tensor([v for _ in xs for v in (1.0, 1e-8, 1e-3, 0.1, 1.0, 0.0)], dtype=torch.float32,
                                device="cuda")
    rows = [("partials", lambda: partials(xs, spec), nbytes),
            ("partials+zeros", lambda: partials(xs, spec_zeros), nbytes),
            ("adam", lambda: kernels.adam_partials(ms, vs, xs, coefficients, spec, spec), 3 * nbytes),
            ("adam+states", lambda: kernels.adam_partials(ms, vs, xs, coefficients, spec, spec, spec), 3 * nbytes),
            ("adam+precursors", lambda: kernels.adam_partials(ms, vs, xs, coefficients, spec, spec, spec, gs),
             4 * nbytes),
            ("_foreach_norm", lambda: torch._foreach_norm(xs), nbytes)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {len(xs)} {args.dtype} tensors, "
          f"{nbytes / 1e9:.2f} GB")
    print(f"{'kernel':<16} {'ms':>8} {'TB/s':>7}")
    for name, fn, read in rows:
        seconds = _time(fn, args.repeats)
        print(f"{name:<16} {seconds * 1e3:>8.3f} {read / seconds / 1e12:>7.2f}")
    xs[len(xs) // 2].view(-1)[7] = float("nan")
    seconds = _time(lambda: partials(xs, spec), args.repeats)
    print(f"{'with a NaN':<16} {seconds * 1e3:>8.3f} {nbytes / seconds / 1e12:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
