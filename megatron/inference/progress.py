"""A progress line on stderr: redrawn in place on a terminal, otherwise one line per 10 %."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, what: str, enabled: bool = True, stream=None):
        self.total, self.what, self.enabled = max(total, 1), what, enabled
        self.stream = stream or sys.stderr
        self.done, self.start, self.next_line = 0, time.perf_counter(), 0.1
        self.tty = self.stream.isatty()

    def update(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        if not self.enabled:
            return
        fraction = self.done / self.total
        if self.tty:
            self.stream.write("\r" + self._line())
        elif fraction >= self.next_line or self.done == self.total:
            self.stream.write(self._line() + "\n")
            self.next_line = (int(fraction * 10) + 1) / 10
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _line(self) -> str:
        elapsed = time.perf_counter() - self.start
        return f"{self.what}: {self.done}/{self.total} ({100 * self.done / self.total:.0f}%) {elapsed:.1f}s"
