"""Peers' spike rules, re-implemented on host floats for ``benchmarks/anomaly_detectors.py``.

Each class follows its peer's public source line by line (defaults included), minus the framework
plumbing (tensors, process groups, raising or stopping training): ``update(value) -> bool`` says
whether the rule flags this value, and training goes on. Where a peer stops training on a spike we
keep its state exactly as it would be had it only logged. Sources read for this port:

- Lightning ``SpikeDetection``: ``lightning/fabric/utilities/spike.py`` of lightning 2.6.6 (installed).
- OLMo-core ``StabilityMonitorCallback``: ``src/olmo_core/train/callbacks/stability_monitor.py``
  (allenai/OLMo-core, commit 138b1fc).
- Megatron ``RerunStateMachine.is_unexpectedly_large``: ``megatron/core/rerun_state_machine.py`` of
  megatron-core 0.16.1 (installed), called from Megatron-LM's ``pretrain_gpt.py::loss_func`` with
  ``SPIKY_LOSS_FACTOR = 10`` after its NaN and Inf checks of the loss, and from
  ``param_and_grad_buffer.py`` with ``threshold=10, context="grads"`` on each bucket's grad norm.
- llm-foundry ``KillLossSpike``: ``llmfoundry/callbacks/kill_loss_spike_callback.py``
  (mosaicml/llm-foundry, commit 56891fc: window = max(100, 5% of the run), loss cap from the first window).
- OLMo-core ``SkipStepOptimizer.get_step_factor``: ``src/olmo_core/optim/skip_step_optimizer.py``
  (allenai/OLMo-core, commit 067267c: ``rolling_interval_length=128``, ``sigma_factor=6``).
- ZClip: ``zclip/zclip.py`` (bluorion-com/ZClip, commit 1acb085: ``alpha=0.97, z_thresh=2.5, eps=1e-6,
  warmup_steps=25, mode="zscore", clip_option="adaptive_scaling", clip_factor=1.0``).
- msprobe ``AnomalyTurbulence``: ``msprobe/pytorch/monitor/anomaly_detect.py`` of mindstudio-probe
  1.2.1 (cumulative mean) and ``msprobe/core/monitor/anomaly_processor.py`` +
  ``msprobe/pytorch/monitor/data_writers.py`` of mindstudio-probe 26.2.0 (EMA of |value|, beta 0.99;
  ``AnomalyNan`` from the same rule set), both from ``pip download --no-deps``.
"""

from __future__ import annotations

import math
from collections import deque


class LightningSpike:
    """Lightning ``SpikeDetection(mode="min", window=10, warmup=1, atol=None, rtol=2.0, finite_only=True)``.

    A spike: not lower than the last accepted value and ``|value - running mean| >= rtol * running mean``
    (the running mean of the last ``window`` accepted values); with ``finite_only`` a non-finite value is
    a spike. Spikes are not added to the statistics (Lightning raises before updating them).
    """

    def __init__(self, window: int = 10, warmup: int = 1, atol: float | None = None, rtol: float | None = 2.0,
                 finite_only: bool = True) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self.last_val = 0.0
        self.warmup, self.atol, self.rtol, self.finite_only = warmup, atol, rtol, finite_only
        self.batch_idx = 0

    def _is_spike(self, loss: float) -> bool:
        running = sum(self.values) / len(self.values) if self.values else math.nan
        if self.finite_only and not math.isfinite(loss):
            return True
        if loss - self.last_val <= 0.0:  # _is_better in mode "min"
            return False
        atol_ok = self.atol is None or abs(loss - running) >= abs(self.atol)
        rtol_ok = self.rtol is None or abs(loss - running) >= abs(self.rtol * running)
        return atol_ok and rtol_ok

    def update(self, loss: float) -> bool:
        spike = self.batch_idx >= self.warmup and self._is_spike(loss)
        self.batch_idx += 1
        if not spike and (self.finite_only or math.isfinite(loss)):
            self.values.append(loss)  # _update_stats
            self.last_val = loss
        return spike


class OlmoStability:
    """OLMo-core ``StabilityMonitorCallback(window_size=128, threshold_std=6.0)`` for one metric
    (it runs the same rule on the CE loss and on the grad norm): a spike is ``value > mean + 6 * std``
    of the last 128 values (population std), checked only once the window is full; every value
    (spikes too) enters the window."""

    def __init__(self, window_size: int = 128, threshold_std: float = 6.0) -> None:
        self.history: deque[float] = deque(maxlen=window_size)
        self.window_size, self.threshold_std = window_size, threshold_std

    def update(self, value: float) -> bool:
        spike = False
        if len(self.history) >= self.window_size:
            mean = sum(self.history) / len(self.history)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / len(self.history))
            spike = std >= 1e-10 and value > mean + self.threshold_std * std
        self.history.append(value)
        return spike


class MegatronLarge:
    """Megatron ``is_unexpectedly_large(threshold=10, num_samples=100)``: the max |value| of the first
    100 values is the reference; later values ``>= 10 * max`` are flagged; NaN/Inf are ignored by it.
    ``check_nonfinite`` adds ``loss_func``'s ``torch.isnan``/``torch.isinf`` checks (the loss only)."""

    def __init__(self, threshold: float = 10.0, num_samples: int = 100, check_nonfinite: bool = True) -> None:
        self.threshold, self.num_samples, self.check_nonfinite = threshold, num_samples, check_nonfinite
        self.count = 0
        self.max_value = 0.0

    def update(self, value: float) -> bool:
        if not math.isfinite(value):
            return self.check_nonfinite
        value = abs(value)
        if self.count < self.num_samples:
            self.count += 1
            self.max_value = max(self.max_value, value)
            return False
        return value >= self.max_value * self.threshold


class FoundryKillLossSpike:
    """llm-foundry ``KillLossSpike(log_only=True, patience=4, outlier_multiplier=2)`` (newest form).

    The window (100 losses) grows once to 5% of the run's batches; a loss ``>= 2 *`` the window mean
    counts as an outlier and more than ``patience`` outliers in a row flag a spike; or, after two
    windows, half the window above ``loss_cap`` (10, or the first window's max) flags high losses.
    ``total_steps`` is what Composer's ``max_duration`` gives it. Composer's ``timestamp.batch`` at
    ``batch_end`` counts the batch just finished, so ``current_step == window_size`` never holds when a
    full window is first seen and the cap stays 10, exactly as in the callback.
    """

    def __init__(self, total_steps: int, patience: int = 4, outlier_multiplier: float = 2.0,
                 window_size: int = 100, loss_cap: float = 10.0) -> None:
        self.total_steps, self.patience, self.outlier_multiplier = total_steps, patience, outlier_multiplier
        self.window_size, self.loss_cap = window_size, loss_cap
        self.loss_window: deque[float] = deque()
        self.outlier_counter = 0
        self.window_size_set = window_size != 100
        self.loss_cap_set = loss_cap != 10.0
        self.batch = 0

    def _detect_loss_spike(self, train_loss: float, running_loss_avg: float) -> bool:
        if train_loss >= running_loss_avg * self.outlier_multiplier:
            self.outlier_counter += 1
            return self.outlier_counter > self.patience
        if self.outlier_counter > 0:
            self.outlier_counter = 0
        return False

    def _detect_high_losses(self, current_step: int) -> bool:
        if current_step < self.window_size * 2:
            return False
        return sum(1 for loss in self.loss_window if loss > self.loss_cap) >= self.window_size / 2

    def update(self, train_loss: float) -> bool:
        self.batch += 1
        current_step = self.batch
        fired = False
        if len(self.loss_window) == self.window_size:
            if not self.window_size_set:
                self.window_size = max(self.window_size, round(self.total_steps * 0.05))
                self.loss_window = deque(self.loss_window, maxlen=self.window_size)
                self.window_size_set = True
                if self.window_size > 100:
                    self.loss_window.append(train_loss)
                    return False
            if not self.loss_cap_set and current_step == self.window_size:
                self.loss_cap = min(max(self.loss_window), self.loss_cap)
                self.loss_cap_set = True
            running_loss_avg = sum(self.loss_window) / len(self.loss_window)
            fired = self._detect_loss_spike(train_loss, running_loss_avg) or self._detect_high_losses(current_step)
        self.loss_window.append(train_loss)
        return fired


class MsprobeTurbulence:
    """msprobe ``AnomalyTurbulence(threshold=0.5)`` on one metric tag.

    ``version="1.2.1"``: the baseline is the cumulative mean of the earlier values (the first value is
    its own baseline); fires when ``value > mean * (1 + threshold)`` (``<`` for a non-positive mean).
    A NaN makes the mean NaN for good, as in msprobe.
    ``version="ema"`` (26.2.0): the baseline is an EMA of |value| (beta 0.99, started at the first
    |value|, not bias-corrected); fires when ``|value| > ema * (1 + threshold)``; with ``AnomalyNan``
    (no threshold) a NaN fires too.
    """

    def __init__(self, version: str = "1.2.1", threshold: float = 0.5, beta: float = 0.99) -> None:
        if version not in ("1.2.1", "ema"):
            raise ValueError(version)
        self.version, self.threshold, self.beta = version, threshold, beta
        self.avg: float | None = None
        self.count = 0

    def update(self, value: float) -> bool:
        if self.version == "1.2.1":
            if self.avg is None:
                self.avg = value
            baseline = self.avg
            self.avg = (self.avg * self.count + value) / (self.count + 1)
            self.count += 1
            up_bound = baseline + baseline * self.threshold
            return value > up_bound if baseline > 0 else value < up_bound
        magnitude = abs(value)
        if self.avg is None:
            self.avg = magnitude
        baseline = self.avg
        self.avg = self.beta * self.avg + (1 - self.beta) * magnitude  # a NaN poisons it, as in msprobe
        self.count += 1
        return math.isnan(value) or magnitude > baseline * (1 + self.threshold)  # AnomalyNan, AnomalyTurbulence


class OlmoSkipStep:
    """OLMo-core ``SkipStepOptimizer(rolling_interval_length=128, sigma_factor=6)`` for one metric (it skips the
    step when the loss or the grad norm fails this check): the last 129 values are kept (the newest included);
    once 64 are, a value is flagged unless ``|value - mean| / std <= 6`` over the values before it (``torch.std``:
    Bessel-corrected). A NaN (a NaN z-score, ``0 / 0`` of a constant window included) fails the check."""

    def __init__(self, rolling_interval_length: int = 128, sigma_factor: float = 6.0) -> None:
        self.values: deque[float] = deque(maxlen=rolling_interval_length + 1)
        self.rolling_interval_length, self.sigma_factor = rolling_interval_length, sigma_factor

    def update(self, value: float) -> bool:
        self.values.append(value)  # the latest_loss / latest_grad_norm setter
        if len(self.values) < max(20, self.rolling_interval_length // 2):
            return False
        before = list(self.values)[:-1]
        mean = sum(before) / len(before)
        std = math.sqrt(sum((x - mean) ** 2 for x in before) / (len(before) - 1))
        try:
            z = abs(value - mean) / std
        except ZeroDivisionError:  # torch: x / 0 is inf, 0 / 0 is nan
            z = math.nan if value == mean or math.isnan(value) else math.inf
        return not z <= self.sigma_factor


class ZClip:
    """ZClip's detection (``mode="zscore"``, ``clip_option="adaptive_scaling"``): the first 25 grad norms give
    the mean and (population) variance; then a norm with ``z = (norm - mean) / (std + 1e-6) > 2.5`` is clipped to
    ``mean + 2.5 * std / (z / 2.5)``, and the EMAs (alpha 0.97; the variance around the updated mean) take the
    clipped value. Flagged: a clipped step. A NaN norm is never clipped and poisons the EMAs, as in ZClip."""

    def __init__(self, alpha: float = 0.97, z_thresh: float = 2.5, eps: float = 1e-6, warmup_steps: int = 25) -> None:
        self.alpha, self.z_thresh, self.eps, self.warmup_steps = alpha, z_thresh, eps, warmup_steps
        self.buffer: list[float] = []
        self.mean = self.var = 0.0
        self.initialized = False

    def update(self, grad_norm: float) -> bool:
        if not self.initialized:
            self.buffer.append(grad_norm)
            if len(self.buffer) >= self.warmup_steps:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
                self.initialized = True
                self.buffer = []
            return False
        std = self.var ** 0.5
        z = (grad_norm - self.mean) / (std + self.eps)
        clip_val = None
        if z > self.z_thresh:
            eta = z / self.z_thresh
            clip_val = self.mean + (self.z_thresh * std) / eta
        effective = clip_val if clip_val is not None else grad_norm
        self.mean = self.alpha * self.mean + (1 - self.alpha) * effective
        self.var = self.alpha * self.var + (1 - self.alpha) * (effective - self.mean) ** 2
        return clip_val is not None


class TrainmonLossSpikeV0:
    """trainmon's own ``loss_spike`` before this benchmark (commit aea40c6), for the before/after rows:
    ``|log(loss / median of the last 7)| > 6 * spread`` (spread: ``1.4826 * MAD / sqrt(2)`` of the last
    50 log-ratios, at least 0.02) and at least 2x, after 10 losses; a firing loss enters at the z-band
    edge. Non-finite and non-positive losses are skipped (the ``nonfinite`` detector reports them)."""

    def __init__(self, threshold: float = 6.0, min_relative_change: float = 1.0, warmup: int = 10,
                 window: int = 50, level_window: int = 7, min_spread: float = 0.02, nonfinite: bool = True) -> None:
        self.threshold, self.min_relative_change, self.warmup = threshold, min_relative_change, warmup
        self.min_spread, self.nonfinite = min_spread, nonfinite
        self.values: deque[float] = deque(maxlen=level_window)
        self.log_ratios: deque[float] = deque(maxlen=window)
        self.count = 0

    def update(self, value: float) -> bool:
        if not math.isfinite(value) or value <= 0:
            return self.nonfinite and not math.isfinite(value)
        fires, level, score, spread = False, math.nan, 0.0, 0.0
        if self.values:
            level = sorted(self.values)[len(self.values) // 2] if len(self.values) % 2 else \
                sum(sorted(self.values)[len(self.values) // 2 - 1:len(self.values) // 2 + 1]) / 2
            if len(self.log_ratios) >= 2:
                ratios = sorted(self.log_ratios)
                center = _median(ratios)
                spread = max(1.4826 * _median(sorted(abs(r - center) for r in ratios)) / math.sqrt(2.0),
                             self.min_spread)
                distance = math.log(value / level)
                score = distance / spread
                fires = (self.count >= self.warmup and abs(distance) > math.log1p(self.min_relative_change)
                         and score > self.threshold)
        fed = level * math.exp(self.threshold * spread) if fires else value
        if self.values:
            self.log_ratios.append(math.log(fed / self.values[-1]))
        self.values.append(fed)
        self.count += 1
        return fires


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
