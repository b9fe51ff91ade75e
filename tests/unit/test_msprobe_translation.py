"""The msprobe config translation (``trainmon.config.msprobe``) against msprobe's own rules.

``msprobe_squash`` and ``msprobe_selection`` below restate msprobe 1.2.1's source (the
``mindstudio-probe`` 1.2.1 wheel; the newest, 26.2.0, has the same rules): they are the reference
the translation's patterns are checked against, here on generated names and in
tests/integration/test_msprobe_configs.py on every published config.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmon.base.targets import select
from trainmon.config import load_config
from trainmon.config.msprobe import read_msprobe, translate_msprobe
from trainmon.config.msprobe_names import module_pattern, param_pattern, squash_name, trainmon_row_name
from trainmon.errors import ConfigError, TargetError


def msprobe_squash(param_name: str, enable: bool = True) -> str:
    """msprobe/pytorch/monitor/module_metric.py ``squash_param_name`` (1.2.1 wheel), verbatim."""
    if not enable:
        return param_name
    name = ''
    for pattern in [r'layers?\.(.*)', r'embeddings?\.(.*)', 'final.*', 'output.*', 'norm.*']:
        match = re.findall(pattern, param_name)
        if match:
            name += match[0]
            break
    if name == '':
        name = param_name
    return name


def msprobe_selection(config: dict[str, Any], module_names: list[str], param_names: list[str]
                      ) -> tuple[set[str], set[str]]:
    """``(modules, parameters)`` msprobe 1.2.1 hooks for ``config`` on a one-chunk model.

    - ``utils.py validate_config``: no (or empty) targets is ``{"": {}}``, and with
      ``xy_distribution`` it sets ``all_xy``.
    - ``module_hook.py _register_chunk/_is_target_param`` (before ``hook_modules`` prefixes the
      keys): a parameter is a target when ``name``, ``"0:" + squashed name`` or ``"0:" + name``
      starts with a key.
    - ``hook_modules`` prefixes keys without ``":"`` with ``"0:"``; ``_is_target_module``: every
      module (the root ``""`` included) under ``all_xy`` or ``print_struct``, else a module whose
      ``"0:" + squashed name`` or ``"0:" + name`` is a key; hooked only with ``xy_distribution`` or
      ``print_struct``.
    """
    targets = dict(config.get("targets") or {})
    all_xy = config.get("all_xy", False)
    if not targets:
        all_xy = all_xy or config.get("xy_distribution", False)
        targets = {"": {}}
    squash = config.get("squash_name", True)
    params = {p for p in param_names if any(p.startswith(t) or ("0:" + msprobe_squash(p, squash)).startswith(t)
                                            or ("0:" + p).startswith(t) for t in targets)}
    keys = {key if ":" in key else "0:" + key for key in targets}
    modules: set[str] = set()
    if config.get("xy_distribution") or config.get("print_struct"):
        modules = {n for n in module_names if all_xy or config.get("print_struct")
                   or "0:" + msprobe_squash(n, squash) in keys or "0:" + n in keys}
    return modules, params


_TOKENS = st.sampled_from(["layers", "layer", "layers2", "embedding", "embeddings", "final", "final_norm",
                           "output", "output_layer", "norm", "ln", "mlp", "fc1", "0", "1", "10", "attn",
                           "weight", "bias", "xlayers", "word_embeddings"])
_NAMES = st.lists(_TOKENS, min_size=1, max_size=6).map(".".join)


@settings(max_examples=400, deadline=None)
@given(_NAMES)
def test_squash_name_is_msprobes(name: str) -> None:
    assert squash_name(name) == msprobe_squash(name)


@settings(max_examples=300, deadline=None)
@given(st.lists(_NAMES, min_size=1, max_size=8, unique=True), _NAMES, st.booleans(), st.booleans())
def test_target_patterns_select_what_msprobe_selects(names: list[str], key_source: str, prefixed: bool,
                                                     squash: bool) -> None:
    """Keys are real names, squashed names and prefixes of either, with or without ``0:``."""
    candidates = {key_source, msprobe_squash(key_source), key_source[: len(key_source) // 2],
                  msprobe_squash(key_source)[:3]}
    for key in candidates:
        key = f"0:{key}" if prefixed else key
        config = {"targets": {key: {}}, "xy_distribution": True, "squash_name": squash}
        modules, params = msprobe_selection(config, names, names)
        plain = key[2:] if prefixed else key
        mine_params = set(select(names, [param_pattern(plain, squash and prefixed)], "p")) \
            if not "0:".startswith(key) else set(names)
        assert mine_params == params, key
        if plain:
            assert set(select(names, [module_pattern(plain, squash)], "m")) == modules, key


def _translate(tmp_path: Path, data: dict[str, Any], **environ: str) -> dict[str, Any]:
    path = tmp_path / "msprobe.json"
    path.write_text(json.dumps(data))
    out = translate_msprobe(path, environ)
    load_config(out)  # every translation is a valid trainmon config
    return out


def test_whole_model_target_and_missing_targets(tmp_path: Path) -> None:
    out = _translate(tmp_path, {"targets": {"": {}}, "wg_distribution": True})
    assert out["targets"]["params"] == ["*"] and out["weight_grads"]["enabled"]
    out = _translate(tmp_path, {"targets": {"": {}}, "xy_distribution": True})  # msprobe: the root module alone
    assert out["targets"]["modules"] == [] and out["activations"]["root"]
    out = _translate(tmp_path, {"xy_distribution": True})  # no targets: every module (the root too), every parameter
    assert out["targets"] == {"modules": ["optional:*"], "params": ["*"]} and out["activations"]["root"]
    out = _translate(tmp_path, {"targets": {}, "xy_distribution": True, "mv_distribution": True})
    assert out["targets"] == {"modules": ["optional:*"], "params": ["*"]}
    assert out["optimizer_states"] == {"enabled": True, "states": ["exp_avg", "exp_avg_sq"], "metrics": ["norm"]}


def test_all_xy_monitors_every_module_not_inputs(tmp_path: Path) -> None:
    out = _translate(tmp_path, {"targets": {"layers.0": {}}, "xy_distribution": True, "all_xy": True})
    assert out["targets"]["modules"] == ["optional:*"] and "inputs" not in out["activations"]
    assert out["activations"]["root"]  # msprobe hooks every module of named_modules(), the root ("") too
    out = _translate(tmp_path, {"targets": {"layers.0": {}}, "all_xy": True})  # all_xy needs xy_distribution
    assert not out["activations"]["enabled"]


def test_parameter_targets_are_prefixes_and_never_break_attach(tmp_path: Path) -> None:
    out = _translate(tmp_path, {"targets": {"layers.1": {}, "head.weight": {}}, "xy_distribution": True,
                                "wg_distribution": True})
    names = ["layers.1", "layers.1.fc", "layers.10", "head"]
    params = ["layers.1.fc.weight", "layers.10.fc.weight", "head.weight", "head.bias"]
    assert select(params, out["targets"]["params"], "targets.params") == ["layers.1.fc.weight",
                                                                          "layers.10.fc.weight", "head.weight"]
    assert select(names, out["targets"]["modules"], "targets.modules") == ["layers.1"]


def test_tuple_specs_are_read_and_name_trainmon_rows(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _translate(tmp_path, {"targets": {"layers.0": {"input": "tuple[2]:1", "output": "tensor",
                                                   "input_grad": "tuple[2]:0", "output_grad": "tuple[1]:0"}},
                          "xy_distribution": True})
    assert "not honoured" not in caplog.text
    assert trainmon_row_name("layers.0", "input", "tuple[2]:1") == "layers.0.input.1"
    assert trainmon_row_name("layers.0", "output_grad", "tuple[1]:0") == "layers.0.output_grad"
    _translate(tmp_path, {"targets": {"layers.0": {"input": "list[2]"}}, "xy_distribution": True})
    assert "targets.layers.0.input is not honoured" in caplog.text


def test_alert_dump_writes_events_and_the_rule_watches_every_row(tmp_path: Path) -> None:
    out = _translate(tmp_path, {"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.3}}],
                                          "dump": True},
                                "xy_distribution": True, "wg_distribution": True, "mv_distribution": True,
                                "param_distribution": True, "mg_direction": True, "ops": ["norm", "max"]})
    assert out["anomaly"]["actions"] == ["log", "jsonl"] and "dump" not in out
    (spike,) = [d for d in out["anomaly"]["detectors"] if d["type"] == "spike"]
    assert spike["method"] == "relative" and spike["threshold"] == 0.3
    families = ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param", "exp_avg", "exp_avg_sq")
    assert set(spike["series"]) == {f"{f}/*/{m}" for f in families for m in ("norm", "max")} | {
        "grad_probe/*/mg_direction"}
    out = _translate(tmp_path, {"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]},
                                "wg_distribution": True})
    assert out["anomaly"]["actions"] == ["log"]


def test_output_dir_is_msprobes(tmp_path: Path) -> None:
    assert _translate(tmp_path, {})["output_dir"] == "./monitor_output"
    assert _translate(tmp_path, {}, MONITOR_OUTPUT_DIR="/data/mon")["output_dir"] == "/data/mon"


def test_format_tensorboard_keeps_msprobes_tag_per_tensor(tmp_path: Path) -> None:
    """msprobe's TensorBoard output has a tag per tensor and op (``0:{name}/rank{R}/{tag}_{op}``): a config that asks
    for it gets trainmon's per-tensor tags beside the overview; without ``format`` (trainmon writes both CSV and
    TensorBoard) and with ``csv`` the TensorBoard output stays the bounded overview."""
    assert _translate(tmp_path, {"format": "tensorboard"})["tensorboard"] == {"per_tensor": True}
    assert load_config(_translate(tmp_path, {"format": "tensorboard"})).sinks == ["tensorboard"]
    assert "tensorboard" not in _translate(tmp_path, {"format": "csv"})
    assert "tensorboard" not in _translate(tmp_path, {})


def test_mg_direction_mbs_grad_and_schedule(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = _translate(tmp_path, {"mg_direction": True, "wg_distribution": True, "monitor_mbs_grad": True,
                                "module_ranks": [1, 1, 3], "collect_times": 5, "start_step": 2, "step_interval": 3,
                                "ops": ["id", "min"], "eps": 1e-6})
    assert out["grad_probe"] == {"enabled": True, "level": "L0", "mg_direction": True, "scalars": "param"}
    assert out["weight_grads"]["per_micro_step"] and out["weight_grads"]["metrics"] == ["min"]
    assert (out["ranks"], out["collect_times"], out["start_step"], out["step_interval"], out["eps"]) == (
        [1, 3], 5, 2, 3, 1e-6)
    assert out["absent_ranks"] == "skip"  # msprobe runs on the listed ranks the job has
    assert "monitor_mbs_grad" not in caplog.text  # honoured: no warning
    assert _translate(tmp_path, {"collect_times": 0})["enabled"] is False
    assert _translate(tmp_path, {"ops": ["id"]})["params"]["metrics"] == ["norm"]  # msprobe's default op


def test_warnings_are_accurate_and_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "trainmon")
    _translate(tmp_path, {"ur_distribution": True, "ndigits": 12, "step_count_per_record": 2, "switch": False,
                          "stack_info": True, "recording_l2_features": True, "no_such_key": 1,
                          "format": "api", "squash_name": True})
    text = caplog.text
    assert "ur_distribution is honoured with a difference" in text and "family update" in text
    assert "unavailable" not in text
    for key in ("ndigits", "step_count_per_record", "switch", "stack_info", "recording_l2_features", "no_such_key"):
        assert text.count(f"key {key} ") == 1, key
    assert "format is honoured with a difference" in text


@pytest.mark.parametrize(("data", "match"), [
    ({"targets": {"a": []}}, r"msprobe key targets.a: must be a JSON object"),
    ({"xy_distribution": "yes"}, "msprobe key xy_distribution: must be true or false"),
    ({"squash_name": 1}, "msprobe key squash_name"),
    ({"step_count_per_record": 1.5}, "msprobe key step_count_per_record: must be an integer"),
    ({"alert": {"dump": "yes"}}, "msprobe key alert.dump"),
    ({"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": -1}}]}}, "threshold"),
])
def test_values_msprobe_rejects_are_errors(tmp_path: Path, data: dict[str, Any], match: str) -> None:
    path = tmp_path / "msprobe.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=match):
        translate_msprobe(path)


def test_communication_call_sites_and_cc_log_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = _translate(tmp_path, {"cc_distribution": {"enable": True, "cc_codeline": ["train.py[12]"],
                                                    "cc_pre_hook": True, "cc_log_only": True}})
    assert out["communication"]["enabled"] and out["communication"]["call_site_filter"] == r"train\.py:12 "
    assert "cc_log_only is not honoured" in caplog.text and "cc_pre_hook" not in caplog.text
    assert "communication" not in _translate(tmp_path, {"cc_distribution": {"enable": False}})


def test_chunk_prefixes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = _translate(tmp_path, {"targets": {"0:3.mlp": {}, "1:4.mlp": {}}, "xy_distribution": True,
                                "wg_distribution": True})
    modules = ["model.layers.3.mlp", "model.layers.4.mlp", "model.layers.3.mlp.fc"]
    assert select(modules, out["targets"]["modules"], "m") == ["model.layers.3.mlp", "model.layers.4.mlp"]
    params = ["model.layers.3.mlp.fc.weight", "model.layers.4.mlp.fc.bias", "model.layers.5.mlp.fc.bias"]
    assert select(params, out["targets"]["params"], "p") == params[:2]
    assert caplog.text.count("'1:4.mlp': trainmon applies a target to every virtual-pipeline chunk") == 1
    assert "'0:3.mlp'" not in caplog.text


def test_errors_and_messages_name_msprobes_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "msprobe.json"
    path.write_text(json.dumps({"targets": {"layers.0": {}, "0:head": {}}, "xy_distribution": True,
                                "wg_distribution": True, "module_ranks": [1]}))
    out, keys = read_msprobe(path)
    assert (keys.msprobe_key("ranks"), keys.msprobe_key("ranks[0]")) == ("module_ranks", "module_ranks[0]")
    assert keys.msprobe_key("targets.modules[1]") == "targets.0:head"
    assert keys.msprobe_key("targets.params[0]") == "targets.layers.0" and keys.msprobe_key("async_results") is None
    error = keys.reword(TargetError("targets.modules[1]", "why"))
    assert isinstance(error, TargetError) and str(error) == f"{path}: msprobe key targets.0:head: why"
    assert str(keys.reword(ConfigError("async_results", "why"))) == (
        f"{path}: async_results (of the trainmon config translated from it): why")
    # the translated patterns are shown as the keys were written, never as their regex
    select(["a"], out["targets"]["modules"], "targets.modules")
    assert "no name matches ['layers.0', '0:head']" in caplog.text
    with pytest.raises(TargetError, match=r"^targets.modules\[1\]: pattern '0:head' matches nothing"):
        select(["layers.0"], [p.removeprefix("optional:") for p in out["targets"]["modules"]], "targets.modules")
    # a key is reported when it selects no module and no parameter
    assert keys.unmatched_targets(["", "layers.0"], ["layers.0.fc.weight"]) == ["0:head"]
    assert keys.unmatched_targets(["", "head"], ["layers.0.fc.weight"]) == []


def test_module_ranks_skip_absent_ranks_and_ignore_negative_ones(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    out = _translate(tmp_path, {"module_ranks": [-1, 0, 0, 5], "wg_distribution": True})
    assert (out["ranks"], out["absent_ranks"]) == ([0, 5], "skip")
    assert "module_ranks: ranks [-1] exist in no job; ignored, as msprobe ignores them" in caplog.text
    assert "ranks" not in _translate(tmp_path, {"module_ranks": []})  # msprobe: every rank
    with pytest.raises(ConfigError, match="msprobe key module_ranks: lists no rank that can exist"):
        _translate(tmp_path, {"module_ranks": [-2]})
