"""Reading the web config's YAML: duplicate keys refused, typed values, messages naming the key.

Shared by :mod:`gpu_exporter.web.webconfig` (the file), :mod:`gpu_exporter.web.tls` (its
``tls_server_config``) and :mod:`gpu_exporter.web.auth` (``basic_auth_users``). Every error
is a :class:`WebConfigError` whose one-line message says where (``tls_server_config.min_version``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml


class WebConfigError(ValueError):
    """The web config is unusable; the message is one line and names the key."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (a second user entry must not win silently)."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise WebConfigError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def section(value: Any, where: str, keys: Iterable[str]) -> dict[str, Any]:
    """The mapping at ``where`` ({} when absent); a key not in ``keys`` is an error."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"{where}: expected a mapping, got {kind(value)}")
    allowed = tuple(keys)
    for key in value:
        if key not in allowed:
            raise WebConfigError(
                f"{join(where, key)}: unknown key; expected one of {', '.join(allowed)}"
            )
    return value


def join(where: str, key: Any) -> str:
    """Where a key is, for messages: ``tls_server_config.min_version``."""
    return f"{where}.{key}" if where else str(key)


def kind(value: Any) -> str:
    """What a wrong value is, for messages: ``int``, ``list``, ``nothing``."""
    return "nothing" if value is None else type(value).__name__


def string(fields: dict[str, Any], key: str, where: str) -> str | None:
    """A string value; None when absent or blank."""
    value = fields.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise WebConfigError(f"{join(where, key)}: expected a string, got {kind(value)}")
    return value


def strings(fields: dict[str, Any], key: str, where: str) -> list[str]:
    """A list of strings; [] when absent."""
    value = fields.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise WebConfigError(f"{join(where, key)}: expected a list of strings")
    return value


def flag(fields: dict[str, Any], key: str, where: str, default: bool) -> bool:
    """A boolean; ``default`` when absent."""
    value = fields.get(key, default)
    if not isinstance(value, bool):
        raise WebConfigError(f"{join(where, key)}: expected true or false, got {value!r}")
    return value


def choice(value: str | None, where: str, choices: Iterable[str], default: str) -> str:
    """One of ``choices``; ``default`` when None."""
    options = tuple(choices)
    if value is None:
        return default
    if value not in options:
        raise WebConfigError(f"{where}: expected one of {', '.join(options)}, got {value!r}")
    return value


def load_yaml(text: str) -> Any:
    """The YAML document in ``text`` (safe types only, no duplicate keys)."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise WebConfigError(f"not valid YAML: {at}{exc.problem}") from None
    except yaml.YAMLError as exc:
        raise WebConfigError(f"not valid YAML: {exc}") from None
