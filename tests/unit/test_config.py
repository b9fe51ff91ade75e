"""Config loading and validation: every mistake fails at construction with its dotted key."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainmon import MonitorConfig, TrainerMonitor, load_config
from trainmon.base.targets import select
from trainmon.config import check_ranks, config_reference
from trainmon.config.msprobe import translate_msprobe
from trainmon.errors import ConfigError, TargetError

BAD = [
    ({"step_intervall": 2}, "step_intervall"),
    ({"step_interval": 0}, "step_interval"),
    ({"step_interval": -3}, "step_interval"),
    ({"step_interval": 2.5}, "step_interval"),
    ({"step_interval": True}, "step_interval"),
    ({"start_step": -1}, "start_step"),
    ({"async_results": "yes"}, "async_results"),
    ({"activations": {"group_mb": -1}}, "activations.group_mb"),
    ({"activations": {"group_mb": "big"}}, "activations.group_mb"),
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
    ({"free_benchmark": {"targets": ["re:("]}}, "free_benchmark.targets[0]"),
    ({"free_benchmark": {"targets": ["ok", ""]}}, "free_benchmark.targets[1]"),
    ({"ranks": [0, 1, 0]}, "ranks[2]"),
    ({"ranks": []}, "ranks"),
    ({"dump": {"depth": 10**9}}, "dump.depth"),
    ({"dump": {"depth": 65}}, "dump.depth"),
    ({"start_step": 2**63}, "start_step"),
    ({"collect_times": 10**5000}, "collect_times"),
    ({"output_dir": "out\0put"}, "output_dir"),
    ({"run_name": "r" * 256}, "run_name"),
    ({"run_name": "a\\b"}, "run_name"),
    ({"dynamic": {"poll_seconds": 1e400}}, "dynamic.poll_seconds"),
    ({"anomaly": {"detectors": [{"type": "spike", "alpha": 2.0}]}}, "anomaly.detectors[0].alpha"),
    ({"anomaly": {"detectors": [{"type": "spike", "method": "mad", "window": 10**9}]}}, "anomaly.detectors[0].window"),
    ({"anomaly": {"detectors": [{"type": "loss_spike", "level_window": 10**9}]}},
     "anomaly.detectors[0].level_window"),
    ({"anomaly": {"detectors": [{"type": "spike", "series": ["re:("]}]}}, "anomaly.detectors[0].series"),
    ({"anomaly": {"detectors": [{"type": {"spike": 1}}]}}, "anomaly.detectors[0].type"),
    ({"anomaly": {"detectors": [{"type": ["spike"]}]}}, "anomaly.detectors[0].type"),
    ({"anomaly": {"guard": {"enabled": "yes"}}}, "anomaly.guard.enabled"),
    ({"anomaly": {"guard": {"warmup": 200}}}, "anomaly.guard.warmup"),
    ({"anomaly": {"guard": {"window": 1}}}, "anomaly.guard.window"),
    ({"anomaly": {"guard": {"z_threshold": 0}}}, "anomaly.guard.z_threshold"),
    ({"anomaly": {"guard": {"max_grad_norm": -1.0}}}, "anomaly.guard.max_grad_norm"),
    ({"anomaly": {"guard": {"escalate": ["raise", "email"]}}}, "anomaly.guard.escalate[1]"),
    ({"anomaly": {"guard": {"enabled": True, "escalate": ["dump"]}}}, "anomaly.guard.escalate"),
    ({"anomaly": {"guard": {"escalate_after": 0}}}, "anomaly.guard.escalate_after"),
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


@pytest.mark.parametrize(("name", "text", "key"), [
    ("dup.yaml", "step_interval: 2\nsinks: [csv]\nstep_interval: 3\n", "step_interval"),
    ("dup.yaml", "anomaly:\n  actions: [log]\n  log_limit: 3\n  actions: [jsonl]\n", "anomaly.actions"),
    ("dup.yaml", "anomaly:\n  detectors:\n    - {type: spike, threshold: 3, threshold: 4}\n",
     "anomaly.detectors[0].threshold"),
    ("dup.json", '{"step_interval": 2, "step_interval": 3}', "step_interval"),
    ("dup.json", '{"dump": {"enabled": true, "depth": 1, "depth": 2}}', "dump.depth"),
    ("dup.json", '{"anomaly": {"detectors": [{"type": "nonfinite"}, {"type": "spike", "type": "x"}]}}',
     "anomaly.detectors[1].type"),
])
def test_duplicate_keys_are_an_error_naming_the_dotted_key(tmp_path, name, text, key):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match="repeated") as info:
        load_config(path)
    assert info.value.key == key and str(path) in str(info.value)


def test_yaml_merge_keys_and_aliases_are_not_duplicates(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("activations: &a {enabled: true, metrics: [norm]}\nparams:\n  <<: *a\n  metrics: [max]\n")
    config = load_config(path)  # an explicit key overrides a merged one: not a repeated key
    assert config.params.enabled and config.params.metrics == ["max"]
    path.write_text("anomaly:\n  detectors:\n    - &d {type: nonfinite}\n    - *d\n")
    assert len(load_config(path).anomaly.detectors) == 2


def test_yaml_alias_bomb_fails_fast(tmp_path):
    """A "billion laughs" document (9**6 strings through aliases) is rejected without expanding it."""
    levels = ["&l0 [x, x, x, x, x, x, x, x, x]"] + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 6)]
    path = tmp_path / "bomb.yaml"
    path.write_text(f"sinks: [{', '.join(levels)}]\n")
    with pytest.raises(ConfigError, match="must be a string") as info:
        load_config(path)
    assert info.value.key == "sinks[0]"
    path.write_text("sinks: &a [*a]\n")  # a list that contains itself
    with pytest.raises(ConfigError, match="must be a string") as info:
        load_config(path)
    assert info.value.key == "sinks[0]"


@pytest.mark.parametrize(("name", "data", "match"), [
    ("latin1.yaml", "run_name: caf\xe9\n".encode("latin-1"), "not UTF-8"),
    ("utf16.json", '{"step_interval": 2}'.encode("utf-16"), "not UTF-8"),
    ("deep.json", b"[" * 100_000, "nested too deeply"),
    ("deep.yaml", b"[" * 100_000, "nested too deeply|cannot parse"),
    ("deep_map.yaml", b"{a: " * 100_000, "nested too deeply|cannot parse"),
    ("nul.yaml", b"step_interval: 2\x00\n", "cannot parse"),
    ("tag.yaml", b"run_name: !!python/object:os.system [ls]\n", "cannot parse"),
    ("unhashable.yaml", b"? [a, b]\n: 1\n", "cannot parse"),
])
def test_undecodable_deep_and_hostile_files_name_the_file(tmp_path, name, data, match):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=match) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"step_interval": 4}).encode())
    assert load_config(path).step_interval == 4


def test_a_directory_or_named_pipe_is_refused_without_waiting(tmp_path):
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ConfigError, match="cannot read config file: a directory") as info:
        load_config(tmp_path / "dir.yaml")
    assert str(tmp_path / "dir.yaml") in str(info.value)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo.yaml")
        with pytest.raises(ConfigError, match="a named pipe"):
            load_config(tmp_path / "fifo.yaml")


def test_check_ranks_against_the_world_size():
    check_ranks(None, 1)
    check_ranks([0, 3], 4)
    with pytest.raises(ConfigError, match=r"rank 4 does not exist: this job has 4 ranks \(0..3\)") as info:
        check_ranks([0, 4], 4)
    assert info.value.key == "ranks"
    with pytest.raises(ConfigError, match="ranks 1, 2 do not exist: this job has 1 rank "):
        check_ranks([1, 2], 1)


def test_check_ranks_skips_absent_ranks_when_asked(caplog: pytest.LogCaptureFixture) -> None:
    assert check_ranks([3, 0, 1], 2, "skip") == [0, 1]  # the listed ranks that exist, in the config's order
    assert "ranks (msprobe: module_ranks): rank 3 does not exist: this job has 2 ranks (0..1); " \
           "collecting on ranks 0, 1 only (absent_ranks: skip)" in caplog.text
    assert check_ranks([0, 1], 2, "skip") == [0, 1] and check_ranks(None, 2, "skip") is None
    with pytest.raises(ConfigError, match=r"ranks 2, 3 do not exist: .*; list a rank below 2") as info:
        check_ranks([2, 3], 2, "skip")  # none exists: nothing would be monitored anywhere
    assert info.value.key == "ranks"


def test_select_reports_a_bad_regex_with_its_key():
    with pytest.raises(TargetError, match="invalid regex") as info:
        select(["a", "b"], ["a", "re:("], "free_benchmark.targets")
    assert info.value.key == "free_benchmark.targets[1]"


@pytest.mark.parametrize(("data", "match"), [
    ({"ops": "norm"}, "msprobe key ops: must be a list of strings"),
    ({"module_ranks": 3}, "msprobe key module_ranks: must be a list of integers"),
    ({"module_ranks": [0, "1"]}, "msprobe key module_ranks"),
    ({"targets": ["a"]}, "msprobe key targets: must be a JSON object"),
    ({"format": ["csv"]}, "msprobe key format: must be a string"),
    ({"cc_distribution": 3}, "msprobe key cc_distribution"),
    ({"cc_distribution": {"enable": True, "cc_codeline": "x.py[3]"}}, "cc_distribution.cc_codeline"),
    ({"alert": {"rules": {"rule_name": "AnomalyTurbulence"}}}, "alert.rules"),
    ({"alert": {"rules": ["AnomalyTurbulence"]}}, "alert.rules"),
    ({"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": "0.5"}}]}},
     r"alert.rules\[0\].args.threshold"),
])
def test_msprobe_config_of_the_wrong_shape_names_file_and_key(tmp_path, data, match):
    path = tmp_path / "msprobe.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=match) as info:
        translate_msprobe(path)
    assert str(path) in str(info.value)


def test_msprobe_config_undecodable_or_repeated_key(tmp_path):
    path = tmp_path / "msprobe.json"
    path.write_bytes(b'{"targets": {"caf\xe9": {}}}')
    with pytest.raises(ConfigError, match="not UTF-8") as info:
        translate_msprobe(path)
    assert str(path) in str(info.value)
    path.write_text('{"wg_distribution": true, "wg_distribution": false}')
    with pytest.raises(ConfigError, match="repeated") as info:
        translate_msprobe(path)
    assert info.value.key == "wg_distribution"


def _nested(levels: int, mapping: bool) -> object:
    root: object = {} if mapping else []
    node = root
    for _ in range(levels):
        child: object = {} if mapping else []
        if mapping:
            node["a"] = child  # type: ignore[index]
        else:
            node.append(child)  # type: ignore[union-attr]
        node = child
    return root


@pytest.mark.parametrize("config", [
    {"anomaly": {"detectors": [_nested(100_000, False)]}},
    {"anomaly": {"detectors": [{"type": _nested(100_000, True)}]}},
    {"anomaly": {"detectors": [{"type": "spike", "series": _nested(100_000, False)}]}},
    {"sinks": _nested(100_000, False)},
    {"run_name": _nested(100_000, True)},
])
def test_deeply_nested_dict_values_are_a_config_error(config):
    with pytest.raises(ConfigError):
        load_config(config)
