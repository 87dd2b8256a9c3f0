"""The MStarDeployment CRD's OpenAPI schema as an API server would apply it: defaults, then checks.

Used by the emulator (to accept or reject CRs the way kube-apiserver does) and by the schema tests.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from openapi_schema_validator import OAS30Validator

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "mstar.dev_mstardeployments.yaml"


def load_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    assert isinstance(crd, dict)
    return crd


def version_schema(crd: dict[str, Any], version: str | None = None) -> dict[str, Any]:
    for v in crd["spec"]["versions"]:
        if version is None or v["name"] == version:
            schema = v["schema"]["openAPIV3Schema"]
            assert isinstance(schema, dict)
            return schema
    raise KeyError(version)


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: fill missing properties with `default`, then recurse into them."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and schema.get("type") == "object":
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def problems(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """Every schema violation, each as 'path: message' (empty when valid)."""
    validator = OAS30Validator(schema)
    out = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
        path = ".".join(str(p) for p in error.absolute_path) or "<root>"
        out.append(f"{path}: {error.message}")
    return out


def admit(
    obj: dict[str, Any], crd: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """What the API server would store for `obj` (defaulted), and why it would reject it."""
    schema = version_schema(crd or load_crd())
    defaulted = apply_defaults(schema, obj)
    return defaulted, problems(schema, defaulted)
