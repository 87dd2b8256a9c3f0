"""``--lora-modules`` entries: ``NAME=PATH`` or vLLM's JSON form (no torch imported here)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraModule:
    """One adapter to serve: the name requests use as their ``model``, and its PEFT folder."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(entry: str) -> LoraModule:
    """``NAME=PATH`` or ``{"name": ..., "path": ..., "base_model_name": ...}``; ValueError
    saying what is wrong otherwise."""
    text = entry.strip()
    if text.startswith("{"):
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"invalid JSON {entry!r}: {exc.msg}") from exc
        name, path, base = body.get("name"), body.get("path"), body.get("base_model_name")
        if not isinstance(name, str) or not isinstance(path, str):
            raise ValueError(f"{entry!r} needs string fields 'name' and 'path'")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"{entry!r}: 'base_model_name' must be a string")
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise ValueError(f"{entry!r} is not NAME=PATH")
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise ValueError(f"{entry!r}: the name and the path must not be empty")
    return LoraModule(name, path, base)
