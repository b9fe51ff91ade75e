"""Config loading and validation: every mistake fails at construction with its dotted key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmon import MonitorConfig, TrainerMonitor, load_config
from trainmon.config_doc import config_reference
from trainmon.errors import ConfigError

BAD = [
    ({"step_intervall": 2}, "step_intervall"),
    ({"step_interval": 0}, "step_interval"),
    ({"step_interval": -3}, "step_interval"),
    ({"step_interval": 2.5}, "step_interval"),
    ({"step_interval": True}, "step_interval"),
    ({"start_step": -1}, "start_step"),
    ({"collect_times": 0}, "collect_times"),
    ({"sinks": ["csv", "wandb"]}, "sinks[1]"),
    ({"sinks": "csv"}, "sinks"),
    ({"sinks": ["csv", "csv"]}, "sinks"),
    ({"ranks": [0, -1]}, "ranks[1]"),
    ({"ranks": "all"}, "ranks"),
    ({"eps": -1e-8}, "eps"),
    ({"output_dir": 3}, "output_dir"),
    ({"run_name": "a/b"}, "run_name"),
    ({"activations": {"enabled": "yes"}}, "activations.enabled"),
    ({"activations": {"metrics": ["norm", "l1"]}}, "activations.metrics[1]"),
    ({"activations": {"metric": ["norm"]}}, "activations.metric"),
    ({"activations": []}, "activations"),
    ({"activations": {"grad_hooks": "tensors"}}, "activations.grad_hooks"),
    ({"weight_grads": {"metrics": ["nan"]}}, "weight_grads.metrics[0]"),
    ({"optimizer_states": {"states": ["exp_avg", "m"]}}, "optimizer_states.states[1]"),
    ({"params": {"enabled": 1}}, "params.enabled"),
    ({"targets": {"modules": ["re:(unclosed"]}}, "targets.modules[0]"),
    ({"targets": {"module": ["*"]}}, "targets.module"),
    ({"targets": {"params": [""]}}, "targets.params[0]"),
    ({"anomaly": {"actions": ["log", "email"]}}, "anomaly.actions[1]"),
    ({"anomaly": {"detectors": [{"type": "nonfinit"}]}}, "anomaly.detectors[0]"),
    ({"grad_probe": {"level": "L3"}}, "grad_probe.level"),
    ({"grad_probe": {"bounds": [1, 0]}}, "grad_probe.bounds"),
    ({"dump": {"mode": "everything"}}, "dump.mode"),
    ({"free_benchmark": {"pert_mode": "shake"}}, "free_benchmark.pert_mode"),
    ({"dynamic": {"poll_seconds": -1}}, "dynamic.poll_seconds"),
    ({"dynamic": {"watch": "true"}}, "dynamic.watch"),
    ({"flush_seconds": float("nan")}, "flush_seconds"),
]


@pytest.mark.parametrize(("config", "key"), BAD, ids=[k for _, k in BAD])
def test_bad_config_names_its_key(config, key):
    with pytest.raises(ConfigError) as info:
        TrainerMonitor(config)
    assert info.value.key.startswith(key), str(info.value)
    assert str(info.value).startswith(key)


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError, match="valid keys here: .*'step_interval'"):
        load_config({"step_intervall": 2})


def test_defaults_and_round_trip(tmp_path):
    config = load_config(None)
    assert config.weight_grads.enabled and not config.activations.enabled
    assert config.weight_grads.metrics == ["norm", "min", "max", "mean", "zeros", "nans", "infs"]
    again = load_config(config)
    assert again == config and again is not config
    assert isinstance(load_config(MonitorConfig(step_interval=3)), MonitorConfig)


def test_yaml_and_json_files(tmp_path):
    yaml_path = tmp_path / "monitor.yaml"
    yaml_path.write_text("step_interval: 5\nactivations:\n  enabled: true\n  metrics: [norm, max]\n")
    config = load_config(yaml_path)
    assert config.step_interval == 5 and config.activations.metrics == ["norm", "max"]
    json_path = tmp_path / "monitor.json"
    json_path.write_text(json.dumps({"sinks": ["csv"]}))
    assert load_config(str(json_path)).sinks == ["csv"]


@pytest.mark.parametrize(("name", "text", "match"), [
    ("broken.yaml", "step_interval: [1,\n", "cannot parse"),
    ("broken.json", "{", "cannot parse"),
    ("list.yaml", "- 1\n- 2\n", "top level must be a mapping"),
    ("monitor.toml", "x = 1", "must end in"),
])
def test_bad_files_name_the_file(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config("/nonexistent/monitor.yaml")


def test_reference_covers_every_field():
    text = config_reference()
    for key in ("step_interval", "per_micro_step", "poll_seconds", "sample_elements", "max_dumps"):
        assert f"`{key}`" in text


def test_docs_config_md_is_current():
    """docs/config.md is generated; regenerate it with ``python -m trainmon.config > docs/config.md``."""
    path = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert path.read_text() == config_reference() + "\n"
