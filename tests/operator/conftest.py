"""Fixtures: an emulated cluster (KMock) with the CRD applied, kubectl against it, the operator."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from external_tools import has_tool_or_warn, require_tool

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chart_render import granted_rules
from kube_emulator import EmulatedCluster
from op_harness import CRD, Kubectl, Operator, operator_calls


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[EmulatedCluster]:
    require_tool("kubectl")
    with EmulatedCluster(tmp_path) as emulated:
        Kubectl(emulated.kubeconfig).apply(CRD)
        yield emulated


@pytest.fixture()
def kubectl(cluster: EmulatedCluster) -> Kubectl:
    return Kubectl(cluster.kubeconfig)


@pytest.fixture()
def operator(
    cluster: EmulatedCluster, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Operator]:
    op = Operator(cluster.kubeconfig, tmp_path)
    op.start()
    yield op
    op.stop()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        print(op.log()[-6000:])
        return
    # Least privilege, checked against behaviour: the chart's ClusterRole must allow every call
    # the operator made in this test (and tests/operator/test_chart.py checks nothing more).
    if has_tool_or_warn("helm", "the chart's ClusterRole against the operator's calls"):
        missing = operator_calls(cluster) - granted_rules()
        assert not missing, f"the chart's ClusterRole lacks {sorted(missing)}"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)
