"""The ``--set KEY=VALUE`` grammar, one for every command (train, compare, scale, info).

- :func:`split_override`: ``"lr=3e-4"`` -> ``("lr", "3e-4")``.
- :func:`parse_value`: a value's text read as a JSON / YAML scalar, else kept as text.
- :func:`parse_overrides`: dotted keys into a nested mapping (compare's and scale's ``--set``).
- :func:`dotted_items` and :func:`value_text`: the way back, from a mapping to ``--set`` words.

Where a key lands (which fields exist, what a dotted key may reach) is the owner's rule:
``TrainConfig.with_overrides``, ``ComparePreset.with_overrides``, ``ModelConfig`` for ``info``.
"""

from __future__ import annotations

import json
from typing import Any


def split_override(text: str) -> tuple[str, str]:
    """``"KEY=VALUE"`` -> ``(KEY, VALUE)``; the key stripped, the value as written."""
    if "=" not in text:
        raise ValueError(f"override {text!r}: expected KEY=VALUE (e.g. lr=3e-4 or model_overrides.dim=128)")
    key, value = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ValueError(f"override {text!r}: empty key")
    return key, value


def parse_value(text: str) -> Any:
    """A command-line value: JSON / YAML scalars (``3``, ``1e-3``, ``true``, ``null``, ``[1, 2]``), else the string."""
    text = text.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("null", "none", "~"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_overrides(items: list[str]) -> dict:
    """``["steps=500", "tasks.needle.grid=1/1,2/2"]`` -> ``{"steps": 500, "tasks": {"needle": {"grid": "1/1,2/2"}}}``:
    dotted keys nest; values as :func:`parse_value` reads them (a string left as text is then parsed
    by the setting that takes it, such as a task setting's own text form)."""
    out: dict = {}
    for item in items:
        key, value = split_override(item)
        path = [x.strip() for x in key.split(".")]
        if not all(path):
            raise ValueError(f"--set {item!r}: empty name in {key!r}")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {part!r} is given both a value and sub-fields")
        node[path[-1]] = parse_value(value)
    return out


def dotted_items(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    """``{"tasks": {"recall": {"samples": 4}}}`` -> ``[("tasks.recall.samples", 4)]``: :func:`parse_overrides`' keys."""
    out = []
    for k, v in d.items():
        out += dotted_items(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [(f"{prefix}{k}", v)]
    return out


def value_text(v) -> str:
    """A value as ``--set`` text: lists as JSON, booleans as ``true`` / ``false``, anything else as ``str`` gives it."""
    if isinstance(v, (list, tuple)):
        return json.dumps(list(v), separators=(",", ":"))
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
