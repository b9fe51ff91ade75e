"""The training loss where a trainer does not hand it to callbacks: read from the model's outputs."""

from __future__ import annotations

from typing import Any

import torch


def output_loss(output: Any) -> torch.Tensor | None:
    """The ``loss`` of a model output (a ``ModelOutput``, a dict, or an object with ``.loss``), if any."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None

