"""Terminal progress drawing shared by the commands: ``fairpipeline plan``'s bar
(:class:`django_fairqueue.batches.ProgressBar`), fairbench's live cell line and the peer
comparison's (``benchmarks/compare``)."""

from __future__ import annotations

import time

#: Erase the current terminal line and return to its start.
CLEAR_LINE = "\r\x1b[2K"


def bar(fraction: float, width: int = 20) -> str:
    """``[#####...............]`` for ``fraction`` (clamped to 0..1), ``width`` cells inside."""
    filled = int(width * min(max(fraction, 0.0), 1.0))
    return "[" + "#" * filled + "." * (width - filled) + "]"


class Throttle:
    """Say when a live line is due for a redraw: at most ``per_second`` times a second, and
    always for the final state (a bar that reaches 100% is drawn even if it just was)."""

    def __init__(self, per_second: float = 10.0) -> None:
        self.interval = 1.0 / per_second
        self._last = -float("inf")

    def due(self, *, final: bool = False) -> bool:
        now = time.monotonic()
        if not final and now - self._last < self.interval:
            return False
        self._last = now
        return True
