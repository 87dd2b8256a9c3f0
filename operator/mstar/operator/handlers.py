"""Kopf handlers: every trigger runs the same idempotent `reconcile` pass.

Triggers: the CR is created, changed or found at start-up (resume), and any change or deletion of
a child labelled as ours (drift correction and status from the Deployment's progress). Importing
this module registers the handlers on Kopf's default registry.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import kopf

from .kube import Kube, load_api_client
from .manifests import MANAGED_BY
from .reconcile import controller_of, reconcile
from .spec import GROUP, PLURAL, VERSION

CHILD_RESOURCES = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
)
OURS = {"app.kubernetes.io/managed-by": MANAGED_BY}
RETRY_DELAY = 5.0
Log = logging.Logger | logging.LoggerAdapter[Any]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Keep Kopf's bookkeeping in annotations (status stays ours) and build the API client."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="mstar.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="mstar.dev", key="last-handled-configuration"
    )
    # Resources are discovered once at start-up: no RBAC on CRDs or Namespaces is needed.
    settings.scanning.disabled = True
    settings.posting.reporting_component = "mstar-operator"
    settings.posting.level = logging.INFO
    settings.watching.connect_timeout = 10
    settings.watching.server_timeout = 300
    memo.kube = Kube(load_api_client())


def _run(kube: Kube, body: dict[str, Any], logger: Log) -> None:
    outcome = reconcile(kube, body)
    for kind, reason, message in outcome.events:
        kopf.event(cast(kopf.Body, body), type=kind, reason=reason, message=message)
        logger.info("%s %s: %s", kind, reason, message)
    if outcome.failed:
        raise kopf.TemporaryError("API call failed; retrying", delay=RETRY_DELAY)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile_deployment(body: kopf.Body, memo: Any, logger: Log, **_: Any) -> None:
    _run(memo.kube, dict(body), logger)


def _on_child(body: kopf.Body, memo: Any, logger: Log) -> None:
    owner = controller_of(dict(body))
    namespace = body.get("metadata", {}).get("namespace")
    if owner is None or not namespace:
        return
    cr = memo.kube.get_cr(namespace, owner["name"])
    if cr is None or cr["metadata"].get("uid") != owner.get("uid"):
        return  # the CR is gone (garbage collection is removing its children) or replaced
    _run(memo.kube, cr, logger)


for _group, _version, _plural in CHILD_RESOURCES:

    @kopf.on.event(_group, _version, _plural, labels=OURS, id=f"child-{_plural}")
    def _child_event(body: kopf.Body, memo: Any, logger: Log, **_: Any) -> None:
        """A child changed or vanished: put it back as the spec says, refresh status."""
        _on_child(body, memo, logger)
