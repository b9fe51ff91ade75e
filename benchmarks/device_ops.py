"""Device work of one collected step: aten ops dispatched and bytes they read, against no monitor.

    python benchmarks/device_ops.py [--models tiny gpt wide] [--dtypes bfloat16 float32]
                                    [--cases weights states activations] [--per-family] [--cpu-fast-path]

Machine-independent figures (no timing): a ``TorchDispatchMode`` counts every aten operation
dispatched during one collected training step (forward, backward, optimizer step, ``monitor.step``)
and the bytes of the tensors each one reads (view and metadata ops read nothing; ``out=`` tensors are
written, not read). The same step without a monitor is counted the same way; the difference is what
trainmon adds. On a GPU every such op is at least one kernel launch; bytes read bound its memory
traffic. Ops are attributed to a family by the trainmon frame that dispatched them (``other``: torch's
hook machinery, e.g. the views of full backward hooks).

The statistics run on CPU here, on the path CUDA and Ascend take (the "device path"): bfloat16 takes
it anyway, float32 is forced onto it (``--cpu-fast-path`` measures CPU float32 on the numpy path
instead, which dispatches almost nothing). "one read" is the bytes of every monitored tensor, once per
row (``update``/``ratio`` rows count as a tensor of the parameter's size): the least a single-pass
implementation reads. Host syncs: ``item/tolist/cpu/numpy/bool/float/int`` called from trainmon code.

Cases (6 metrics ``norm min max mean nans infs``):
  weights      weight grads (grad_unreduced, grad_reduced) + exp_avg, exp_avg_sq
  states       weights + update, ratio (the default optimizer states; benchmarks/overhead.py's `weights`)
  activations  weights + every module's activations and activation grads
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
from tiny_gpt import TinyGPT, gpt_loss, make_batch  # noqa: E402

from trainmon import TrainerMonitor  # noqa: E402
from trainmon.base.records import FAMILIES  # noqa: E402
from trainmon.collect import stats  # noqa: E402
from trainmon.collect.buffer import StepBuffer  # noqa: E402
from trainmon.collect.context import StepContext  # noqa: E402
from trainmon.collect.grouped import GroupedRows  # noqa: E402

METRICS6 = ["norm", "min", "max", "mean", "nans", "infs"]
WEIGHTS = {"weight_grads": {"metrics": METRICS6},
           "optimizer_states": {"metrics": METRICS6, "states": ["exp_avg", "exp_avg_sq"]}}
CASES: dict[str, dict] = {
    "weights": WEIGHTS,
    "states": {**WEIGHTS, "optimizer_states": {"metrics": METRICS6}},
    "activations": {**WEIGHTS, "activations": {"enabled": True, "metrics": METRICS6}},
}
MODELS = {  # TinyGPT shape, batch; "gpt" is benchmarks/overhead.py's model
    "tiny": (dict(vocab=256, d=64, layers=2, heads=4, seq=64), 4),
    "gpt": (dict(vocab=1024, d=256, layers=4, heads=4, seq=128), 8),
    "wide": (dict(vocab=4096, d=512, layers=6, heads=8, seq=128), 4),
}
_HOOK_SITES = {  # trainmon function (innermost trainmon frame without a family) -> what it is
    "_backward_ended": "grad_norm", "transfer": "transfer", "before_transfer": "step end",
}
_ADAM_FUNCTIONS = {"adam_update", "update_ratio", "adam_partials_many", "adam_partials_cpu"}
_RECORDING = {"record", "record_many", "add", "hook"}  # frames whose `family` names what they measure
_SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


def _trainmon_site() -> str | None:
    """The family (or trainmon function) whose code dispatched the current op; None outside trainmon."""
    frame = sys._getframe(2)
    innermost = None
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("trainmon."):
            if frame.f_code.co_name in _ADAM_FUNCTIONS:
                return "update+ratio (computing)"
            family = frame.f_locals.get("family") if frame.f_code.co_name in _RECORDING else None
            if isinstance(family, str) and family in FAMILIES:
                return family
            if innermost is None:
                innermost = frame.f_code.co_name
        frame = frame.f_back
    return None if innermost is None else _HOOK_SITES.get(innermost, f"trainmon:{innermost}")


def _bytes_read(func: Any, args: tuple, kwargs: dict) -> int:
    if func.is_view:
        return 0
    total = 0
    schema = func._schema.arguments
    values = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
    for argument, value in zip(schema, values):
        if argument.kwarg_only and argument.alias_info is not None and argument.alias_info.is_write:
            continue  # an out= tensor: written
        leaves, _ = tree_flatten(value)
        total += sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
    return total


class OpCounter(TorchDispatchMode):
    """Counts aten ops and the bytes they read, per site (see :func:`_trainmon_site`)."""

    def __init__(self, attribute: bool) -> None:
        super().__init__()
        self.attribute = attribute
        self.ops: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        site = (_trainmon_site() or "model") if self.attribute else "model"
        self.ops[site] += 1
        self.bytes[site] += _bytes_read(func, args, kwargs)
        if site != "model":
            self.names[func.overloadpacket.__name__] += 1
        return func(*args, **kwargs)


class SyncCounter:
    """Host-synchronising tensor calls made from trainmon code (as tests/integration/test_torch_lifecycle.py)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._originals: dict[str, Any] = {}

    def __enter__(self) -> SyncCounter:
        main = threading.current_thread()
        for name in _SYNC_METHODS:
            original = self._originals[name] = getattr(torch.Tensor, name)

            def wrapper(tensor, *args, _original=original, _name=name, **kwargs):
                view = _name == "numpy" and tensor.device.type == "cpu"
                if not view and threading.current_thread() is main and _trainmon_site() is not None:
                    self.calls.append(_name)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)


class RowBytes:
    """Bytes of each monitored row's tensor (``record``/``record_many``/grouped ``record``; other rows: the parameter's
    size)."""

    def __init__(self) -> None:
        self.by_row: dict[tuple[str, str], int] = {}
        self.rows: list[tuple[str, str]] = []
        self._patches: list[tuple[type, str, Any]] = []

    def __enter__(self) -> RowBytes:
        row_bytes = self

        def patch(cls: type, name: str, make: Any) -> None:
            if hasattr(cls, name):
                original = getattr(cls, name)
                self._patches.append((cls, name, original))
                setattr(cls, name, make(original))

        def record(original):
            def wrapper(ctx, family, name, tensor, *args, **kwargs):
                row_bytes.by_row[(family, name)] = tensor.numel() * tensor.element_size()
                return original(ctx, family, name, tensor, *args, **kwargs)
            return wrapper

        def record_many(original):
            def wrapper(ctx, family, names, tensors, *args, **kwargs):
                for name, tensor in zip(names, tensors):
                    row_bytes.by_row[(family, name)] = tensor.numel() * tensor.element_size()
                return original(ctx, family, names, tensors, *args, **kwargs)
            return wrapper

        def transfer(original):
            def wrapper(buffer):
                row_bytes.rows = [(key.family, key.name) for key in buffer.keys]
                return original(buffer)
            return wrapper

        patch(StepContext, "record", record)
        patch(GroupedRows, "record", record)
        patch(StepContext, "record_many", record_many)
        patch(StepBuffer, "transfer", transfer)
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, original in reversed(self._patches):
            setattr(cls, name, original)

    def total(self, param_bytes: dict[str, int]) -> int:
        return sum(self.by_row.get(row, param_bytes.get(row[1], 0)) for row in self.rows)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, monitor: Any, step: int, shape: dict,
          batch: int) -> None:
    tokens, targets = make_batch(step, batch, shape["seq"], shape["vocab"])
    loss = gpt_loss(model, tokens, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if monitor is not None:
        monitor.step(loss=loss)


def measure(model_name: str, dtype: torch.dtype, case: str | None, out: str) -> dict[str, Any]:
    """Counts of the third step (the first two create the optimizer state) with monitor ``case`` (None: none)."""
    shape, batch = MODELS[model_name]
    torch.manual_seed(0)
    model = TinyGPT(**shape).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    monitor = None
    if case is not None:
        monitor = TrainerMonitor({"output_dir": out, "sinks": [], "anomaly": {"detectors": []}, **CASES[case]})
        monitor.attach(model, optimizer)
    for step in range(2):
        _step(model, optimizer, monitor, step, shape, batch)
    counter = OpCounter(attribute=case is not None)
    with RowBytes() as rows, SyncCounter() as syncs, counter:
        _step(model, optimizer, monitor, 2, shape, batch)
    if monitor is not None:
        monitor.close()
    param_bytes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    return {"ops": counter.ops, "bytes": counter.bytes, "names": counter.names, "rows": rows.rows,
            "monitored": rows.total(param_bytes), "syncs": len(syncs.calls)}


def nan_inf_options(dtype: torch.dtype) -> None:
    """Ops and bytes of sync-free NaN/Inf counting in plain torch ops, over the gradients of the `gpt` model."""
    shape, batch = MODELS["gpt"]
    torch.manual_seed(0)
    model = TinyGPT(**shape).to(dtype)
    gpt_loss(model, *make_batch(0, batch, shape["seq"], shape["vocab"])).backward()
    xs = [p.grad for p in model.parameters()]
    one_read = sum(x.numel() * x.element_size() for x in xs)
    biggest = torch.finfo(dtype).max

    def separate() -> None:  # what the fallback did before (a boolean temporary each, then a sum)
        for x in xs:
            torch.isnan(x).sum(), torch.isinf(x).sum()

    extremes = [torch.aminmax(x) for x in xs]  # computed anyway (the non-finite flag)

    def gated() -> None:  # the same, kept only where min/max are not finite: the work is done anyway
        for x, (lo, hi) in zip(xs, extremes):
            finite = torch.isfinite(lo) & torch.isfinite(hi)
            torch.where(finite, 0, torch.isnan(x).sum()), torch.where(finite, 0, torch.isinf(x).sum())

    def foreach() -> None:  # O(1) ops per group, two full-size temporaries of the tensors' dtype
        finite = torch._foreach_mul(xs, 0.0)
        torch._foreach_add_(finite, 1.0)  # 1 where finite, NaN where not
        torch._foreach_sign_(finite)  # sign(NaN) == 0
        torch._foreach_norm(finite, 1, dtype=torch.float32)  # finite count
        infinite = torch._foreach_abs(xs)
        torch._foreach_sub_(infinite, biggest)  # > 0 only for +-inf; NaN stays NaN
        torch._foreach_sign_(infinite)
        torch._foreach_clamp_min_(infinite, 0.0)
        torch._foreach_norm(infinite, 1, dtype=torch.float32)  # inf count; NaN = numel - finite - inf

    negated = torch._foreach_neg(xs)  # made anyway by the fallback: min(x) = -max(-x)

    def fallback() -> None:  # trainmon/collect/fallback.py: one temporary list at a time, O(1) ops per group
        torch._foreach_tanh_(negated)  # finite but at NaN
        torch._foreach_mul_(negated, 0.0)  # NaN exactly at NaN, else 0
        nans = torch._foreach_norm(negated, 0, dtype=torch.float32)
        not_finite = torch._foreach_mul(xs, 0.0)  # NaN exactly at NaN and +-inf
        torch._foreach_sub(torch._foreach_norm(not_finite, 0, dtype=torch.float32), nans)

    def masks() -> None:  # the fallback for a tensor alone (or a large one's bounded pieces)
        for x in xs:
            torch._foreach_powsum([torch.isnan(x), torch.isinf(x)], 1, dtype=torch.float32)

    print(f"NaN/Inf counts of the {len(xs)} {str(dtype)[6:]} gradients of `gpt` ({one_read / 1e6:.1f} MB), "
          "plain torch:")
    options = [("isnan/isinf per tensor", separate), ("torch.where on 0-d flags", gated),
               ("_foreach arithmetic", foreach), ("tanh(-x)*0, x*0, L0 norms", fallback)]
    if hasattr(torch, "_foreach_powsum"):
        options.append(("masks, one powsum each", masks))
    for name, run in options:
        counter = OpCounter(attribute=False)
        with torch.no_grad(), counter:
            run()
        read = sum(counter.bytes.values())
        print(f"  {name:<26} {sum(counter.ops.values()):>5} ops {read / 1e6:>7.1f} MB read ({read / one_read:.2f}x)")
    print("  fused kernel (trainmon::partials)     0 extra ops, 0 extra bytes: counted in the min/max pass")


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--per-family", action="store_true", help="also print ops and bytes per family")
    parser.add_argument("--top-ops", type=int, default=0, help="print the N most frequent extra op names")
    parser.add_argument("--fallback", action="store_true",
                        help="plain torch ops instead of the fused kernels (what a device without one runs)")
    parser.add_argument("--cpu-fast-path", action="store_true",
                        help="leave CPU float32 on trainmon's numpy path (default: force the device path)")
    parser.add_argument("--nan-options", action="store_true",
                        help="only compare sync-free NaN/Inf counting in plain torch ops")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.nan_options:
        for dtype_name in args.dtypes:
            nan_inf_options(getattr(torch, dtype_name))
        return 0
    if not args.cpu_fast_path:
        stats._NUMPY_VIEWABLE = ()  # what CUDA/Ascend run, for float32 too
    if args.fallback:
        stats.fused_enabled = False
    out = tempfile.mkdtemp(prefix="trainmon_ops_")
    print(f"{'model':<6} {'dtype':<9} {'case':<12} {'rows':>5} {'extra ops':>9} {'ops/row':>7} {'_to_copy':>8} "
          f"{'MB read':>8} {'one read MB':>11} {'ratio':>6} {'syncs':>5}")
    for model_name in args.models:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            base = measure(model_name, dtype, None, out)
            for case in args.cases:
                got = measure(model_name, dtype, case, out)
                ops = sum(got["ops"].values()) - sum(base["ops"].values())
                read = sum(got["bytes"].values()) - sum(base["bytes"].values())
                rows = len(got["rows"])
                print(f"{model_name:<6} {dtype_name:<9} {case:<12} {rows:>5} {ops:>9} {ops / max(rows, 1):>7.1f} "
                      f"{got['names']['_to_copy']:>8} {_mb(read):>8} {_mb(got['monitored']):>11} "
                      f"{read / max(got['monitored'], 1):>5.2f}x {got['syncs']:>5}")
                if args.per_family:
                    model_ops = got["ops"]["model"] - base["ops"]["model"]
                    model_bytes = got["bytes"]["model"] - base["bytes"]["model"]
                    per_rows = collections.Counter(family for family, _ in got["rows"])
                    for site in sorted(set(got["ops"]) - {"model"}, key=lambda s: -got["ops"][s]):
                        n = per_rows.get(site, 0)
                        each = f"{got['ops'][site] / n:.1f}/row" if n else ""
                        print(f"{'':<29} {site:<18} {n:>4} rows {got['ops'][site]:>6} ops {each:>9} "
                              f"{_mb(got['bytes'][site]):>7} MB")
                    if model_ops:
                        print(f"{'':<29} {'other':<18} {'':>9} {model_ops:>6} ops {'':>9} {_mb(model_bytes):>7} MB")
                if args.top_ops:
                    print(f"{'':<29} " + ", ".join(f"{n} {c}" for n, c in got["names"].most_common(args.top_ops)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
