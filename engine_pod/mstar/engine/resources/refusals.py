"""Refusals beyond the seed's: a terminal one that names the request it is about.

The seed's `AdmitRuntimeError(message)` says a request can never be served, but not which one;
a step admits many rows at once, so the scheduler would have to re-admit them one by one to
find it. A resource that knows refuses with `RequestRejected`, which is an `AdmitRuntimeError`
(every caller that answers the seed class answers it the same way) carrying the request id.
"""

from __future__ import annotations

from dataclasses import dataclass

from mstar.engine.resources.step import AdmitFailedReason, AdmitRuntimeError

__all__ = ["RequestRejected", "reason_name"]


@dataclass
class RequestRejected(AdmitRuntimeError):
    """`AdmitRuntimeError` for request ``request_id``: no eviction or reload cures it."""

    request_id: str


def reason_name(reason: AdmitFailedReason | None) -> str:
    """The refusal's kind as metrics and events name it: the seed class it is an instance of
    (`RequestRejected` counts as `AdmitRuntimeError`), else its own class name."""
    for cls in type(reason).__mro__[:-2]:  # (not the bare AdmitFailedReason, nor object)
        if cls.__module__ == AdmitRuntimeError.__module__:
            return cls.__name__
    return type(reason).__name__
