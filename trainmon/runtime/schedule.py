"""Which steps are collected (framework-free)."""

from __future__ import annotations

from dataclasses import dataclass

from trainmon.config import MonitorConfig


@dataclass
class StepSchedule:
    """Decides per step whether to collect; counts collected steps for ``collect_times``."""

    config: MonitorConfig
    rank_selected: bool = True
    collected: int = 0

    def is_collected(self, step: int) -> bool:
        c = self.config
        if not c.enabled or not self.rank_selected or step < c.start_step:
            return False
        if c.collect_times is not None and self.collected >= c.collect_times:
            return False
        return (step - c.start_step) % c.step_interval == 0
