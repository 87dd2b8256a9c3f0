"""Kopf handlers: every trigger runs the same idempotent `reconcile` pass.

Triggers: the CR is created, changed or found at start-up (resume), and any change or deletion of
a child labelled as ours (drift correction and status from the Deployment's progress). Importing
this module registers the handlers on Kopf's default registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
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
    memo.tasks = []
    seconds = float(getattr(memo, "resync_seconds", DEFAULT_RESYNC_SECONDS) or 0)
    if seconds > 0:
        memo.tasks.append(asyncio.create_task(_every(seconds, _resync_one, memo, logger)))
    seconds = float(getattr(memo, "adapter_sync_seconds", DEFAULT_ADAPTER_SYNC_SECONDS) or 0)
    if seconds > 0:
        memo.tasks.append(asyncio.create_task(_every(seconds, _sync_adapters_one, memo, logger)))


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    for task in getattr(memo, "tasks", []):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


PerCR = Callable[[Any, dict[str, Any], Log], None]


async def _every(seconds: float, each: PerCR, memo: Any, logger: Log) -> None:
    """Run `each` on every CR periodically, in a thread. The resync (reconcile) heals what no
    watched event announces (e.g. a foreign object squatting on a child's name goes away),
    like controller-runtime's resync period; the adapter sync is level-based the same way.
    One loop for all CRs rather than a Kopf daemon per CR: daemons put a finalizer on every
    CR, and a CR would then not go away while the operator is down."""
    while True:
        await asyncio.sleep(seconds)
        try:
            crs = await asyncio.to_thread(_list_crs, memo)
        except Exception:  # keep going; the next period retries
            logger.exception("listing MStarDeployments failed")
            continue
        for cr in crs:
            try:
                await asyncio.to_thread(each, memo, cr, logger)
            except Exception:  # one CR's failure must not stop the others
                logger.exception("%s of %s failed", each.__name__, cr["metadata"]["name"])


def _list_crs(memo: Any) -> list[dict[str, Any]]:
    kube: Kube = memo.kube
    namespaces: list[str] = list(getattr(memo, "namespaces", None) or [])
    listings: list[Any] = (
        [kube.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL) for ns in namespaces]
        if namespaces
        else [kube.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)]
    )
    return [dict(item) for listing in listings for item in listing["items"]]


def _resync_one(memo: Any, cr: dict[str, Any], logger: Log) -> None:
    with contextlib.suppress(kopf.TemporaryError):  # in status already; next period retries
        _run(memo, cr, logger)


def _sync_adapters_one(memo: Any, cr: dict[str, Any], logger: Log) -> None:
    """Every ready engine pod of the CR holds exactly spec.adapters (adapter_sync.py)."""
    _post(memo.kube, cr, sync_adapters(memo.kube, cr), logger)


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
