"""The step guard's judgement as a source for Megatron-Core's rerun state machine (``validate_result``).

Megatron's rerun state machine (``megatron.core.rerun_state_machine``) re-runs an iteration's forward and backward
passes when a result fails validation, to tell a transient fault (not reproduced in place), a persistent one
(reproduced in place, not on another GPU after a restart from a checkpoint) and a correct but unexpected result.
Results are validated from inside the ``should_run_forward_backward`` loop with ``validate_result``.
:class:`RerunValidation` makes the step guard (``anomaly.guard``) such a source: after the forward-backward pass,
when the reduced gradients exist, it judges them as the guard would at the optimizer step (without counting the
step in the guard's history) and validates the global gradient norm twice, as Megatron's own gradient checks do:

- ``"trainmon step guard: non-finite gradient norm"``: rejected when the ``nonfinite`` rule fires (default fatal);
- ``"trainmon step guard: gradient norm spike"``: rejected when ``max_grad_norm``, ``z_threshold`` or
  ``per_parameter`` fires (default not fatal).

The state machine keeps its own decisions and exit codes (16: resume from the checkpoint to disambiguate, 17:
failed validation); the guard still judges the gradients the optimizer finally gets (after a re-run, the re-run's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainmon.base.records import GUARD_REASONS
from trainmon.integrations.megatron.guard import PART, guard_on

if TYPE_CHECKING:
    import torch

    from trainmon.integrations.megatron.guard import MegatronStepGuard

NONFINITE_MESSAGE = "trainmon step guard: non-finite gradient norm"
SPIKE_MESSAGE = "trainmon step guard: gradient norm spike"
_NONFINITE = GUARD_REASONS.index("nonfinite")


class RerunValidation:
    """Validates each iteration's reduced gradients with the step guard, through Megatron's rerun state machine.

    Args:
        optimizer: the Megatron optimizer the monitor was attached with, ``anomaly.guard`` enabled.
        fatal_nonfinite: ``validate_result``'s ``fatal`` for a non-finite norm (Megatron's own NaN checks: True).
        fatal_spike: ``fatal`` for a norm the guard's other rules reject (Megatron's large-gradient check: False).
        tolerance: the relative difference between the first run's norm and the re-run's under which the result
            counts as reproduced (Megatron's gradient checks use 0.001).

    Raises:
        ValueError: no step guard is attached to ``optimizer``.

    Example (Megatron-LM's ``train_step``, shortened)::

        validation = RerunValidation(optimizer)            # after monitor.attach(chunks, optimizer)
        rerun_state_machine = get_rerun_state_machine()
        while rerun_state_machine.should_run_forward_backward(data_iterator):
            model.zero_grad_buffer(); optimizer.zero_grad()
            losses = forward_backward_func(...)
            validation.validate()                          # the reduced gradients, before the step
        should_checkpoint, should_exit, exit_code = rerun_state_machine.should_checkpoint_and_exit()
        ...
        update_successful, grad_norm, num_zeros = optimizer.step()   # the guard judges (and may skip) here
    """

    def __init__(self, optimizer: Any, *, fatal_nonfinite: bool = True, fatal_spike: bool = False,
                 tolerance: float = 0.001) -> None:
        guard = guard_on(optimizer)
        if guard is None:
            raise ValueError("RerunValidation needs the step guard on this optimizer: attach the monitor with "
                             "anomaly.guard.enabled: true to the Megatron optimizer first")
        self.step_guard: MegatronStepGuard = guard
        self.fatal_nonfinite = fatal_nonfinite
        self.fatal_spike = fatal_spike
        self.tolerance = tolerance

    def validate(self, rerun_state_machine: Any = None) -> None:
        """Judge the gradients as they are now and validate the global norm with ``rerun_state_machine`` (default:
        Megatron's ``get_rerun_state_machine()``). Call it inside the forward-backward loop, after the pass.

        One host read of the verdict (as Megatron's own checks read theirs). When trainmon's part fails it validates
        nothing (the fail-safe guard's usual warning); the state machine's own exceptions pass through.
        """
        guard = self.step_guard.guard
        found = guard.run(PART, self._judge) if not guard.off(PART) else None
        if found is None:
            return
        norm, reason = found
        if rerun_state_machine is None:
            from megatron.core.rerun_state_machine import get_rerun_state_machine

            rerun_state_machine = get_rerun_state_machine()
        rerun_state_machine.validate_result(result=norm, rejection_func=lambda _: reason == _NONFINITE,
                                            message=NONFINITE_MESSAGE, tolerance=self.tolerance,
                                            fatal=self.fatal_nonfinite)
        rerun_state_machine.validate_result(result=norm, rejection_func=lambda _: reason > _NONFINITE,
                                            message=SPIKE_MESSAGE, tolerance=self.tolerance, fatal=self.fatal_spike)

    def _judge(self) -> tuple[torch.Tensor, int]:
        """``(global norm, reason)`` of the gradients now: the norm a 0-d device tensor (what Megatron's default
        comparison reads), the reason an index into :data:`~trainmon.base.records.GUARD_REASONS` (0: none)."""
        verdict = self.step_guard.peek()
        reason = int(verdict[1].item())  # sync: the one host read of the validation
        return verdict[6], reason
