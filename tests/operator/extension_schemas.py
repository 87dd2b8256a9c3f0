"""Schemas of other projects' kinds (tests/operator/schemas/*.yaml, written from their docs).

`problems(name, obj)` validates an object as a strict API server would; `crd(name)` wraps a
schema as a CustomResourceDefinition so the emulated cluster serves (and validates) the kind,
standing in for the real CRDs, which cannot be downloaded here.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml
from crd_schema import problems as schema_problems

SCHEMAS = Path(__file__).resolve().parent / "schemas"


@cache
def load(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((SCHEMAS / f"{name}.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def problems(name: str, obj: dict[str, Any]) -> list[str]:
    return schema_problems(load(name)["schema"], obj)


def crd(name: str) -> dict[str, Any]:
    doc = load(name)
    kind, plural = doc["kind"], doc["plural"]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{doc['group']}"},
        "spec": {
            "group": doc["group"],
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": doc["version"],
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": doc["schema"]},
                    "subresources": {"status": {}},
                }
            ],
        },
    }


def install(kubectl: Any, tmp: Path, *names: str) -> None:
    """`kubectl apply` the stand-in CRDs of these kinds to the emulated cluster."""
    path = tmp / "extension-crds.yaml"
    path.write_text(yaml.safe_dump_all([crd(n) for n in names]))
    kubectl.apply(path)
