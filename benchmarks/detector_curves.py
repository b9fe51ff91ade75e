"""Healthy training curves for the detector benchmark, from real small torch models.

    python benchmarks/detector_curves.py [--out benchmarks/data/curves.npz] [--runs 4] [--steps 3000]
                                         [--regimes REGIME ...]

Trains small models in seven regimes and records, per step, the loss handed to the monitor, the
global gradient norm (before clipping) and the gradient norms of four weight matrices. Also records
"blow-ups": forks of a healthy run where one layer's weights start to diverge along one direction
(a perturbation growing 1.25x per step, added after each optimizer step), for the per-layer early
warning. ``benchmarks/anomaly_detectors.py`` reads the file; CI never retrains (about 3 minutes on
2 CPU cores). Deterministic for a given torch version and thread count (run with OMP_NUM_THREADS=1).

Regimes (all classification on Gaussian-mixture data unless said otherwise, fresh batches each step):

- ``large_batch``: 10 classes, batch 1024, Adam 2e-3, 10% label noise: a smooth curve.
- ``small_batch``: 3 classes, batch 16, 20% label noise, Adam 3e-3: the held-out case's regime.
- ``warmup_decay``: a 2-layer TinyGPT on a Markov-chain language, batch 16, AdamW with 300 steps of
  linear warm-up to 3e-3 and cosine decay to 0.
- ``data_mix``: two sources (10% and 25% label noise, shifted inputs) whose mix changes abruptly at
  steps 750, 1500 and 2250 (0%, 40%, 10%, 70% of the noisier one): loss level shifts of up to 1.5x.
- ``periodic_eval``: 2,048 training examples (multi-epoch), dropout 0.2, batch 32; every 100th loss
  handed over is the loss on 1,024 held-out examples in eval mode (a loop that passes the eval loss).
- ``restart``: checkpoints every 400 steps; the job dies at steps 1000 and 2100 and resumes from the
  last checkpoint (800, 2000) with a new data order, the second time with fresh optimizer state and a
  50-step LR re-warm-up. The recorded series is what the monitor sees, replayed steps included.
- ``curriculum``: batch 16, 3 classes, from a model trained 300 (unrecorded) steps on the easy data;
  the data gets harder in three 200-step ramps (label noise 10% -> 20% at steps 700-900, -> 30% at
  1500-1700, -> 45% at 2300-2500): a healthy noisy run whose median loss rises about 2x over 200
  steps, the shape of the held-out case the loss trend rule fired on.

Storage: ``log(value)`` quantised to 2e-4 (0.02% relative), delta-encoded as int16 per channel,
``np.savez_compressed``; the file stays under 1 MB.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from tiny_gpt import TinyGPT  # noqa: E402

RESOLUTION = 2e-4
"""Quantisation step of log(value)."""
DEFAULT_OUT = ROOT / "benchmarks" / "data" / "curves.npz"
REGIMES = ("large_batch", "small_batch", "warmup_decay", "data_mix", "periodic_eval", "restart", "curriculum")
BLOWUP_STEPS = 80
CURRICULUM_WARM_START = 300
"""Unrecorded steps on the easy data before ``curriculum``'s recorded run (a later stage of a curriculum; a cold
start of this small noisy batch is the young phase the other regimes cover)."""
BLOWUP_GROWTH = 1.25


# ----------------------------------------------------------------------------------------- data
class Mixture:
    """Gaussian-mixture classification: class ``c`` has mean ``means[c]``; labels flipped with ``noise``."""

    def __init__(self, classes: int, dim: int, separation: float, noise: float, seed: int,
                 shift: float = 0.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.means = separation * torch.randn(classes, dim, generator=g) / math.sqrt(dim)
        self.means += shift * torch.randn(1, dim, generator=g) / math.sqrt(dim)
        self.classes, self.dim, self.noise = classes, dim, noise

    def sample(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, self.classes, (n,), generator=g)
        x = self.means[y] + torch.randn(n, self.dim, generator=g)
        flip = torch.rand(n, generator=g) < self.noise
        other = (y + torch.randint(1, self.classes, (n,), generator=g)) % self.classes
        return x, torch.where(flip, other, y)


class MLP(nn.Module):
    """``layers.0-2`` (tanh) and ``head``: the four weight matrices whose gradient norms are recorded."""

    def __init__(self, dim: int, hidden: int, classes: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)])
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return self.head(x)


MLP_LAYERS = ("layers.0.weight", "layers.1.weight", "layers.2.weight", "head.weight")
GPT_LAYERS = ("tok.weight", "blocks.0.attn.qkv.weight", "blocks.1.mlp.fc1.weight", "head.weight")


class MarkovText:
    """A first-order Markov language over ``vocab`` tokens, about 3 likely successors per token."""

    def __init__(self, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        logits = 3.0 * torch.randn(vocab, vocab, generator=g)
        self.cumulative = torch.softmax(logits, dim=1).cumsum(dim=1).contiguous()
        self.vocab = vocab

    def sample(self, batch: int, seq: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), generator=g)
        uniform = torch.rand(seq, batch, 1, generator=g)
        for t in range(seq):  # inverse-CDF sampling of each successor
            row = self.cumulative[tokens[:, t]]
            tokens[:, t + 1] = torch.searchsorted(row, uniform[t]).squeeze(1).clamp_(max=self.vocab - 1)
        return tokens[:, :-1], tokens[:, 1:]


# ----------------------------------------------------------------------------------------- runs
@dataclass
class Trainer:
    """One training run: a model, its optimizer and schedule, its data, and the step function."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    layers: tuple[str, ...]
    batch_fn: object  # (step, generator) -> loss tensor
    lr_fn: object  # step -> lr multiplier
    generator: torch.Generator
    base_lr: float
    step: int = 0
    extra: dict = field(default_factory=dict)

    def train_step(self) -> tuple[float, float, list[float]]:
        """One optimizer step; returns (loss, global grad norm, per-layer grad norms)."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr * self.lr_fn(self.step)
        self.model.train()
        loss = self.batch_fn(self, self.step)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = dict(self.model.named_parameters())
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        total = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        layers = [float(torch.linalg.vector_norm(params[name].grad)) for name in self.layers]
        self.optimizer.step()
        self.step += 1
        return float(loss.detach()), total, layers


def _mlp_trainer(seed: int, *, classes: int, batch: int, noise: float, lr: float, hidden: int = 32,
                 dim: int = 16, separation: float = 6.0, lr_fn=lambda s: 1.0, dropout: float = 0.0) -> Trainer:
    torch.manual_seed(seed)
    model = MLP(dim, hidden, classes, dropout)
    data = Mixture(classes, dim, separation, noise, seed=1000 + seed)

    def batch_fn(trainer: Trainer, step: int) -> torch.Tensor:
        x, y = data.sample(batch, trainer.generator)
        return nn.functional.cross_entropy(trainer.model(x), y)

    return Trainer(model, torch.optim.Adam(model.parameters(), lr=lr), MLP_LAYERS, batch_fn, lr_fn,
                   torch.Generator().manual_seed(2000 + seed), lr)


def _warmup_cosine(warmup: int, total: int):
    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return fn


def make_trainer(regime: str, seed: int, steps: int) -> Trainer:
    """The trainer of ``regime`` with ``seed`` (see the module docstring)."""
    if regime == "large_batch":
        return _mlp_trainer(seed, classes=10, batch=1024, noise=0.1, lr=2e-3, hidden=64, separation=4.0)
    if regime == "small_batch":
        return _mlp_trainer(seed, classes=3, batch=16, noise=0.2, lr=3e-3)
    if regime == "warmup_decay":
        torch.manual_seed(seed)
        model = TinyGPT(vocab=32, d=32, layers=2, heads=2, seq=32)
        text = MarkovText(32, seed=3000 + seed)

        def batch_fn(trainer: Trainer, step: int) -> torch.Tensor:
            x, y = text.sample(16, 32, trainer.generator)
            logits = trainer.model(x)
            return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        return Trainer(model, optimizer, GPT_LAYERS, batch_fn, _warmup_cosine(300, steps),
                       torch.Generator().manual_seed(2000 + seed), 3e-3)
    if regime == "data_mix":
        trainer = _mlp_trainer(seed, classes=5, batch=64, noise=0.1, lr=3e-3)
        clean = Mixture(5, 16, 6.0, 0.10, seed=1000 + seed)
        noisy = Mixture(5, 16, 6.0, 0.25, seed=1000 + seed, shift=1.0)
        noisy.means = clean.means + (noisy.means - clean.means) * 0.3  # same classes, shifted inputs
        fractions = [(0, 0.0), (750, 0.4), (1500, 0.1), (2250, 0.7)]

        def batch_fn(trainer: Trainer, step: int) -> torch.Tensor:
            fraction = [f for start, f in fractions if step >= start][-1]
            n_noisy = round(64 * fraction)
            xa, ya = clean.sample(64 - n_noisy, trainer.generator)
            xb, yb = noisy.sample(n_noisy, trainer.generator)
            return nn.functional.cross_entropy(trainer.model(torch.cat([xa, xb])), torch.cat([ya, yb]))

        trainer.batch_fn = batch_fn
        return trainer
    if regime == "periodic_eval":
        trainer = _mlp_trainer(seed, classes=5, batch=32, noise=0.1, lr=3e-3, dropout=0.2, hidden=64)
        data = Mixture(5, 16, 6.0, 0.1, seed=1000 + seed)
        g = torch.Generator().manual_seed(4000 + seed)
        train_x, train_y = data.sample(2048, g)
        eval_x, eval_y = data.sample(1024, g)

        def batch_fn(trainer: Trainer, step: int) -> torch.Tensor:
            if step % 100 == 99:  # the eval loss handed over in place of this step's train loss
                trainer.model.eval()
                with torch.no_grad():
                    eval_loss = nn.functional.cross_entropy(trainer.model(eval_x), eval_y)
                trainer.model.train()
                trainer.extra["eval_loss"] = float(eval_loss)
            order = trainer.extra.setdefault("order", [])  # in extra: copied with the trainer
            if not order:
                order.extend(torch.randperm(2048, generator=trainer.generator).split(32))
            index = order.pop()
            return nn.functional.cross_entropy(trainer.model(train_x[index]), train_y[index])

        trainer.batch_fn = batch_fn
        return trainer
    if regime == "restart":
        return _mlp_trainer(seed, classes=5, batch=64, noise=0.15, lr=3e-3,
                            lr_fn=_warmup_cosine(100, steps))
    if regime == "curriculum":
        trainer = _mlp_trainer(seed, classes=3, batch=16, noise=0.1, lr=3e-3)
        ramps = [(700, 0.10, 0.20), (1500, 0.20, 0.30), (2300, 0.30, 0.45)]  # (start, from, to) over 200 steps
        easy = Mixture(3, 16, 6.0, 0.0, seed=1000 + seed)

        def batch_fn(trainer: Trainer, step: int) -> torch.Tensor:
            noise = 0.1
            for start, low, high in ramps:
                if step >= start:
                    noise = low + (high - low) * min(1.0, (step - start) / 200)
            easy.noise = noise
            x, y = easy.sample(16, trainer.generator)
            return nn.functional.cross_entropy(trainer.model(x), y)

        trainer.batch_fn = batch_fn
        for _ in range(CURRICULUM_WARM_START):  # not recorded: the recorded run starts from a trained model
            trainer.train_step()
        trainer.step = 0
        return trainer
    raise ValueError(f"unknown regime {regime!r}")


def run_healthy(regime: str, seed: int, steps: int) -> tuple[np.ndarray, dict[int, Trainer]]:
    """``steps`` recorded steps: columns loss, grad_norm, 4 layer norms. Also returns snapshots of
    the trainer at a few steps (for the blow-up forks)."""
    trainer = make_trainer(regime, seed, steps)
    rows: list[list[float]] = []
    snapshots: dict[int, Trainer] = {}
    fork_at = {steps // 3, steps // 2 + 137 * seed % 300, 2 * steps // 3 + 53 * seed % 200}
    checkpoints: dict[int, Trainer] = {}
    restarts = {1000: (800, False), 2100: (2000, True)} if regime == "restart" else {}
    while len(rows) < steps:
        recorded = len(rows)
        if recorded in fork_at:
            snapshots[recorded] = copy.deepcopy(trainer)
        if regime == "restart" and trainer.step % 400 == 0:
            checkpoints[trainer.step] = copy.deepcopy(trainer)
        if regime == "restart" and trainer.step in restarts and not trainer.extra.get(f"died{trainer.step}"):
            back, fresh_optimizer = restarts[trainer.step]
            died = trainer.step
            trainer = copy.deepcopy(checkpoints[back])
            trainer.extra[f"died{died}"] = True
            for key in list(checkpoints):  # later checkpoints were never written
                if key > back:
                    del checkpoints[key]
            trainer.generator = torch.Generator().manual_seed(5000 + 17 * seed + died)  # new data order
            if fresh_optimizer:
                trainer.optimizer = torch.optim.Adam(trainer.model.parameters(), lr=trainer.base_lr)
                schedule, start = trainer.lr_fn, trainer.step
                trainer.lr_fn = lambda s, schedule=schedule, start=start: schedule(s) * min(1.0, (s - start + 1) / 50)
        loss, total, layers = trainer.train_step()
        if "eval_loss" in trainer.extra:
            loss = trainer.extra.pop("eval_loss")
        rows.append([loss, total, *layers])
    return np.asarray(rows, dtype=np.float64), snapshots


def run_blowup(trainer: Trainer, layer: int, seed: int) -> tuple[np.ndarray, str]:
    """Fork: from now on one layer's weights get an extra perturbation along a fixed rank-1 direction,
    growing ``BLOWUP_GROWTH``x per step from 1e-4 of the layer's norm (added after each optimizer step).
    Stops early when a value is no longer finite (or the loss passes 1e6): returns the rows and
    ``"nonfinite"``, else ``"steps"``."""
    trainer = copy.deepcopy(trainer)
    weight = dict(trainer.model.named_parameters())[trainer.layers[layer]]
    g = torch.Generator().manual_seed(6000 + seed)
    u = torch.randn(weight.shape[0], 1, generator=g)
    v = torch.randn(1, weight.shape[1], generator=g)
    direction = u @ v
    direction *= float(weight.detach().norm()) / float(direction.norm())
    rows = []
    for k in range(BLOWUP_STEPS):
        loss, total, layers = trainer.train_step()
        if "eval_loss" in trainer.extra:
            loss = trainer.extra.pop("eval_loss")
        if not all(math.isfinite(v) and v > 0 for v in (loss, total, *layers)) or loss > 1e6:
            return np.asarray(rows, dtype=np.float64), "nonfinite"
        rows.append([loss, total, *layers])
        with torch.no_grad():
            weight.add_(direction * (1e-4 * BLOWUP_GROWTH ** k))
    return np.asarray(rows, dtype=np.float64), "steps"


# ----------------------------------------------------------------------------------------- storage
def encode(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positive ``[steps, channels]`` -> (int16 deltas of quantised logs, float64 offsets)."""
    logs = np.log(values)
    offsets = logs[0].copy()
    q = np.rint((logs - offsets) / RESOLUTION).astype(np.int64)
    deltas = np.diff(q, axis=0, prepend=0)
    small = np.abs(deltas).max() <= np.iinfo(np.int16).max  # else a blow-up's jump: int32
    return deltas.astype(np.int16 if small else np.int32), offsets


def decode(deltas: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return np.exp(offsets + np.cumsum(deltas.astype(np.int64), axis=0) * RESOLUTION)


def generate(out: Path, runs: int, steps: int, regimes: tuple[str, ...] = REGIMES) -> None:
    """Train ``regimes`` and write them to ``out``; the other regimes already in ``out`` are kept as they are
    (so a new regime is added without retraining the rest)."""
    torch.set_num_threads(1)
    arrays: dict[str, np.ndarray] = {}
    meta: dict = {"resolution": RESOLUTION, "regimes": {}, "blowups": [], "torch": torch.__version__,
                  "blowup_growth": BLOWUP_GROWTH}
    if out.exists() and set(regimes) != set(REGIMES):
        with np.load(out) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            kept = [r for r in meta["regimes"] if r not in regimes]
            arrays = {k: data[k] for k in data.files if k != "meta" and k.split("/")[0] in kept}
        meta["regimes"] = {r: meta["regimes"][r] for r in kept}
        meta["blowups"] = [b for b in meta["blowups"] if b["regime"] in kept]
        meta.setdefault("torch_by_regime", {}).update({r: torch.__version__ for r in regimes})
    for regime in regimes:
        start = time.perf_counter()
        layers = list(GPT_LAYERS if regime == "warmup_decay" else MLP_LAYERS)
        meta["regimes"][regime] = {"runs": runs, "layers": layers}
        for seed in range(runs):
            values, snapshots = run_healthy(regime, seed, steps)
            arrays[f"{regime}/{seed}/d"], arrays[f"{regime}/{seed}/o"] = encode(values)
            for i, (at, trainer) in enumerate(sorted(snapshots.items())):
                layer = (seed + i) % 4
                fork, ended = run_blowup(trainer, layer, seed=100 * seed + i)
                key = f"{regime}/{seed}/blowup{i}"
                arrays[f"{key}/d"], arrays[f"{key}/o"] = encode(fork)
                meta["blowups"].append({"key": key, "regime": regime, "run": seed, "start": at,
                                        "layer": layer, "steps": len(fork), "ended": ended})
        print(f"{regime}: {runs} runs x {steps} steps in {time.perf_counter() - start:.0f} s", flush=True)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **arrays)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--regimes", nargs="+", choices=REGIMES, default=list(REGIMES),
                        help="train only these (the others already in --out are kept)")
    args = parser.parse_args(argv)
    generate(args.out, args.runs, args.steps, tuple(args.regimes))


if __name__ == "__main__":
    main()
