"""Architecture -> model family: HF ``architectures``, HF ``model_type``, GGUF
``general.architecture``. Adding a family is one file under ``families/`` and one line here."""

from __future__ import annotations

from typing import Any

from mstar.engine.model.config import ModelLoadError
from mstar.engine.model.families import (
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from mstar.engine.model.family import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    mistral.FAMILY,
    gemma3.FAMILY,
    phi3.FAMILY,
    qwen3_moe.FAMILY,
    mixtral.FAMILY,
    gpt_oss.FAMILY,
)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a for f in FAMILIES for a in f.architectures)


def family_for_config(cfg: dict[str, Any]) -> Family:
    """The family of a ``config.json`` (by ``architectures``, else ``model_type``)."""
    archs = cfg.get("architectures") or []
    for arch in archs:
        for family in FAMILIES:
            if arch in family.architectures:
                return family
    model_type = cfg.get("model_type")
    if not archs:
        for family in FAMILIES:
            if model_type in family.model_types:
                return family
    named = ", ".join(archs) if archs else f"model_type={model_type!r}"
    raise ModelLoadError(
        f"unsupported architecture {named}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def family_for_gguf(arch: str) -> Family:
    """The family of a GGUF file's ``general.architecture``."""
    for family in FAMILIES:
        if arch in family.gguf_architectures:
            return family
    known = sorted(a for f in FAMILIES for a in f.gguf_architectures)
    raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(known)}")


def family_named(name: str) -> Family:
    """The family a parsed `ModelConfig.family` names."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ModelLoadError(f"unknown model family {name!r}")
