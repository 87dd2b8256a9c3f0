"""`mstar-engine prestop`: the engine pod's preStop hook; returns once the pod is out of rotation.

Kubernetes runs the preStop hook before it sends SIGTERM. Meanwhile the terminating pod leaves
the Service endpoints and the inference pool's endpoint picker, but every router notices at its
own pace, and a SIGTERM now would refuse (503) what is still routed here. So the hook waits until
no request has arrived for `quiet_seconds` of its own run (each router has let go), at most
`timeout_seconds`, reading `since_last_request_s` from the server's `/ready`. The server keeps
serving meanwhile; the SIGTERM that follows drains what is in flight.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

DEFAULT_QUIET_SECONDS = 5.0
DEFAULT_TIMEOUT_SECONDS = 30.0
POLL_SECONDS = 0.5


def read_ready(url: str) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of GET `url`/ready; OSError when nothing answers."""
    try:
        with urllib.request.urlopen(url + "/ready", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def wait_out_of_rotation(
    url: str,
    quiet_seconds: float,
    timeout_seconds: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Block until no request arrived for `quiet_seconds` since this call began (or timeout).

    Returns why it stopped waiting. A server that does not answer or is not ready (already
    draining, engine dead) ends the wait at once: there is nothing left to protect.
    """
    start = clock()
    deadline = start + timeout_seconds
    while True:
        try:
            status, body = read_ready(url)
        except (OSError, ValueError) as exc:
            return f"server not reachable ({exc}); not waiting"
        if status != 200:
            return f"server not ready ({body.get('status')}); not waiting"
        now = clock()
        quiet = min(float(body["since_last_request_s"]), now - start)
        if quiet >= quiet_seconds:
            return f"out of rotation: no request for {quiet:.1f}s"
        if now >= deadline:
            return f"timed out after {now - start:.1f}s; requests still arrive ({quiet:.1f}s ago)"
        sleep(max(0.0, min(POLL_SECONDS, quiet_seconds - quiet, deadline - now)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="Where the engine server listens.")
    parser.add_argument("--port", type=int, default=8000, help="The engine server's port.")
    parser.add_argument(
        "--quiet-seconds",
        type=float,
        default=DEFAULT_QUIET_SECONDS,
        help="Out of rotation once no request has arrived for this long.",
    )
    parser.add_argument(
        "--timeout-seconds",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        help="Stop waiting after this long (then SIGTERM refuses late requests with 503).",
    )


def run(args: argparse.Namespace) -> int:
    """Always 0: a failing hook only adds an Event, and the SIGTERM drain follows regardless."""
    reason = wait_out_of_rotation(
        f"http://{args.host}:{args.port}", args.quiet_seconds, args.timeout_seconds
    )
    print(f"mstar-engine prestop: {reason}", flush=True)
    return 0
