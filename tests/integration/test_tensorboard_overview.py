"""The TensorBoard overview on a real torch run of 300 parameter tensors: the tag count read back from the event
files stays under 200 (the same tags as a model of 40 tensors), the summaries equal float64 numpy over the real
tensors, they are computed on the sink's writer thread, and ``per_tensor`` adds exactly the tags it selects."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from tests.reference import METRICS, np_stats
from trainmon import TrainerMonitor
from trainmon.base.records import FAMILIES
from trainmon.sinks import tensorboard_overview

STEPS, MICRO_STEPS, NAN_STEP = 3, 2, 2
NAN_PARAM = "blocks.{}.lin.weight"  # the middle block's
ALL = {"enabled": True, "metrics": METRICS}
RTOL, ATOL = 1e-5, 1e-7  # float32 statistics (tests/reference.py's tolerances) stored as float32 by TensorBoard


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class Deep(nn.Module):
    """``blocks`` residual blocks: 4 parameter tensors each (75 blocks: 300 tensors)."""

    def __init__(self, blocks: int, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _train(out: Path, blocks: int, tensorboard: dict[str, Any] | None = None, grad_probe: bool = True
           ) -> dict[str, Any]:
    """Train ``Deep(blocks)`` with every family on, one optimizer group per tensor and a NaN gradient at the last
    step; returns the float64 references: per step, the gradients and parameters the optimizer steps with, and
    the norm of every activation row."""
    torch.manual_seed(0)
    model = Deep(blocks)
    optimizer = torch.optim.AdamW([{"params": [p]} for p in model.parameters()], lr=1e-3)
    config = {"output_dir": str(out), "run_name": "run", "sinks": ["tensorboard"], "activations": ALL,
              "weight_grads": ALL, "params": ALL, "optimizer_states": {"metrics": METRICS},
              "grad_probe": {"enabled": grad_probe, "scalars": "param"}, "tensorboard": tensorboard or {}}
    reference: dict[str, Any] = {"grads": [], "params": [], "actv": []}
    norms: list[float] = []

    def measure(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            norms.extend(float(np.linalg.norm(t.detach().double().numpy())) for t in (inputs[0], output))

    handles = [m.register_forward_hook(measure) for name, m in model.named_modules() if name and name != "blocks"]
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer, grad_acc_steps=MICRO_STEPS)
        for step in range(STEPS):
            norms.clear()
            for micro in range(MICRO_STEPS):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro))
                loss = model(x).square().mean() / MICRO_STEPS
                loss.backward()
            if step == NAN_STEP:
                with torch.no_grad():
                    model.get_parameter(NAN_PARAM.format(blocks // 2)).grad[0, 0] = float("nan")
            reference["grads"].append({n: p.grad.double().numpy().copy() for n, p in model.named_parameters()})
            reference["params"].append({n: p.detach().double().numpy().copy() for n, p in model.named_parameters()})
            reference["actv"].append(list(norms))
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
    for handle in handles:
        handle.remove()
    return reference


def _events(out: Path) -> Any:
    return EventAccumulator(str(out / "run" / "rank0"), size_guidance={"scalars": 0, "tensors": 0}).Reload()


def _tags(events: Any) -> list[str]:
    kinds = events.Tags()
    assert not any(kinds[kind] for kind in ("images", "audio", "histograms", "distributions", "graph", "meta_graph")
                   if kinds.get(kind))
    return sorted(kinds["scalars"]) + sorted(kinds["tensors"])


def _table(events: Any, family: str) -> list[str]:
    """The newest table of ``family``'s tensors: index -> name (``/micro{m}`` and all)."""
    text = events.Tensors(f"{family}/tensors/text_summary")[-1].tensor_proto.string_val[0].decode()
    rows = [re.fullmatch(r"\| (\d+) \| (.*) \|", line) for line in text.splitlines()]
    table = [(int(m.group(1)), m.group(2)) for m in rows if m]
    assert [i for i, _ in table] == list(range(len(table)))
    return [name for _, name in table]


def _series(events: Any, tag: str) -> list[float]:
    points = events.Scalars(tag)
    assert [p.step for p in points] == list(range(STEPS)), tag
    return [p.value for p in points]


def _close(got: float, want: float, label: str) -> None:
    if np.isnan(want):
        assert np.isnan(got), f"{label}: got {got}, want nan"
    else:
        assert np.isclose(got, want, rtol=RTOL, atol=ATOL), f"{label}: got {got!r}, want {want!r}"


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """The 300-tensor run, with the thread names the summaries were computed on."""
    out = tmp_path_factory.mktemp("overview")
    threads: list[str] = []
    real = tensorboard_overview.summarise

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tensorboard_overview, "summarise", recording)
        reference = _train(out, blocks=75)
    return out, reference, threads


def test_fewer_than_200_tags_whatever_the_model_size(big, tmp_path):
    out, reference, _ = big
    assert len(reference["grads"][0]) == 300
    tags = _tags(_events(out))
    assert len(tags) < 200 and len(tags) <= tensorboard_overview.MAX_TAGS, len(tags)
    families = {"actv", "actv_grad", "grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq", "update", "ratio",
                "param"}
    assert {tag.split("/")[0] for tag in tags if tag.split("/")[0] in FAMILIES} == families
    assert not [tag for tag in tags if tag.count("/") >= 2 and tag.split("/")[0] in FAMILIES
                and not tag.endswith("/tensors/text_summary")]  # no per-tensor tag
    assert {"0_overview/loss", "0_overview/grad_norm", "0_overview/lr/group3", "scalars/grad_probe/sign_agree_prev",
            "0_overview/anomalies/nonfinite", "anomalies/nonfinite/text_summary"} <= set(tags)
    assert "0_overview/lr/group4" not in tags and not [t for t in tags if t.startswith("scalars/grad_probe/blocks.")]
    # a model of 40 tensors writes the same tags
    _train(tmp_path, blocks=10)
    assert _tags(_events(tmp_path)) == tags


def test_summaries_equal_float64_numpy_of_the_real_tensors(big):
    out, reference, _ = big
    events = _events(out)
    for family, key in (("grad_reduced", "grads"), ("param", "params")):
        # the gradients the optimizer steps with, and the parameters, are rows of the last micro-step
        table = [name.removesuffix(f"/micro{MICRO_STEPS - 1}") for name in _table(events, family)]
        assert sorted(table) == sorted(reference[key][0])
        got = {tag: _series(events, f"{family}/{tag}") for tag in (
            "norm_max", "norm_median", "norm_argmax", "max_max", "min_min", "mean_median", "zeros_max", "nans_sum",
            "infs_sum", "nonfinite_tensors")}
        for step, tensors in enumerate(reference[key]):
            names = list(tensors)
            stats = {metric: np.array([np_stats(tensors[n])[metric] for n in names]) for metric in METRICS}
            nonfinite = ~np.isfinite(stats["norm"]) | (stats["nans"] > 0) | (stats["infs"] > 0)
            want = {"norm_max": np.max(stats["norm"]), "norm_median": np.nanmedian(stats["norm"]),
                    "max_max": np.nanmax(stats["max"]), "min_min": np.nanmin(stats["min"]),
                    "mean_median": np.nanmedian(stats["mean"]), "zeros_max": np.nanmax(stats["zeros"]),
                    "nans_sum": stats["nans"].sum(), "infs_sum": stats["infs"].sum(),
                    "nonfinite_tensors": float(nonfinite.sum())}
            for tag, value in want.items():
                _close(got[tag][step], float(value), f"{family}/{tag} step {step}")
            holder = table[int(got["norm_argmax"][step])]
            nan = np.isnan(stats["norm"])
            assert holder == (names[int(np.argmax(nan))] if nan.any() else names[int(np.argmax(stats["norm"]))])
            if family == "grad_reduced" and step == NAN_STEP:  # the NaN: the max, its holder, the counts
                assert np.isnan(got["norm_max"][step]) and holder == NAN_PARAM.format(75 // 2)
                assert got["nans_sum"][step] == 1 and got["nonfinite_tensors"][step] == 1
    assert max(_series(events, "param/zeros_max")) == 1.0  # the LayerNorm and Linear biases start at exactly 0
    # activations: every input and output of every module and micro-step
    assert len(_table(events, "actv")) == len(reference["actv"][0]) == 225 * 2 * MICRO_STEPS
    for step, norms in enumerate(reference["actv"]):
        _close(_series(events, "actv/norm_max")[step], max(norms), f"actv/norm_max step {step}")
        _close(_series(events, "actv/norm_median")[step], float(np.median(norms)), f"actv/norm_median step {step}")


def test_summaries_are_computed_on_the_writer_thread(big):
    _, _, threads = big
    assert threads and threading.main_thread().name not in threads
    assert set(threads) == {threads[0]} and "tensorboard" in threads[0], set(threads)


def test_per_tensor_adds_exactly_the_selected_tags(tmp_path):
    selection = {"per_tensor": True, "tensors": [r"re:^blocks\.0\."], "families": ["grad_reduced", "actv"],
                 "metrics": ["norm", "max"]}
    reference = _train(tmp_path, blocks=12, tensorboard=selection, grad_probe=False)
    events = _events(tmp_path)
    tags = set(events.Tags()["scalars"])
    per_tensor = {tag for tag in tags if tag.count("/") >= 2 and tag.split("/")[0] in FAMILIES}
    grads = {f"grad_reduced/{name}/{metric}/micro1" for name in reference["grads"][0] if name.startswith("blocks.0.")
             for metric in ("norm", "max")}
    actv = {f"actv/{module}.{kind}/{metric}{suffix}" for module in ("blocks.0", "blocks.0.norm", "blocks.0.lin")
            for kind in ("input", "output") for metric in ("norm", "max") for suffix in ("", "/micro1")}
    assert len(grads) == 8 and len(actv) == 24
    assert per_tensor == grads | actv
    assert {tag.split("/")[0] for tag in tags if tag.split("/")[0] in FAMILIES} == {"grad_reduced", "actv"}
    assert {tag for tag in tags if tag.startswith("grad_reduced/") and tag.count("/") == 1} == {
        "grad_reduced/norm_max", "grad_reduced/norm_median", "grad_reduced/norm_argmax", "grad_reduced/max_max",
        "grad_reduced/nonfinite_tensors"}
    assert "0_overview/lr/group47" in tags  # per_tensor lifts the overview's bounds on scalars
    weight = reference["grads"][1]["blocks.0.lin.weight"]
    _close(_series(events, "grad_reduced/blocks.0.lin.weight/norm/micro1")[1], float(np.linalg.norm(weight)),
           "per tensor")
