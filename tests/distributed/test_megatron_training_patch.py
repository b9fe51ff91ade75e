"""The Megatron-LM patch of docs/megatron.md, driven with megatron-core in training.py's structure (PP=2 on two
CPU processes, scripts/mcore_training_patch.py): trainmon's ``grad_norm`` is the grad norm ``train_step``
returned from Megatron's ``optimizer.step()``, its ``loss`` the ``lm loss`` of ``loss_dict`` (last stage only),
and steps are numbered from ``args.iteration``. Also checks that the docs show the patch the script applies."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("megatron.core")

from tests.launch import child_env, torchrun

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "mcore_training_patch.py"


def test_grad_norm_and_loss_are_those_train_step_returned(tmp_path: Path) -> None:
    config = tmp_path / "monitor.yaml"
    config.write_text(f"output_dir: {tmp_path}\nrun_name: run\nsinks: [csv]\n")
    proc = subprocess.run(torchrun(SCRIPT, tmp_path), env=child_env(TRAINMON_CONFIG=str(config)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for rank in (0, 1):
        returned = json.loads((tmp_path / f"returned_rank{rank}.json").read_text())
        scalars = pd.read_csv(tmp_path / "run" / f"rank{rank}" / "scalars.csv")
        values = scalars.pivot(index="step", columns="name", values="value")
        assert sorted(values.index) == sorted(int(step) for step in returned) == [5, 6, 7]
        for step, megatron in returned.items():
            assert megatron["grad_norm"] is not None and megatron["skipped_iter"] == 0
            assert values.loc[int(step), "grad_norm"] == pytest.approx(megatron["grad_norm"], rel=1e-6)
            if rank == 1:  # the last pipeline stage
                assert values.loc[int(step), "loss"] == pytest.approx(megatron["lm loss"], rel=1e-6)
        if rank == 0:
            assert "loss" not in set(scalars.name)
        # clipping is on (clip_grad=1.0): the norm is Megatron's pre-clip one, above the threshold here
        assert max(megatron["grad_norm"] for megatron in returned.values()) > 1.0


def test_docs_show_the_patch_the_script_applies() -> None:
    """The lines docs/megatron.md adds to training.py are those scripts/mcore_training_patch.py runs."""
    docs = (ROOT / "docs" / "megatron.md").read_text()
    script = SCRIPT.read_text()
    for line in ('monitor = TrainerMonitor(os.environ.get("TRAINMON_CONFIG", "monitor.yaml"))',
                 "monitor.attach(model, optimizer, grad_acc_steps=get_num_microbatches(), start_step=",
                 'monitor.step(loss=loss_dict.get("lm loss"))', "monitor.close()"):
        assert f"+{' ' * 4}" in docs and line in docs, line
        assert line in script, line


def test_a_bare_optimizer_without_clipping_writes_no_grad_norm() -> None:
    """Megatron's MixedPrecisionOptimizer returns grad norm 0.0 when ``clip_grad`` is 0 (it computes none): not a
    norm to write. The ChainedOptimizer of get_megatron_optimizer computes it always. (Stand-ins for the optimizer
    objects: only their ``config`` and ``chained_optimizers`` are read.)"""
    from types import SimpleNamespace

    from megatron.core.optimizer import OptimizerConfig

    from trainmon.integrations.megatron import _computes_grad_norm

    bare = SimpleNamespace(config=OptimizerConfig(clip_grad=0.0))
    assert not _computes_grad_norm(bare)
    assert _computes_grad_norm(SimpleNamespace(config=OptimizerConfig(clip_grad=1.0)))
    assert _computes_grad_norm(SimpleNamespace(config=OptimizerConfig(clip_grad=0.0), chained_optimizers=[bare]))
