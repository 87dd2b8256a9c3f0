"""Faults under steady streaming traffic, on a real `mstar-engine serve` process.

Each case breaks something while clients stream, then accounts for every request: finished,
refused with a status, or failed with an error; none lost, none hanging past its deadline. The
accounts and the measured detection times print at the end of the run ("fault accounts").
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable

from faults.harness import FaultyServer, record
from faults.traffic import Traffic

Start = Callable[..., FaultyServer]


def wait_status(server: FaultyServer, path: str, status: int, timeout: float) -> tuple[float, dict]:
    """Poll ``path`` until it answers ``status``; (when, body)."""
    end = time.monotonic() + timeout
    while True:
        code, body = server.get(path)
        if code == status:
            return time.monotonic(), body
        assert time.monotonic() < end, f"{path} still {code} {body}"
        time.sleep(0.05)


def test_hung_step_goes_red_within_its_bound_and_fails_its_requests(faulty_server: Start) -> None:
    server = faulty_server("--stall-timeout-seconds", "2", "--no-exit-on-engine-failure")
    with Traffic(server.url, clients=6, max_tokens=60) as traffic:
        traffic.wait_finished(3)
        hung_at = server.inject("hang")
        red_at, body = wait_status(server, "/health", 503, timeout=30)
        account = traffic.stop()
    account.check()
    detection = red_at - hung_at
    reason = body["error"]
    bound = float(re.search(r"bound ([0-9.]+)s", reason).group(1))  # type: ignore[union-attr]
    assert "no step completed" in reason, body
    assert 2.0 <= detection <= bound + 1.5, (detection, reason)
    stuck = account.in_flight_at(hung_at)
    assert stuck, "nothing was in flight when the step hung"
    # The step running when the switch flipped may still finish some; the rest end with the
    # stall's error event and [DONE], or, their add taken by the step that hung, a 503.
    ended = [o for o in stuck if o.kind != "finished"]
    assert ended and {o.detail for o in ended} <= {"error event: engine stalled", "503"}, account
    assert max(o.end for o in stuck) - hung_at <= bound + 1.5
    # Not ready either (routers stop sending), and a new request is refused, not queued.
    assert server.get("/ready")[0] == 503
    status, err = server.post("/v1/completions", {"prompt": [5], "max_tokens": 2})
    assert status == 503 and "stalled" in err["error"]["message"]
    record("hung step", account, health_red_after_s=detection, bound_s=bound)


def test_engine_exception_fails_in_flight_and_exits_1(faulty_server: Start) -> None:
    server = faulty_server()
    with Traffic(server.url, clients=6, max_tokens=60) as traffic:
        traffic.wait_finished(3)
        broke_at = server.inject("raise")
        code = server.wait_exit(15)
        exited = time.monotonic() - broke_at
        account = traffic.stop()
    account.check()
    assert code == 1, server.server_log()
    assert exited < 5.0
    hit = [o for o in account.in_flight_at(broke_at) if o.kind != "finished"]
    assert hit and {o.detail for o in hit} <= {"error event: engine failure", "503"}, account
    assert "engine loop died" in server.server_log()
    record("step raised", account, exit_code=code, exited_after_s=exited)


def test_sigkill_mid_stream_ends_every_connection_within_a_second(faulty_server: Start) -> None:
    server = faulty_server()
    with Traffic(server.url, clients=6, max_tokens=60) as traffic:
        traffic.wait_finished(3)
        killed_at = server.signal(signal.SIGKILL)
        server.wait_exit(10)
        account = traffic.stop()
    account.check()
    # A stream whose last bytes were already sent may still finish from the socket's buffer.
    cut = [o for o in account.in_flight_at(killed_at) if o.kind != "finished"]
    assert cut and {o.kind for o in cut} == {"failed"}, account
    slowest = max(o.end for o in account.in_flight_at(killed_at)) - killed_at
    assert slowest < 1.0, account
    record("SIGKILL", account, streams_cut=len(cut), last_ended_after_s=slowest)


def test_sigterm_drains_in_flight_refuses_new_and_exits_0(faulty_server: Start) -> None:
    server = faulty_server("--shutdown-grace-seconds", "60")
    # Staggered lengths: the drain lasts until the longest stream ends, and the clients whose
    # streams ended first send new requests meanwhile (without it, every stream could end in
    # the same step and the server exit before anyone asked again).
    with Traffic(server.url, clients=6, max_tokens=60, stagger=60) as traffic:
        traffic.wait_finished(3)
        term_at = server.signal(signal.SIGTERM)
        code = server.wait_exit(60)
        account = traffic.stop()
    account.check()
    assert code == 0, server.server_log()
    # Every stream the server had accepted finishes (one sent as the signal landed is refused).
    drained = [o for o in account.in_flight_at(term_at) if o.kind != "refused"]
    assert drained and {o.kind for o in drained} == {"finished"}, account
    refused = account.details("refused")
    assert refused and set(refused) == {"503 Retry-After"}, account
    after = [o for o in account.outcomes if o.start > term_at and o.kind != "refused"]
    # A request sent as the process exits finds its socket closed or reset, or nothing there.
    assert {o.detail for o in after} <= {
        "nothing listening",
        "connection ended (ServerDisconnectedError)",
        "connection ended (ClientOSError)",
    }, account
    record("SIGTERM drain", account, exit_code=code, drained=len(drained))


def test_a_deadline_ends_a_request_on_a_hung_engine(faulty_server: Start) -> None:
    """With the stall check off, the request's own deadline still frees its client."""
    server = faulty_server("--stall-timeout-seconds", "0", "--request-timeout-seconds", "60")
    server.inject("hang")
    sent = time.monotonic()
    status, body = server.post(
        "/v1/completions", {"prompt": [5, 6], "max_tokens": 4, "timeout": 1.5}
    )
    took = time.monotonic() - sent
    assert status == 504 and body["error"]["code"] == "deadline_exceeded", body
    assert "1.5s" in body["error"]["message"]
    assert 1.4 <= took < 4.0
    assert server.get("/health")[0] == 200  # the check is off: only the deadline speaks
    status, body = server.post("/v1/completions", {"prompt": [5], "timeout": "soon"})
    assert status == 400 and body["error"]["param"] == "timeout"
    record("deadline on a hung engine", f"504 after {took:.2f}s")


def test_a_full_host_pool_refuses_or_recomputes_never_crashes(faulty_server: Start) -> None:
    """32 device pages and ~20 host pages for 8 streams that need 16 pages each: offloads
    fill the host pool; what does not fit is recomputed or refused, the engine stays up,
    and once the load stops (some clients leave mid-stream) every page is free again."""
    server = faulty_server(
        "--num-pages", "32", "--host-offload-gb", "0.00002", "--max-num-seqs", "8"
    )
    with Traffic(server.url, clients=8, max_tokens=60, disconnect_every=5) as traffic:
        traffic.wait_finished(8, timeout=120)
        account = traffic.stop()
    account.check()
    assert server.get("/health")[0] == 200
    assert account.count("failed") == 0, account
    offloads = server.metric("mstar:offloads_total")
    recomputed = server.metric("mstar:recomputations_total")
    assert offloads > 0 and recomputed > 0  # the host pool filled: victims were recomputed
    assert server.metric("mstar:host_kv_usage_perc") == 0.0
    assert server.metric("mstar:kv_cache_usage_perc") == 0.0
    record(
        "host pool full",
        account,
        offloads=f"{offloads:.0f}",
        recomputations=f"{recomputed:.0f}",
    )
