"""Reading a config file: UTF-8 text, parsed as YAML (safe loader) or JSON, each key given once.

Used by :func:`trainmon.config.load_config` and the msprobe translation; no validation here (that is
:mod:`trainmon.base.schema`'s). Framework-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainmon.base.inputs import read_regular
from trainmon.errors import ConfigError


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict (no validation).

    Raises:
        ConfigError: the file has another suffix, cannot be read (missing, a directory, a named
            pipe), is not UTF-8, cannot be parsed, is nested too deeply, repeats a key (the
            dotted key is named) or is not a mapping; the message names the file.
    """
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(str(path), "config file must end in .yaml, .yml or .json")
    text = read_text(path, "config file")
    data = parse_json(text, path) if path.suffix == ".json" else parse_yaml(text, path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"top level must be a mapping, got {type(data).__name__}")
    return data


def read_text(path: Path, what: str) -> str:
    """The UTF-8 text of a regular file (a leading byte-order mark is dropped).

    Raises:
        ConfigError: unreadable, not a regular file (a named pipe is refused, never waited on) or
            not UTF-8; the key is the file.
    """
    try:
        data = read_regular(path)
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read {what}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


class _Pairs(list):  # type: ignore[type-arg]
    """A JSON object as its ``(key, value)`` pairs, so that repeated keys can be found."""


def parse_json(text: str, path: Path) -> Any:
    """Parse JSON config text; an empty text is None.

    Raises:
        ConfigError: invalid JSON, nested too deeply, or a repeated key (named by its dotted path).
    """
    if not text.strip():
        return None
    try:
        return _unique_keys(json.loads(text, object_pairs_hook=_Pairs), "", path)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(path), f"cannot parse: {exc}") from None
    except RecursionError:
        raise ConfigError(str(path), "cannot parse: nested too deeply") from None


def _unique_keys(value: Any, prefix: str, path: Path) -> Any:
    if isinstance(value, _Pairs):
        out: dict[str, Any] = {}
        for key, item in value:
            dotted = f"{prefix}.{key}" if prefix else key
            if key in out:
                raise ConfigError(dotted, f"key repeated in {path} (a mapping may give each key once)")
            out[key] = _unique_keys(item, dotted, path)
        return out
    if isinstance(value, list):
        return [_unique_keys(item, f"{prefix}[{i}]", path) for i, item in enumerate(value)]
    return value


def parse_yaml(text: str, path: Path) -> Any:
    """Parse YAML config text with the safe loader.

    Raises:
        ConfigError: invalid YAML, nested too deeply, or a repeated key (named by its dotted path,
            with both lines).
    """
    import yaml

    loader = None
    try:
        loader = yaml.SafeLoader(text)  # checks the characters already
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_keys(node, path)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"cannot parse: {exc}") from None
    except RecursionError:
        raise ConfigError(str(path), "cannot parse: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_yaml_keys(root: Any, path: Path) -> None:
    """Raise for a key given twice in one mapping (PyYAML keeps the last one silently).

    Iterative, and each node is visited once: aliases (``*a``), even self-referencing ones or an
    exponential "billion laughs" document, cost one visit per distinct node.
    """
    import yaml

    stack: list[tuple[Any, str]] = [(root, "")]
    seen: set[int] = set()
    while stack:
        node, prefix = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{prefix}[{i}]") for i, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if key.tag == "tag:yaml.org,2002:merge":  # `<<: *base` merges; its keys may be overridden
                    stack.append((value, prefix))
                    continue
                name = str(key.value) if isinstance(key, yaml.ScalarNode) else f"<{key.id}>"
                dotted = f"{prefix}.{name}" if prefix else name
                where = (key.tag, name)
                if where in first:
                    raise ConfigError(dotted, f"key repeated in {path} (lines {first[where] + 1} and "
                                              f"{key.start_mark.line + 1}; a mapping may give each key once)")
                first[where] = key.start_mark.line
                stack.append((value, dotted))
