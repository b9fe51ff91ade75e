"""Training runs of the lead-time benchmark (``benchmarks/precursors.py``): a small GPT with trainmon attached, healthy
or with one fault that makes the training itself unstable (no value is ever written into a series).

The model is ``examples/tiny_gpt.py``'s ``TinyGPT`` (d 64, 2 blocks, 4 heads, no QK normalisation; vocabulary 64,
context 32) trained with AdamW (betas 0.9/0.95, eps 1e-8, no weight decay) on a copy task that needs attention:
each sequence is 16 tokens of a first-order Markov language followed by the same 16 tokens again (the loss falls
from 4.2 to about 1.0 once the model copies). Warm-up: 100 steps linear. trainmon collects every step (the weight
matrices' ``grad_reduced``, ``exp_avg``, ``exp_avg_sq``, ``update`` and ``ratio`` norms, the scalars) into the run
store (``sinks: [parquet]``), with the optional families of :data:`OPTIONAL_FAMILIES` the installed trainmon
offers; the default detectors run online and write ``anomalies.jsonl``.

Faults, from ``onset`` on (all at lr 3e-3 before it):

- ``lr_ramp``: the learning rate is multiplied by 1.02 per step (doubling every 35 steps) until training diverges.
- ``logit_growth``: the learning rate rises linearly to 0.2 over 200 steps and stays there; without QK
  normalisation the attention logits grow (the largest head's ``attn/max_logit`` from about 16 before the onset
  to 1,700-4,400 at the loss event, the lowest head entropy to about 0) and the loss climbs; the same schedule
  with QK normalisation (a healthy variant) trains on.
- ``repeated_batch``: for 30 steps every batch is 16 copies of one sequence; the model memorises it (loss near 0,
  gradients 50x smaller) and the loss jumps when ordinary batches return.
- ``eps_underflow``: the gradients are scaled by 1e-6 for good (a loss-scale bug; the global grad norm falls from
  about 0.44 to 4e-7): ``c * |g|`` falls below ``eps`` and Adam's update is left to the stale first moment while
  ``sqrt(v)`` decays; the loss rises 12-19% over the next 100 steps and training stalls (with a trained model no
  loss event: the fault is reported, not scored). The loss handed to the monitor is the unscaled one.

Healthy variants (by seed): ``base`` (lr 3e-3), ``lr_1e-2``, ``beta2_0.999`` and ``qk_norm_high_lr`` (QK
normalisation, the ``logit_growth`` schedule).
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "examples"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from tiny_gpt import Attention, TinyGPT  # noqa: E402

from benchmarks.detector_curves import MarkovText  # noqa: E402
from benchmarks.leadtime import FAULTS, loss_event  # noqa: E402

HEALTHY_VARIANTS: tuple[str, ...] = ("base", "lr_1e-2", "beta2_0.999", "qk_norm_high_lr")
VOCAB, WIDTH, BLOCKS, HEADS, HALF, BATCH = 64, 64, 2, 4, 16, 16
BASE_LR, WARMUP = 3e-3, 100
LR_GROWTH = 1.02
HIGH_LR, HIGH_LR_RAMP = 0.2, 200
REPEAT_STEPS = 30
GRAD_SCALE = 1e-6
WAIT_EVERY = 16
"""Steps between waits for the store to catch up: trainmon drops what its outputs cannot keep up with (it never
slows training), and a benchmark on a busy machine needs every step on disk."""
AFTER_EVENT = 20
"""Steps a fault run goes on after its loss event (then it stops: what follows is the wreck, not the warning)."""
MATRICES: list[str] = ["tok.weight", "pos.weight", "blocks.*.attn.qkv.weight", "blocks.*.attn.proj.weight",
                       "blocks.*.mlp.fc1.weight", "blocks.*.mlp.fc2.weight", "head.weight"]
"""The parameters trainmon watches: the 11 weight matrices (not biases or LayerNorm gains)."""


@dataclass(frozen=True)
class RunSpec:
    """One run: ``kind`` is ``healthy`` or a fault of :data:`FAULTS`; ``onset`` the fault's first step."""

    name: str
    kind: str
    seed: int
    steps: int
    onset: int | None = None
    variant: str = "base"

    @property
    def lr(self) -> float:
        return 1e-2 if self.variant == "lr_1e-2" else BASE_LR

    @property
    def beta2(self) -> float:
        return 0.999 if self.variant == "beta2_0.999" else 0.95

    @property
    def qk_norm(self) -> bool:
        return self.variant == "qk_norm_high_lr"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(healthy_runs: int, healthy_steps: int, fault_seeds: int, fault_onset: int = 500,
         fault_steps: int = 450, first_seed: int = 0) -> list[RunSpec]:
    """The runs of one benchmark: healthy runs cycling through the variants, then each fault with each seed
    (onsets staggered by 25 steps so that the faults do not all start at one step of one schedule).
    ``first_seed`` shifts every seed (healthy ``first_seed + i``, faults ``first_seed + 100 + i``): the held-out
    runs, whose data, initialisation and batches no threshold was chosen on.

    Example:
        >>> [s.name for s in plan(2, 10, 1, first_seed=1000)][:3]
        ['healthy-base-s1000', 'healthy-lr_1e-2-s1001', 'lr_ramp-s1100']
    """
    runs = [RunSpec(f"healthy-{HEALTHY_VARIANTS[i % len(HEALTHY_VARIANTS)]}-s{first_seed + i}", "healthy",
                    first_seed + i, healthy_steps,
                    fault_onset if HEALTHY_VARIANTS[i % len(HEALTHY_VARIANTS)] == "qk_norm_high_lr" else None,
                    HEALTHY_VARIANTS[i % len(HEALTHY_VARIANTS)]) for i in range(healthy_runs)]
    for fault in FAULTS:
        for seed in range(fault_seeds):
            onset = fault_onset + 25 * (seed % 4)
            runs.append(RunSpec(f"{fault}-s{first_seed + 100 + seed}", fault, first_seed + 100 + seed,
                                onset + fault_steps, onset))
    return runs


# ----------------------------------------------------------------------------------------------- model
class QKNormAttention(Attention):
    """``Attention`` with LayerNorm on each head's queries and keys (QK normalisation)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__(d, heads)
        self.q_norm = nn.LayerNorm(d // heads)
        self.k_norm = nn.LayerNorm(d // heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def make_model(spec: RunSpec) -> TinyGPT:
    torch.manual_seed(spec.seed)
    model = TinyGPT(vocab=VOCAB, d=WIDTH, layers=BLOCKS, heads=HEADS, seq=2 * HALF)
    if spec.qk_norm:
        for block in model.blocks:
            block.attn = QKNormAttention(WIDTH, HEADS)
    return model


def lr_multiplier(spec: RunSpec, step: int) -> float:
    """The learning rate of ``step`` over the run's base learning rate."""
    warm = min(1.0, (step + 1) / WARMUP)
    onset = spec.onset
    if onset is None or step < onset:
        return warm
    if spec.kind == "lr_ramp":
        return float(LR_GROWTH ** (step - onset))
    if spec.kind == "logit_growth" or spec.variant == "qk_norm_high_lr":
        return 1 + (HIGH_LR / spec.lr - 1) * min(1.0, (step - onset) / HIGH_LR_RAMP)
    return warm


class CopyText:
    """Batches of 16 Markov tokens followed by the same 16 again (inputs 32 tokens, targets shifted by one)."""

    def __init__(self, seed: int) -> None:
        self.text = MarkovText(VOCAB, seed=3000 + seed)
        self.generator = torch.Generator().manual_seed(2000 + seed)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.text.sample(BATCH, HALF, self.generator)[0]
        full = torch.cat([half, half, half[:, :1]], dim=1)
        return full[:, :-1], full[:, 1:]


OPTIONAL_FAMILIES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("precursors", {"optimizer_states": {"precursors": True}}),
    ("attn", {"features": {"attention": {"enabled": True}}}),
    ("weight_features", {"features": {"weights": {"enabled": True}}}),
)
"""Families a trainmon may offer beyond the default ones (per-layer optimizer precursors, per-head attention
features, weight spectra), turned on when the installed trainmon's config accepts their switch."""


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, mapping into mapping at every level.

    Example:
        >>> merged({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"c": 4}, "e": 5})
        {'a': {'b': 1, 'c': 4}, 'd': 3, 'e': 5}
    """
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def monitor_config(out_dir: Path, name: str, extra: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """trainmon's config of a run (every step collected into the store) and the optional families it turns on.

    Each of :data:`OPTIONAL_FAMILIES` is added when ``trainmon.config.load_config`` accepts it (a trainmon without
    it rejects the unknown key); ``extra`` (``--monitor-config``) is merged in last.
    """
    from trainmon.config import load_config
    from trainmon.errors import ConfigError

    config: dict[str, Any] = {
        "output_dir": str(out_dir), "run_name": name, "sinks": ["parquet"], "step_interval": 1,
        "targets": {"params": list(MATRICES)},
        "weight_grads": {"metrics": ["norm"], "unreduced": False},
        "optimizer_states": {"metrics": ["norm"]},
        "anomaly": {"actions": ["jsonl"]},
    }
    enabled = []
    for family, switch in OPTIONAL_FAMILIES:
        try:
            load_config(merged(config, switch))
        except ConfigError:
            continue
        config = merged(config, switch)
        enabled.append(family)
    return merged(config, extra or {}), enabled


FLUSH_TIMEOUT = 120.0
"""The most seconds a wait for the outputs may take (a store that still lacks steps then fails the run's check)."""


def wait_for_outputs(monitor: Any) -> None:
    """Let the monitor's outputs write what is queued (``monitor.flush``: the benchmark trades training speed for a
    complete store, which trainmon itself never does)."""
    monitor.flush(timeout=FLUSH_TIMEOUT)


def train(spec: RunSpec, out_dir: Path, extra: dict[str, Any] | None = None) -> tuple[Path, list[float]]:
    """Train one run with trainmon attached; returns its run directory and the loss of every step.

    A fault run stops :data:`AFTER_EVENT` steps after its loss event (:func:`benchmarks.leadtime.loss_event`).
    """
    from trainmon import TrainerMonitor

    torch.set_num_threads(1)
    model = make_model(spec)
    data = CopyText(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, spec.beta2), eps=1e-8,
                                  weight_decay=0.0)
    losses: list[float] = []
    repeated: tuple[torch.Tensor, torch.Tensor] | None = None
    event: int | None = None
    monitor = TrainerMonitor(monitor_config(out_dir, spec.name, extra)[0])
    try:
        monitor.attach(model, optimizer)
        for step in range(spec.steps):
            for group in optimizer.param_groups:
                group["lr"] = spec.lr * lr_multiplier(spec, step)
            tokens, targets = data.batch()
            faulty = spec.onset is not None and step >= spec.onset
            if spec.kind == "repeated_batch" and faulty and step < spec.onset + REPEAT_STEPS:  # type: ignore[operator]
                if repeated is None:
                    repeated = tokens[:1].clone(), targets[:1].clone()
                tokens, targets = repeated[0].expand(BATCH, -1), repeated[1].expand(BATCH, -1)
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            scale = GRAD_SCALE if spec.kind == "eps_underflow" and faulty else 1.0
            (loss * scale).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            monitor.step(loss=loss)
            losses.append(float(loss.detach()))  # host sync: the benchmark's own loss record (CPU training)
            if step % WAIT_EVERY == WAIT_EVERY - 1:
                wait_for_outputs(monitor)
            if spec.kind != "healthy" and event is None:
                event = loss_event(losses, last_only=True)
            if event is not None and step >= event + AFTER_EVENT:
                break
    finally:
        monitor.close()
    return out_dir / spec.name, losses


__all__ = ["FAULTS", "HEALTHY_VARIANTS", "MATRICES", "OPTIONAL_FAMILIES", "RunSpec", "lr_multiplier", "make_model",
           "merged", "monitor_config", "plan", "train"]


if __name__ == "__main__":  # a smoke run: python benchmarks/precursor_runs.py KIND [STEPS]
    import tempfile
    import time

    kind = sys.argv[1] if len(sys.argv) > 1 else "healthy"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        run_dir, values = train(RunSpec(f"{kind}-smoke", kind, 100, steps, None if kind == "healthy" else 150),
                                Path(tmp))
        seconds = time.perf_counter() - start
        print(f"{len(values)} steps, {seconds:.1f} s ({1e3 * seconds / len(values):.1f} ms/step); "
              f"event {loss_event(values)}; last losses {[round(v, 3) for v in values[-5:]]}"
              if math.isfinite(seconds) else "")
