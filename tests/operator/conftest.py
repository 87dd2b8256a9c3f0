"""Fixtures: the real local control plane (scripts/cluster.sh) with the chart installed and the
operator running as its ServiceAccount; and, for fast reconcile unit tests only, KMock."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from external_tools import has_tool_or_warn, require_tool

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chart_render import granted_rules
from kube_emulator import EmulatedCluster
from op_harness import CRD, Kubectl, Operator, operator_calls
from real_cluster import OPERATOR_SA, RELEASE, RELEASE_NAMESPACE, ROOT, ControlPlane

_REPORT: list[str] = []  # lines for the terminal summary (the apiserver's version)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """One real control plane per session, with what the README's walkthrough installs first:
    the chart (helm install), the example's PriorityClass, PVC and a PV for it."""
    for tool in ("kubectl", "helm", "openssl", "curl", "go"):
        require_tool(tool)
    plane = ControlPlane(tmp_path_factory.mktemp("control-plane"))
    try:
        plane.up()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        version = plane.server_version()
        _REPORT.append(f"operator end-to-end tests ran against kube-apiserver {version}")
        print(f"\nkube-apiserver {version} (local control plane in {plane.state})")
        plane.helm(
            "install", RELEASE, str(ROOT / "charts" / "mstar"), "-n", RELEASE_NAMESPACE,
            "--create-namespace", "--wait", "--timeout=3m",
        )  # fmt: skip
        for name in ("prerequisites.yaml", "local-models-pv.yaml"):
            plane.kubectl("apply", "-f", str(ROOT / "examples" / name))
        yield plane
    finally:
        plane.down()


@pytest.fixture(scope="session")
def operator_kubeconfig(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Credentials of the chart's ServiceAccount: a verb its RBAC lacks fails the test."""
    path = tmp_path_factory.mktemp("operator") / "kubeconfig"
    return control_plane.token_kubeconfig(OPERATOR_SA, RELEASE_NAMESPACE, path)


@pytest.fixture(scope="session")
def real_operator(
    operator_kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """`mstar-operator` as a process, cluster-wide as the chart runs it by default."""
    op = Operator(operator_kubeconfig, tmp_path_factory.mktemp("operator-logs"))
    op.args = ["--resync-seconds", "20"]
    op.start()
    yield op
    op.stop()


@pytest.fixture()
def namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test (deleted afterwards, without waiting)."""
    name = "t-" + request.node.name.removeprefix("test_").replace("_", "-")[:50].rstrip("-")
    control_plane.kubectl("create", "namespace", name)
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in _REPORT:
        terminalreporter.write_line(line)


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
