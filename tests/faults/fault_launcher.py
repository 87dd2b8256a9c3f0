"""`mstar-engine` with a fault switch: ``python fault_launcher.py SWITCH_FILE serve ...``.

The engine's `step` reads nothing new until ``SWITCH_FILE`` appears; then, per its content:
``hang`` blocks the step forever (a kernel that spins, a copy that never lands, a device that
stops answering), ``raise`` makes it raise. A test hook only: production code has no switch.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path


def install(switch: Path) -> None:
    from mstar.engine.engine import LLMEngine

    real_step = LLMEngine.step
    never = threading.Event()

    def step(self: LLMEngine) -> list:
        if switch.exists():
            fault = switch.read_text().strip()
            if fault == "hang":
                never.wait()
            if fault == "raise":
                raise RuntimeError("injected fault: the step raised")
        return real_step(self)

    LLMEngine.step = step  # type: ignore[method-assign]


if __name__ == "__main__":
    install(Path(sys.argv[1]))
    from mstar.engine.cli import main

    sys.exit(main(sys.argv[2:]))
