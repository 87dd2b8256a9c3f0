"""`Liveness`: a stall is pending work and no step that moved anything for longer than a bound."""

from __future__ import annotations

from mstar.engine.server.liveness import STALL_MULTIPLE, Liveness


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_engine_is_never_stalled() -> None:
    clock = Clock()
    live = Liveness(30.0, clock)
    clock.now += 3600
    assert live.stall() is None
    live.woke()  # work after a long idle spell: counted from now, not from the last step
    clock.now += 29
    assert live.stall() is None
    clock.now += 2
    reason = live.stall()
    assert reason is not None and "no step completed for 31.0s" in reason


def test_steps_that_move_keep_it_live_and_steps_that_hold_do_not() -> None:
    clock = Clock()
    live = Liveness(10.0, clock)
    live.woke()
    for _ in range(5):
        clock.now += 4
        live.stepped(0.01, progressed=True)
    assert live.stall() is None
    for _ in range(3):  # held steps: they return, but nothing runs
        clock.now += 4
        live.stepped(0.01, progressed=False)
    assert live.stall() is not None
    live.idle()
    assert live.stall() is None


def test_the_bound_grows_with_the_slowest_step_above_its_floor() -> None:
    clock = Clock()
    live = Liveness(2.0, clock)
    live.woke()
    clock.now += 5.0
    live.stepped(5.0, progressed=True)
    assert live.bound() == STALL_MULTIPLE * 5.0
    clock.now += STALL_MULTIPLE * 5.0 - 0.5
    assert live.stall() is None
    clock.now += 1.0
    reason = live.stall()
    assert reason is not None and "slowest step, 5.00s" in reason


def test_a_zero_floor_disables_the_check() -> None:
    clock = Clock()
    live = Liveness(0.0, clock)
    live.woke()
    clock.now += 1e6
    assert live.stall() is None
