"""msprobe 26's L2 feature keys (``recording_l2_features``, ``l2_targets``, ``sa_order``) in the msprobe translation.

msprobe's rules (``msprobe/core/monitor/utils.py`` ``validate_l2_targets``/``validate_sa_order`` and
``msprobe/pytorch/monitor/module_hook.py`` ``_is_recording_module``, ``get_linear_hook_target``): the hooks are
``attention_hook`` and ``linear_hook``; names are ``"{chunk}:"`` + the (squashed) module name; an empty
``attention_hook`` list collects nothing, an empty ``linear_hook`` list takes every module with a 2-D ``weight`` (or
``wg``) that is not an embedding; ``sa_order`` is ``s,b,h,d`` (default) or ``b,s,h,d``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from trainmon.base.targets import select
from trainmon.config import load_config
from trainmon.config.msprobe import translate_msprobe
from trainmon.errors import ConfigError


def _translate(tmp_path: Path, data: dict[str, Any]) -> dict[str, Any]:
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps(data))
    return translate_msprobe(path)


MODULES = ["module.decoder.layers.0.self_attention.core_attention", "module.decoder.layers.0.mlp.linear_fc1",
           "module.decoder.layers.1.self_attention.core_attention", "module.embedding.word_embeddings"]
PARAMS = ["module.decoder.layers.0.mlp.linear_fc1.weight", "module.decoder.layers.0.mlp.linear_fc1.bias",
          "module.decoder.layers.1.mlp.linear_fc1.weight", "module.embedding.word_embeddings.weight"]


def test_l2_features_map_to_attention_and_weights(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "trainmon")
    out = _translate(tmp_path, {"recording_l2_features": True, "sa_order": "b, s, h, d", "l2_targets": {
        "attention_hook": ["0:0.self_attention.core_attention"], "linear_hook": ["0:0.mlp.linear_fc1"]}})
    attention = out["features"]["attention"]
    assert (attention["enabled"], attention["inputs"], attention["causal"]) == (True, "bshd", True)
    assert select(MODULES, attention["modules"], "m") == [MODULES[0]]  # by its squashed name, chunk 0
    weights = out["features"]["weights"]
    assert weights["enabled"] and not weights["embeddings"]
    assert select(PARAMS, weights["params"], "p") == [PARAMS[0]]
    config = load_config(out)
    assert config.features.attention.enabled and config.features.weights.enabled
    assert "l2_targets.attention_hook is honoured with a difference" in caplog.text
    assert "l2_targets.linear_hook is honoured with a difference" in caplog.text and "||W||_F / sigma_1" in caplog.text


def test_empty_hook_lists_mean_what_they_mean_in_msprobe(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = _translate(tmp_path, {"recording_l2_features": True,
                                "l2_targets": {"attention_hook": [], "linear_hook": []}})
    assert "attention" not in out["features"]  # msprobe: an empty attention_hook collects nothing
    weights = out["features"]["weights"]  # every 2-D weight (or wg), no embedding
    assert select(PARAMS, weights["params"], "p") == [PARAMS[0], PARAMS[2], PARAMS[3]]
    assert weights["embeddings"] is False
    assert load_config(out).features.weights.enabled
    default = _translate(tmp_path, {"recording_l2_features": True, "l2_targets": {"attention_hook": ["0:x"]}})
    assert default["features"]["attention"]["inputs"] == "sbhd"  # msprobe's default sa_order


def test_l2_keys_without_the_switch_are_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "trainmon")
    out = _translate(tmp_path, {"l2_targets": {"attention_hook": ["0:x"]}, "sa_order": "s,b,h,d"})
    assert "features" not in out
    assert caplog.text.count("acts only with recording_l2_features: true") == 2


@pytest.mark.parametrize(("data", "match"), [
    ({"l2_targets": {"router_hook": []}}, r"msprobe key l2_targets.router_hook: must be one of"),
    ({"l2_targets": {"linear_hook": "0:fc"}}, r"msprobe key l2_targets.linear_hook: must be a list of module names"),
    ({"sa_order": "h,s,b,d"}, r"msprobe key sa_order: must be one of"),
    ({"l2_targets": []}, r"msprobe key l2_targets: must be a JSON object"),
])
def test_values_msprobe_rejects_are_rejected(tmp_path: Path, data: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _translate(tmp_path, data)
