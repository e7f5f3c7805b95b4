"""The demo's live progress: one status line, rewritten in place on a terminal.

:class:`ProgressLine` writes ``\\r``-updated text at most every 0.2 s (nothing when
disabled); :func:`status_line` formats what the parent knows of the run (step, loss,
examples/s, rows published/s, predictor lag, freshness p99).
"""

from __future__ import annotations

import time
from typing import Optional, TextIO

__all__ = ["ProgressLine", "status_line", "fmt_rate"]


class ProgressLine:
    """A single updating status line on ``stream`` (nothing when not ``enabled``)."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self._last = 0.0
        self._width = 0

    def update(self, text: str, force: bool = False) -> None:
        """Show ``text``; skipped within 0.2 s of the last update unless ``force``."""
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < 0.2):
            return
        self._last = now
        pad = max(0, self._width - len(text))  # blank what a longer last line left
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        """End the line (a newline) so that later output starts on its own line."""
        if self.enabled and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


def fmt_rate(x: float) -> str:
    """A per-second rate, short: ``950``, ``12.3K``."""
    return f"{x / 1e3:.1f}K" if x >= 1e3 else f"{x:.0f}"


def status_line(*, elapsed: float, phase: str, step: int, steps: Optional[int], loss: float,
                examples_per_s: float, rows_per_s: float, lag: Optional[int],
                fresh_p99: Optional[float]) -> str:
    """The progress text: ``elapsed`` s, ``steps`` None = unbounded, ``fresh_p99`` in s."""
    return (f"[{elapsed:5.1f}s] {phase} step {step}/{steps if steps else '∞'}  "
            f"loss {loss:.4f}  {fmt_rate(examples_per_s)} ex/s  "
            f"pub {fmt_rate(rows_per_s)} rows/s  lag {lag if lag is not None else '-'}  "
            f"fresh p99 {'-' if fresh_p99 is None else f'{fresh_p99 * 1e3:.0f} ms'}")
