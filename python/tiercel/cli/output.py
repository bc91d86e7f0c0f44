"""Output for the `tiercel` command: sizes, times, tables, progress lines, JSON."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Collection, Sequence, TextIO

from .._text import count

__all__ = ["Progress", "count", "fmt_bytes", "fmt_ratio", "fmt_time", "json_out", "table"]


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        x /= 1024
        if x < 1024 or unit == "PiB":
            return f"{x:.1f} {unit}"
    raise AssertionError


def fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def fmt_ratio(raw: int, stored: int) -> str:
    return f"{raw / stored:.2f}x" if stored else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Collection[int] = frozenset()) -> list[str]:
    """Rows as aligned text lines (header first); columns in `right` are right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in cells
    ]


class Progress:
    """A progress bar on one stderr line, redrawn in place at most ten times a second: done of
    total units (pluralized), and with a byte total, bytes, rate and time left. Drawn on a
    terminal only; elsewhere only `finish`'s message is written, as one line."""

    WIDTH = 24

    def __init__(self, label: str, total: int, total_bytes: int | None = None, *, unit: str = "",
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self.label, self.total, self.total_bytes, self.unit = label, total, total_bytes, unit
        self.done = 0
        self.nbytes = 0
        self._clock = clock
        self._t0 = clock()
        self._drawn = 0.0

    def _rate(self) -> str:
        """Bytes per second so far and the time left at that rate ("" until there is a rate)."""
        elapsed = self._clock() - self._t0
        if self.total_bytes is None or elapsed <= 0 or self.nbytes <= 0:
            return ""
        rate = self.nbytes / elapsed
        left = max(0, self.total_bytes - self.nbytes) / rate
        return f"  {fmt_bytes(int(rate))}/s  ETA {int(left) // 60}:{int(left) % 60:02d}"

    def _text(self) -> str:
        frac = self.nbytes / self.total_bytes if self.total_bytes else (self.done / self.total if self.total else 1.0)
        fill = min(self.WIDTH, int(frac * self.WIDTH))
        text = f"{self.label} [{'#' * fill}{'.' * (self.WIDTH - fill)}] {self.done}/"
        text += count(self.total, self.unit) if self.unit else str(self.total)
        if self.total_bytes is not None:
            text += f"  {fmt_bytes(self.nbytes)} / {fmt_bytes(self.total_bytes)}" + self._rate()
        return text

    def update(self, done: int | None = None, nbytes: int | None = None) -> None:
        if done is not None:
            self.done = done
        if nbytes is not None:
            self.nbytes = nbytes
        if self.tty:
            now = self._clock()
            if now - self._drawn >= 0.1 or self.done == self.total:
                self._drawn = now
                self.stream.write("\r" + self._text() + "\x1b[K")
                self.stream.flush()

    def finish(self, message: str | None = None) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
        if message:
            self.stream.write(message + "\n")
        self.stream.flush()


def json_out(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")
