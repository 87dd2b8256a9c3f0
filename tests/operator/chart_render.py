"""Render the Helm chart (real helm binary) and read its RBAC rules."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "mstar"


def render(*sets: str, include_crds: bool = True) -> list[dict[str, Any]]:
    args = ["helm", "template", "mstar", str(CHART), "--namespace", "mstar-system"]
    if include_crds:
        args.append("--include-crds")
    for value in sets:
        args += ["--set", value]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=120).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def granted_rules(docs: list[dict[str, Any]] | None = None) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples of the operator's ClusterRole (resourceNames aside)."""
    docs = docs if docs is not None else render(include_crds=False)
    (role,) = [
        d
        for d in docs
        if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-operator")
    ]
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
