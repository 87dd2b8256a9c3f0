"""``--lora-modules`` entries (``NAME=PATH`` or vLLM's JSON form) and ``--lora-modules-file``
(a JSON list of that form; no torch imported here)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


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


def read_lora_modules_file(path: str) -> list[LoraModule]:
    """``--lora-modules-file``: a JSON list of vLLM's ``--lora-modules`` objects (what the
    operator writes to the engine ConfigMap); ValueError naming the file and the entry."""
    try:
        body = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--lora-modules-file {path}: {exc}") from exc
    if not isinstance(body, list):
        raise ValueError(f"--lora-modules-file {path}: not a JSON list")
    modules = []
    for i, entry in enumerate(body):
        if not isinstance(entry, dict):
            raise ValueError(f"--lora-modules-file {path}: entry {i} is not an object")
        try:
            modules.append(parse_lora_module(json.dumps(entry)))
        except ValueError as exc:
            raise ValueError(f"--lora-modules-file {path}: entry {i}: {exc}") from exc
    return modules
