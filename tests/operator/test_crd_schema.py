"""The CRD: structural, every example and test CR valid against it, bad ones rejected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import CRD_PATH, admit, load_crd, version_schema
from op_harness import CRS, ROOT

from mstar.operator.spec import (
    API_KEY_SECRET_DEFAULTS,
    AUTOSCALING_DEFAULTS,
    DEFAULTS,
    ENGINE_FIELDS,
    ROUTER_DEFAULTS,
    SOURCE_DEFAULTS,
    TOKEN_SECRET_DEFAULTS,
    InvalidSpec,
    parse_spec,
)

VALID = sorted((ROOT / "examples").glob("mstardeployment*.yaml")) + sorted(CRS.glob("valid-*.yaml"))
SCHEMA_VALID_BUT_UNSERVABLE = CRS / "invalid-semantic.yaml"
INVALID_DOCS = list(yaml.safe_load_all((CRS / "invalid-schema.yaml").read_text()))
NON_STRUCTURAL = {"anyOf", "oneOf", "allOf", "not"}


def _spec_schema() -> dict[str, Any]:
    spec = version_schema(load_crd())["properties"]["spec"]
    assert isinstance(spec, dict)
    return spec


def test_crd_identity_and_surface() -> None:
    crd = load_crd()
    assert crd["metadata"]["name"] == "mstardeployments.mstar.dev"
    spec = crd["spec"]
    assert (spec["group"], spec["names"]["kind"], spec["names"]["shortNames"]) == (
        "mstar.dev",
        "MStarDeployment",
        ["msd"],
    )
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Model", "Replicas", "Ready", "Endpoint", "Age"]


def _walk(node: dict[str, Any], path: str, out: list[str]) -> None:
    if "type" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out.append(f"{path}: no type")
    for key in NON_STRUCTURAL & node.keys():
        for sub in node[key] if isinstance(node[key], list) else [node[key]]:
            banned = {"type", "default", "description", "properties", "items"} & sub.keys()
            if banned:
                out.append(f"{path}.{key}: {sorted(banned)} not allowed (structural schema)")
    for name, sub in (node.get("properties") or {}).items():
        _walk(sub, f"{path}.{name}", out)
    if isinstance(node.get("items"), dict):
        _walk(node["items"], f"{path}[]", out)
    if isinstance(node.get("additionalProperties"), dict):
        _walk(node["additionalProperties"], f"{path}{{}}", out)


def test_schema_is_structural() -> None:
    out: list[str] = []
    _walk(version_schema(load_crd()), "", out)
    assert out == []


def test_the_crd_has_one_home_in_the_chart() -> None:
    """crds/ links to the chart's CRD (helm installs only what is inside the chart)."""
    chart_copy = ROOT / "charts" / "mstar" / "crds" / CRD_PATH.name
    assert CRD_PATH.is_symlink() and CRD_PATH.resolve() == chart_copy.resolve()
    assert not chart_copy.is_symlink()


@pytest.mark.parametrize("path", [*VALID, SCHEMA_VALID_BUT_UNSERVABLE], ids=lambda p: p.name)
def test_examples_and_test_crs_validate(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        _, errors = admit(doc)
        assert errors == [], f"{path.name}: {errors}"


@pytest.mark.parametrize("doc", INVALID_DOCS, ids=lambda d: d["metadata"]["name"])
def test_invalid_crs_are_rejected(doc: dict[str, Any]) -> None:
    _, errors = admit(doc)
    assert errors, f"{doc['metadata']['name']} should be rejected"


@pytest.mark.parametrize(
    "engine", [{"gpuMemoryUtilization": 0}, {"cudaGraphBatchSizes": [0]}, {"numPages": 1}]
)
def test_engine_bounds(engine: dict[str, Any]) -> None:
    doc = {"apiVersion": "mstar.dev/v1alpha1", "kind": "MStarDeployment", "metadata": {}}
    doc["spec"] = {"model": {"name": "m"}, "engine": engine}
    assert admit(doc)[1]


def _defaults(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, sub in (node.get("properties") or {}).items():
        nested = _defaults(sub)
        if "default" in sub and not nested:
            out[name] = sub["default"]
        elif nested:
            out[name] = nested
    return out


def test_operator_defaults_match_the_crd() -> None:
    spec = _spec_schema()
    crd = _defaults(spec)
    operator = dict(DEFAULTS)
    assert crd.pop("autoscaling") == AUTOSCALING_DEFAULTS
    assert crd.pop("router") == ROUTER_DEFAULTS
    assert crd.pop("apiKeySecret") == API_KEY_SECRET_DEFAULTS
    source = crd.pop("model")["source"]
    hf = source["huggingFace"]
    assert hf.pop("tokenSecret") == TOKEN_SECRET_DEFAULTS
    assert source == SOURCE_DEFAULTS
    assert {k: v for k, v in crd.items() if k != "scheduling"} == {
        k: v for k, v in operator.items() if k != "scheduling"
    }


def test_every_engine_setting_maps_to_an_engine_flag() -> None:
    assert set(_spec_schema()["properties"]["engine"]["properties"]) == set(ENGINE_FIELDS)


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_operator_accepts_what_the_schema_accepts(path: Path) -> None:
    defaulted, _ = admit(yaml.safe_load(path.read_text()))
    parse_spec(defaulted["spec"])  # raises on any problem
    parse_spec(yaml.safe_load(path.read_text())["spec"])  # and without server defaulting


def test_operator_rejects_unservable_spec() -> None:
    defaulted, _ = admit(yaml.safe_load(SCHEMA_VALID_BUT_UNSERVABLE.read_text()))
    with pytest.raises(InvalidSpec) as info:
        parse_spec(defaulted["spec"])
    assert info.value.problems == [
        "spec.engine.hostOffloadGiB (8 GiB) does not fit in spec.resources.memory (4Gi)"
    ]
