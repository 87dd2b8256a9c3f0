"""`mstar-operator`: run the Kopf operator (handlers in `mstar.operator.handlers`)."""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"
DEFAULT_RESYNC_SECONDS = 300.0
DEFAULT_ADAPTER_SYNC_SECONDS = 10.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mstar-operator", description=__doc__)
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="Watch only this namespace (repeatable; exact names). Default: all.",
    )
    parser.add_argument(
        "--liveness",
        default=DEFAULT_LIVENESS,
        help="URL the liveness endpoint listens on ('' disables).",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=float(os.environ.get("MSTAR_RESYNC_SECONDS", DEFAULT_RESYNC_SECONDS)),
        help="Reconcile every MStarDeployment this often, events or not (0 disables).",
    )
    parser.add_argument(
        "--adapter-sync-seconds",
        type=float,
        default=float(os.environ.get("MSTAR_ADAPTER_SYNC_SECONDS", DEFAULT_ADAPTER_SYNC_SECONDS)),
        help="How often each MStarDeployment's ready engine pods are brought to spec.adapters "
        "(LoRA load/unload calls); a spec change is picked up within this.",
    )
    parser.add_argument(
        "--epp-cluster-role",
        default=os.environ.get("MSTAR_EPP_CLUSTER_ROLE"),
        help="ClusterRole each endpoint picker is bound to in its namespace (spec.router; "
        "default: mstar-epp, the chart's).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="Debug logging.")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # kopf, kubernetes and PyYAML come with the `operator` extra, not with the engine: the
    # README's first command installs this script without them.
    try:
        import kopf

        from . import handlers  # noqa: F401  (registers the handlers)
        from .router import DEFAULT_EPP_CLUSTER_ROLE
    except ModuleNotFoundError as exc:
        sys.exit(
            f"mstar-operator: the Python package {exc.name!r} is missing; the operator needs "
            "its extra: pip install 'mstar[operator]' (or -e '.[operator]' in a checkout)"
        )

    kopf.configure(verbose=args.verbose, log_prefix=True)  # [namespace/name] on each line
    # One active replica (Recreate strategy in the chart): no Kopf peering CRDs needed.
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(
            namespaces=list(args.namespace),
            resync_seconds=args.resync_seconds,
            adapter_sync_seconds=args.adapter_sync_seconds,
            epp_cluster_role=args.epp_cluster_role or DEFAULT_EPP_CLUSTER_ROLE,
        ),
    )


if __name__ == "__main__":
    main()
