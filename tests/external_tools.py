"""The non-Python tools some tests drive for real: prometheus, kubectl, helm, kubernetes-validate.

Locally a missing tool skips the tests that need it (with the reason). In CI (`CI=true`, as
GitHub Actions, GitLab and most runners set it) it fails them: a CI run that quietly skipped
the cluster, chart and Prometheus tests would pass without having tested them.
`scripts/install-test-tools.sh` installs them and is just as strict under `CI=true`.
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def _missing(tool: str) -> str:
    return f"{tool} is not installed (scripts/install-test-tools.sh installs it)"


def require_tool(tool: str) -> str:
    """The tool's path; skips the test without it, or fails it in CI."""
    path = shutil.which(tool)
    if path is not None:
        return path
    if in_ci():
        pytest.fail(f"{_missing(tool)}; CI=true makes a missing tool a failure", pytrace=False)
    pytest.skip(_missing(tool))


def has_tool_or_warn(tool: str, what: str) -> bool:
    """For a check inside a test that otherwise ran: False (with a warning) when `tool` is
    missing, so the check is visibly not run; a failure in CI."""
    if shutil.which(tool) is not None:
        return True
    if in_ci():
        pytest.fail(f"{_missing(tool)}: {what} not checked; CI=true requires it", pytrace=False)
    warnings.warn(f"{_missing(tool)}: {what} not checked", stacklevel=2)
    return False
