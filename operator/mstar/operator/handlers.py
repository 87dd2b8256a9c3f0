"""Kopf handlers: every trigger runs the same idempotent `reconcile` pass.

Triggers: the CR is created, changed or found at start-up (resume), and any change or deletion of
a child labelled as ours (drift correction and status from the Deployment's progress). Importing
this module registers the handlers on Kopf's default registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import kopf

from .adapter_sync import sync_adapters
from .kube import CUSTOM_KINDS, Kube, KubeError, load_api_client
from .main import DEFAULT_ADAPTER_SYNC_SECONDS
from .manifests import MANAGED_BY
from .reconcile import controller_of, reconcile
from .router import DEFAULT_EPP_CLUSTER_ROLE
from .spec import GROUP, PLURAL, VERSION

CHILD_RESOURCES = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("", "v1", "serviceaccounts"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    *CUSTOM_KINDS.values(),  # watched only where their CRDs are installed
)
OURS = {"app.kubernetes.io/managed-by": MANAGED_BY}
RETRY_DELAY = 5.0
DEFAULT_RESYNC_SECONDS = 300.0
Log = logging.Logger | logging.LoggerAdapter[Any]


@kopf.on.startup()
async def configure(
    settings: kopf.OperatorSettings, memo: kopf.Memo, logger: Log, **_: Any
) -> None:
    """Kopf's bookkeeping in annotations (status stays ours); API client; periodic resync."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="mstar.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="mstar.dev", key="last-handled-configuration"
    )
    # Resources are discovered once at start-up: no RBAC on CRDs or Namespaces is needed.
    settings.scanning.disabled = True
    # Kopf still posts its own warnings (e.g. a handler retrying); our Events come from _run.
    settings.posting.level = logging.WARNING
    settings.watching.connect_timeout = 10
    settings.watching.server_timeout = 300
    memo.kube = Kube(load_api_client())
    seconds = float(getattr(memo, "resync_seconds", DEFAULT_RESYNC_SECONDS) or 0)
    if seconds > 0:
        memo.resync_task = asyncio.create_task(_resync_forever(memo, seconds, logger))


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    task: asyncio.Task[None] | None = getattr(memo, "resync_task", None)
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _resync_forever(memo: Any, seconds: float, logger: Log) -> None:
    """Reconcile every CR periodically: heals what no watched event announces (e.g. a foreign
    object squatting on a child's name goes away), like controller-runtime's resync period."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await asyncio.to_thread(_resync_all, memo, logger)
        except Exception:  # keep resyncing; a failed pass is retried next period
            logger.exception("resync pass failed")


def _resync_all(memo: Any, logger: Log) -> None:
    kube: Kube = memo.kube
    namespaces: list[str] = list(getattr(memo, "namespaces", None) or [])
    listings: list[Any] = (
        [kube.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL) for ns in namespaces]
        if namespaces
        else [kube.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)]
    )
    items = [dict(item) for listing in listings for item in listing["items"]]
    for cr in items:
        with contextlib.suppress(kopf.TemporaryError):  # in status already; next period retries
            _run(memo, cr, logger)


def _post(kube: Kube, body: dict[str, Any], events: list[Any], logger: Log) -> None:
    for kind, reason, message in events:
        logger.info("%s %s: %s", kind, reason, message)
        try:  # posted directly (not kopf.event): works from the resync thread as well
            kube.post_event(body, kind, reason, message)
        except KubeError as exc:
            logger.warning("could not post event %s: %s", reason, exc)


def _run(memo: Any, body: dict[str, Any], logger: Log) -> None:
    kube: Kube = memo.kube
    role = getattr(memo, "epp_cluster_role", None) or DEFAULT_EPP_CLUSTER_ROLE
    outcome = reconcile(kube, body, role)
    _post(kube, body, outcome.events, logger)
    if outcome.failed:
        raise kopf.TemporaryError("API call failed; retrying", delay=RETRY_DELAY)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile_deployment(body: kopf.Body, memo: Any, logger: Log, **_: Any) -> None:
    _run(memo, dict(body), logger)


@kopf.daemon(GROUP, VERSION, PLURAL, id="adapters", cancellation_timeout=5.0)
async def sync_adapters_forever(
    body: kopf.Body, memo: Any, logger: Log, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    """Per CR, while it exists: every ready engine pod holds exactly spec.adapters
    (adapter_sync.py), checked every --adapter-sync-seconds."""
    seconds = float(getattr(memo, "adapter_sync_seconds", DEFAULT_ADAPTER_SYNC_SECONDS))
    meta = dict(body["metadata"])
    while not stopped:
        try:
            events = await asyncio.to_thread(
                sync_adapters, memo.kube, meta["namespace"], meta["name"]
            )
            _post(memo.kube, dict(body), events, logger)
        except Exception:  # the next pass retries; a daemon that died would never sync again
            logger.exception("adapter sync failed")
        await asyncio.sleep(seconds)


def _on_child(body: kopf.Body, memo: Any, logger: Log) -> None:
    owner = controller_of(dict(body))
    namespace = body.get("metadata", {}).get("namespace")
    if owner is None or not namespace:
        return
    cr = memo.kube.get_cr(namespace, owner["name"])
    if cr is None or cr["metadata"].get("uid") != owner.get("uid"):
        return  # the CR is gone (garbage collection is removing its children) or replaced
    _run(memo, cr, logger)


for _group, _version, _plural in CHILD_RESOURCES:

    @kopf.on.event(_group, _version, _plural, labels=OURS, id=f"child-{_plural}")
    def _child_event(body: kopf.Body, memo: Any, logger: Log, **_: Any) -> None:
        """A child changed or vanished: put it back as the spec says, refresh status."""
        _on_child(body, memo, logger)
