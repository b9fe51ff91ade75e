"""Translate a msprobe monitor JSON config into a trainmon config dict (framework-free).

Every key of msprobe 1.2.1's and of the newest msprobe's (26.x) PyTorch monitor config is read
with msprobe's meaning, or warned about once with the reason. The semantics are msprobe's own
(``msprobe/pytorch/monitor/module_hook.py``, ``utils.py``, ``anomaly_detect.py`` of the
``mindstudio-probe`` wheel); docs/msprobe.md has the key-by-key table. In short:

- ``targets`` keys select **modules** by exact name (``xy_distribution``) and **parameters** by
  name prefix (every other family); ``""`` is the whole model, a missing or empty ``targets`` too
  (with ``xy_distribution`` then meaning every module). msprobe also accepts its *squashed*
  names (:func:`squash_name`, the names of its ``module_struct.json``) and a ``"{chunk}:"`` prefix.
  Each key becomes an ``optional:re:`` pattern: msprobe skips a key that names nothing.
- ``all_xy`` monitors every module, the root module too (``activations.root``); ``module_ranks`` may name
  ranks the job does not have (``absent_ranks: skip``); ``alert.dump`` writes the anomaly events (``anomalies.jsonl``,
  msprobe's ``anomaly.json``), not tensors; ``AnomalyTurbulence`` watches every monitored row.

msprobe's names (squashed names, target patterns, rows of target specs) live in
:mod:`trainmon.config.msprobe_names`, the value types it accepts in :mod:`trainmon.config.msprobe_checks`, its
``targets`` keys become patterns in :mod:`trainmon.config.msprobe_targets`, its ``alert`` an ``anomaly`` section in
:mod:`trainmon.config.msprobe_alert`, and the keys not honoured are warned about by
:mod:`trainmon.config.msprobe_notes`. This module reads a config and translates it key by key, recording which
msprobe key each trainmon key comes from (:class:`~trainmon.config.msprobe_checks.MsprobeKeys`) so that later errors
name msprobe's keys.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainmon.config.files import parse_json, read_text
from trainmon.config.msprobe_alert import translate_alert
from trainmon.config.msprobe_checks import MsprobeKeys, check_types
from trainmon.config.msprobe_notes import MsprobeNotes
from trainmon.config.msprobe_targets import MsprobeTargets
from trainmon.errors import ConfigError

__all__ = ["DEFAULT_OUTPUT_DIR", "OUTPUT_DIR_VARIABLE", "read_msprobe", "translate_msprobe"]

DEFAULT_OUTPUT_DIR = "./monitor_output"
"""msprobe's output folder when ``MONITOR_OUTPUT_DIR`` is not set."""
OUTPUT_DIR_VARIABLE = "MONITOR_OUTPUT_DIR"

_OPS = ("norm", "min", "max", "mean", "zeros", "nans")
_SAME_KEYS = ("start_step", "step_interval", "collect_times", "eps", "print_struct")
_KEY_OF_SECTION = {"ranks": "module_ranks", "sinks": "format", "activations": "xy_distribution",
                   "weight_grads": "wg_distribution", "optimizer_states": "mv_distribution",
                   "params": "param_distribution", "grad_probe": "mg_direction",
                   "communication.call_site_filter": "cc_distribution.cc_codeline", "communication": "cc_distribution",
                   "anomaly": "alert"}
"""The msprobe key behind each trainmon key it is translated to (the targets' patterns are added per key)."""


# ----------------------------------------------------------------------------------- translation
def translate_msprobe(path: Path, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Read a msprobe monitor config and map it to trainmon's schema.

    Args:
        path: the msprobe JSON config.
        environ: where ``MONITOR_OUTPUT_DIR`` is read (``TrainerMonitor.from_msprobe`` passes
            ``os.environ``); output goes there, or to msprobe's default ``./monitor_output``.

    Keys with a trainmon equivalent are mapped; a key that cannot be honoured as msprobe means
    it (or an unknown key) is warned about once, so switching from msprobe is one line.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8 JSON, repeats a key, is not a JSON
            object, or a key's value has a type msprobe rejects too; the message names the file and the key.
    """
    return read_msprobe(path, environ)[0]


def read_msprobe(path: Path, environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], MsprobeKeys]:
    """:func:`translate_msprobe`, and which msprobe key each trainmon key comes from (to reword later errors).

    Raises:
        ConfigError: as :func:`translate_msprobe`.
    """
    data = parse_json(read_text(path, "msprobe config"), path)
    if not isinstance(data, dict):
        raise ConfigError(str(path), "a msprobe monitor config must be a JSON object")
    check_types(data, path)
    translation = _Translation(data, environ or {}, path)
    return translation.run(), translation.keys


class _Translation(MsprobeNotes):
    """One msprobe config on its way to a trainmon dict (see :func:`translate_msprobe`), warning about each key it
    cannot honour as msprobe means it (:class:`MsprobeNotes`)."""

    def __init__(self, data: dict[str, Any], environ: Mapping[str, str], path: Path) -> None:
        self.data = data
        self.keys = MsprobeKeys(path, {**{key: key for key in _SAME_KEYS}, **_KEY_OF_SECTION})
        self.out: dict[str, Any] = {
            "output_dir": environ.get(OUTPUT_DIR_VARIABLE) or DEFAULT_OUTPUT_DIR,
            # msprobe collects a family only when its switch is set; trainmon's defaults differ.
            "activations": {"enabled": False},
            "weight_grads": {"enabled": False},
            "optimizer_states": {"enabled": False},
            "params": {"enabled": False},
        }
        super().__init__()
        self.targets = MsprobeTargets(data, self.keys, self)

    def run(self) -> dict[str, Any]:
        data, out = self.data, self.out
        metrics = self._metrics(data.get("ops", []))
        for section in ("activations", "weight_grads", "optimizer_states", "params"):
            out[section]["metrics"] = list(metrics)
        self._activations()
        self._weight_grads()
        self._optimizer_states()
        if data.get("param_distribution"):
            out["params"]["enabled"] = True
        if data.get("mg_direction"):
            out["grad_probe"] = {"enabled": True, "level": "L0", "mg_direction": True, "scalars": "param"}
        if isinstance(data.get("cc_distribution"), dict) and data["cc_distribution"].get("enable"):
            out["communication"] = {"enabled": True, "metrics": list(metrics), **self._communication()}
        self._features()
        self._schedule()
        self._outputs()
        out["anomaly"] = translate_alert(data.get("alert", {}), out, self)
        self.rest(data)
        return out

    # ------------------------------------------------------------------------------- families
    def _activations(self) -> None:
        """``xy_distribution``, ``all_xy``, ``forward_only``, ``backward_only`` and the module targets."""
        data, out = self.data, self.out
        xy = bool(data.get("xy_distribution"))
        targets = data.get("targets") or {"": {}}  # msprobe: no targets is the whole model
        all_xy = bool(data.get("all_xy")) or (xy and not data.get("targets"))
        params = self.targets.params(targets)
        if xy:
            out["targets"], root = self.targets.modules(targets, all_xy)
            out["activations"].update(enabled=True, **root)
        out["targets"] = {**out.get("targets", {}), "params": params}
        self.targets.key_patterns(targets, by_module=xy and not all_xy and not data.get("print_struct"))
        if data.get("forward_only") and data.get("backward_only"):
            self.differs("forward_only", "forward_only and backward_only together monitor no activation "
                                         "(msprobe warns too)")
        if data.get("forward_only"):
            out["activations"]["backward"] = False
        if data.get("backward_only"):
            out["activations"]["forward"] = False

    def _weight_grads(self) -> None:
        """``wg_distribution`` and ``monitor_mbs_grad``."""
        data = self.data
        if data.get("wg_distribution"):
            self.out["weight_grads"]["enabled"] = True
            self.out["weight_grads"]["per_micro_step"] = bool(data.get("monitor_mbs_grad"))
        elif data.get("monitor_mbs_grad"):
            self.cannot("monitor_mbs_grad", "it only acts with wg_distribution: true (as in msprobe)")

    def _optimizer_states(self) -> None:
        """``mv_distribution`` and ``ur_distribution``."""
        data = self.data
        states = (["exp_avg", "exp_avg_sq"] if data.get("mv_distribution") else []) + (
            ["update"] if data.get("ur_distribution") else [])
        if states:
            self.out["optimizer_states"].update(enabled=True, states=states)
        if data.get("ur_distribution"):
            self.differs("ur_distribution", "trainmon writes statistics of the Adam update m_hat/(sqrt(v_hat)+eps) "
                                            "(family update) instead of heatmap images; msprobe's 'ratio' heatmap "
                                            "(m_hat/sqrt(v_hat), the update without eps) has no family of its own "
                                            "(trainmon's ratio family is update/param)")

    def _features(self) -> None:
        """``recording_l2_features``, ``l2_targets`` and ``sa_order``: msprobe 26's L2 features (docs/features.md)."""
        data = self.data
        l2 = data.get("l2_targets") or {}
        if not data.get("recording_l2_features"):
            for key in ("l2_targets", "sa_order"):
                if data.get(key):
                    self.cannot(key, "it acts only with recording_l2_features: true (as in msprobe)")
            return
        features: dict[str, Any] = {}
        attention = l2.get("attention_hook") or []  # msprobe: missing or [] collects nothing
        if attention:
            layout = "sbhd" if str(data.get("sa_order", "s,b,h,d")).replace(" ", "") == "s,b,h,d" else "bshd"
            features["attention"] = {"enabled": True, "modules": self.targets.l2_modules(attention, "attention", ("",)),
                                     "inputs": layout, "causal": True}
            self.differs("l2_targets.attention_hook", "trainmon scores every head, on query_rows (64) query rows "
                                                      "spread over the batch, against all keys, and writes "
                                                      "max_logit (the largest logit) and entropy per head (family "
                                                      "attn); msprobe scores head 0 of sequence 0 only, the whole "
                                                      "seq x seq matrix, and writes entropy and softmax_max (the "
                                                      "mean over rows of the largest softmax probability)")
        if "linear_hook" in l2:
            params = self.targets.l2_modules(l2["linear_hook"], "weights", (".weight", ".wg"))
            # msprobe's [] is every module with a 2-D weight (or wg) that is not an embedding
            features["weights"] = {"enabled": True, "params": params or ["re:(^|\\.)(weight|wg)$"],
                                   "embeddings": False}
            self.differs("l2_targets.linear_hook", "trainmon's stable_rank is ||W||_F^2 / sigma_1^2 (msprobe's sr: "
                                                   "||W||_F / sigma_1, its square root) and its spectral_norm is "
                                                   "msprobe's kernel_norm (sigma_1), estimated by power iterations "
                                                   "continued from one collected step to the next (msprobe: 3 from a "
                                                   "random start each time); family weight_features")
        if not features:
            self.cannot("recording_l2_features", "l2_targets names no attention_hook or linear_hook module "
                                                 "(msprobe collects nothing either)")
        self.out["features"] = features

    # ------------------------------------------------------------------------------- other keys
    def _metrics(self, ops: list[str]) -> list[str]:
        known = [op for op in ops if op in _OPS]
        for op in ops:
            if op in ("shape", "dtype"):
                self.cannot(f"ops: {op!r}", "trainmon records shapes and dtypes once, in module_struct.json "
                                            "(print_struct: true)")
            elif op == "id":
                self.cannot("ops: 'id'", "it is the value of a 0-d tensor (NaN otherwise); trainmon's "
                                         "min/max/mean of such a tensor are that value")
            elif op not in _OPS:
                self.cannot(f"ops: {op!r}", f"msprobe's ops are {list(_OPS)}, id, shape, dtype; trainmon adds infs")
        return list(dict.fromkeys(known)) or ["norm"]  # msprobe: no valid op means norm

    def _schedule(self) -> None:
        data, out = self.data, self.out
        for key in ("start_step", "step_interval", "print_struct"):
            if key in data:
                out[key] = data[key]
        if "eps" in data:
            out["eps"] = data["eps"]
        if "collect_times" in data:
            if data["collect_times"] == 0:  # msprobe: nothing is collected
                out["enabled"] = False
            else:
                out["collect_times"] = data["collect_times"]
        if data.get("module_ranks"):
            self._ranks(data["module_ranks"])
        if data.get("print_struct"):
            self.differs("print_struct", "trainmon writes module_struct.json and goes on training with the "
                                         "configured families (msprobe records only the structure and raises "
                                         "at the first optimizer step)")

    def _ranks(self, ranks: list[int]) -> None:
        """``module_ranks``: msprobe monitors the listed ranks that exist and ignores the others, so a config written
        for a larger job runs on a smaller one (``absent_ranks: skip`` warns about them at ``attach``)."""
        negative = [rank for rank in ranks if rank < 0]
        if negative:
            self.warn_once("trainmon: msprobe config key %s: %s", "module_ranks",
                           f"ranks {negative} exist in no job; ignored, as msprobe ignores them")
        ranks = [rank for rank in dict.fromkeys(ranks) if rank >= 0]
        if not ranks:
            raise ConfigError(str(self.keys.path), "msprobe key module_ranks: lists no rank that can exist "
                                                   "([] means every rank)")
        self.out.update(ranks=ranks, absent_ranks="skip")

    def _outputs(self) -> None:
        fmt = self.data.get("format")
        if fmt is None:  # msprobe's default is tensorboard (1.2.1) or csv (8.x and later): trainmon writes both
            self.out["sinks"] = ["csv", "tensorboard"]
            return
        if fmt in ("csv", "tensorboard"):
            self.out["sinks"] = [fmt]
            if fmt == "tensorboard":  # msprobe writes a tag per tensor and op: so does trainmon, beside its overview
                self.out["tensorboard"] = {"per_tensor": True}
        elif fmt == "api":
            self.out["sinks"] = []
            self.differs("format", "'api' writes no file, as in msprobe; read the values from the StepRecord "
                                   "that monitor.step() returns (msprobe's generate_*_metrics methods do not exist)")
        else:
            self.cannot(f"format: {fmt!r}", "msprobe knows csv, tensorboard and api")

    def _communication(self) -> dict[str, Any]:
        section: dict[str, Any] = {}
        cc = self.data["cc_distribution"]
        lines = cc.get("cc_codeline") or []
        if lines:  # msprobe's "path/file.py[line]" -> a regex on trainmon's "path/file.py:line in function"
            section["call_sites"] = True
            section["call_site_filter"] = "|".join(_codeline_regex(str(line)) for line in lines)
        if cc.get("cc_log_only"):
            self.cannot("cc_distribution.cc_log_only", "trainmon does not stop training to print the "
                                                       "collectives' call stacks; set communication.call_sites "
                                                       "to see them in the row names")
        for key in cc:
            if key not in ("enable", "cc_codeline", "cc_pre_hook", "cc_log_only"):
                self.cannot(f"cc_distribution.{key}", "msprobe knows enable, cc_codeline, cc_pre_hook, cc_log_only")
        # cc_pre_hook: trainmon always measures a collective's inputs (msprobe's pre-hook) and outputs.
        return section


def _codeline_regex(codeline: str) -> str:
    match = re.fullmatch(r"(.*)\[(\d+)\]", codeline.strip())
    if match is None:
        return re.escape(codeline)
    return f"{re.escape(match.group(1))}:{match.group(2)} "
