"""DeepSpeed (ZeRO-1, one process): a NaN injected into one layer is localised and that layer dumped,
with the default families (activations off), as on plain torch."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.launch import ROOT, child_env, free_port

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "distributed" / "scripts" / "ds_actions_run.py"


def test_nan_in_one_layer_is_localised_and_dumped(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "1"], cwd=ROOT, capture_output=True, text=True,
                          env=child_env(MASTER_PORT=str(free_port())), timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["weights_finite"]  # DeepSpeed skipped the poisoned steps
    (found,) = info["localisations"]
    assert (found["anomaly_step"], found["step"], found["module"], found["kind"], found["dump_step"]) == (
        2, 3, "layers.1.fc2", "output", 4)
    rank_dir = tmp_path / "run" / "rank0"
    first = json.loads((rank_dir / "anomalies.jsonl").read_text().splitlines()[0])
    assert (first["step"], first["name"]) == (2, "loss")
    data = json.loads((rank_dir / "dump" / "step4" / "dump.json").read_text())["data"]
    assert set(data) == {"Module.layers.1.fc2.Linear.forward.0", "Module.layers.1.fc2.Linear.backward.0",
                         "Module.layers.1.fc2.Linear.parameters_grad"}
    forward = data["Module.layers.1.fc2.Linear.forward.0"]
    (reference,) = info["fc2_input"]  # float64 statistics of the layer's input, taken by the script's hook
    got = forward["input_args"][0]
    np.testing.assert_allclose([got["Max"], got["Min"], got["Mean"], got["Norm"]], reference, rtol=1e-5, atol=1e-7)
    assert np.isnan(forward["output"][0]["Max"])
