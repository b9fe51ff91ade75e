"""``loss_spike``: a preset of :mod:`spike` for the loss against its recent history."""

from __future__ import annotations

from dataclasses import dataclass

from trainmon.anomaly.detectors.spike import SpikeConfig, SpikeDetector


@dataclass
class LossSpikeConfig:
    """Spec of the ``loss_spike`` preset (median/MAD z-score of the loss, upward only)."""

    threshold: float = 6.0
    """Robust z-score the loss must exceed."""
    min_relative_change: float = 1.0
    """The loss must also exceed its recent median by this fraction (1.0: at least twice the median)."""
    warmup: int = 10
    """Steps seen before it may fire."""
    window: int = 50
    """Recent losses the median and MAD are taken over."""
    direction: str = "up"
    """up, down or both."""


class LossSpikeDetector(SpikeDetector):
    """Loss spikes: fires when the loss is far above (robust z > 6) and at least twice its
    median of the last 50 steps, after 10 steps of warm-up. A 4x jump fires; the step-to-step
    noise of a healthy run (tens of percent) does not.

    Example:
        >>> from trainmon.records import StepRecord
        >>> d = LossSpikeDetector(LossSpikeConfig(warmup=3))
        >>> [len(d.update(StepRecord(s, 0, scalars={"loss": v}), "")) for s, v in enumerate([2, 2.1, 1.9, 2, 8])]
        [0, 0, 0, 0, 1]
    """

    type_name = "loss_spike"
    config_class = LossSpikeConfig
    choices = {"direction": ("up", "down", "both")}
    minimum = {"threshold": 0.0, "warmup": 0, "window": 3, "min_relative_change": 0.0}

    def __init__(self, config: LossSpikeConfig, path: str = "anomaly.detectors[0]") -> None:
        spike = SpikeConfig(series=["loss"], method="mad", threshold=config.threshold, warmup=config.warmup,
                            direction=config.direction, window=config.window,
                            min_relative_change=config.min_relative_change)
        super().__init__(spike, path)
        self.preset = config
