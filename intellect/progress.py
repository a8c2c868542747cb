"""Where a long run is: one progress line every ``interval`` seconds (or ``every`` steps), never silence.

Every command that runs longer than a few seconds (pretraining, DiLoCo workers and their coordinator, RL
steps, held-out evaluation, tokenizer training, corpus scans, checkpoint uploads) reports through a
:class:`Progress`. Its lines go to the ``intellect.progress`` logger (which the flows route to the
console and to Prefect's run logs); on a terminal a live line on stderr is redrawn besides. A
``heartbeat`` thread repeats the last known position while a step is still running, so no more than
``interval`` seconds pass between two lines even when one step takes minutes. The clock and the writers
are parameters, so tests drive it without waiting::

    >>> now = [0.0]
    >>> lines = []
    >>> p = Progress("pretrain", 30, interval=10, clock=lambda: now[0], write=lines.append, tty=False)
    >>> p.begin("30 steps on cpu")
    >>> for step in range(1, 31):
    ...     now[0] += 2.0
    ...     _ = p.update(step, tokens=500, loss=3.0 - step / 20)
    >>> p.close()
    >>> print("\\n".join(lines))
    pretrain: 30 steps on cpu
    pretrain: step 1/30 (3%) | loss 2.9500 | 2s elapsed
    pretrain: step 6/30 (20%) | loss 2.7000 | 250 tokens/s | 12s elapsed | ETA 48s
    pretrain: step 11/30 (37%) | loss 2.4500 | 250 tokens/s | 22s elapsed | ETA 38s
    pretrain: step 16/30 (53%) | loss 2.2000 | 250 tokens/s | 32s elapsed | ETA 28s
    pretrain: step 21/30 (70%) | loss 1.9500 | 250 tokens/s | 42s elapsed | ETA 18s
    pretrain: step 26/30 (87%) | loss 1.7000 | 250 tokens/s | 52s elapsed | ETA 8s
    pretrain: step 30/30 (100%) | loss 1.5000 | 250 tokens/s | 1m00s elapsed
    pretrain: done, 30 steps in 1m00s

The interval a run uses is ``logging.progress_seconds`` of its config (:func:`configure`); it defaults to
:data:`DEFAULT_INTERVAL`.
"""

from __future__ import annotations

import contextvars
import logging
import math
import shutil
import sys
import threading
import time
from typing import Any, Callable, TextIO

log = logging.getLogger("intellect.progress")

DEFAULT_INTERVAL = 30.0  # seconds between two lines at most, whatever a step takes
REDRAW = 0.25  # seconds between two redraws of a terminal's live line
LOGGER = log.name

_interval = DEFAULT_INTERVAL


def configure(seconds: float) -> None:
    """The interval of every :class:`Progress` made after this call without its own (a run's
    ``logging.progress_seconds``: the reporting modules deep in a run, such as tokenizer training or a
    checkpoint upload, have no config of their own)."""
    global _interval
    if not seconds > 0:
        raise ValueError(f"a progress interval is positive (got {seconds})")
    _interval = float(seconds)


def interval() -> float:
    """The interval :func:`configure` set (:data:`DEFAULT_INTERVAL` until then)."""
    return _interval


def to_stderr() -> None:
    """For a command that runs without Prefect (which routes the lines itself, ``flows/progress.py``):
    progress lines on stderr, whatever else the process logs."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)


def duration(seconds: float | None) -> str:
    """A short human duration.

    >>> [duration(s) for s in (0.4, 45, 185, 3720, 200000, None, math.inf)]
    ['0s', '45s', '3m05s', '1h02m', '2d07h', '?', '?']
    """
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def quantity(x: float) -> str:
    """A count or rate in at most four significant characters plus a suffix.

    >>> [quantity(x) for x in (0.25, 7, 583.4, 12345, 2_500_000, 3.2e9)]
    ['0.25', '7', '583', '12.3k', '2.50M', '3.20G']
    """
    if x != x:
        return "nan"
    a = abs(x)
    if a >= 1e9:
        return f"{x / 1e9:.2f}G"
    if a >= 1e6:
        return f"{x / 1e6:.2f}M"
    if a >= 1e4:
        return f"{x / 1e3:.1f}k"
    if a >= 10 or x == int(x):
        return f"{x:.0f}"
    return f"{x:.2g}"


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1000 else quantity(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def progress_line(what: str, done: int, total: int | None, unit: str = "step", *, elapsed: float = 0.0,
                  rate: str = "", eta: float | None = None, fields: dict[str, Any] | None = None,
                  idle: float = 0.0, state: str = "") -> str:
    """One progress line: position, the caller's fields, the rate, elapsed time, time left, and how long
    the current step has been running when that is longer than the line interval (a heartbeat).

    >>> progress_line("DiLoCo", 3, 30, "outer step", elapsed=95, eta=855, fields={"loss": 2.5})
    'DiLoCo: outer step 3/30 (10%) | loss 2.5000 | 1m35s elapsed | ETA 14m15s'
    >>> progress_line("BPE tokenizer", 12000, None, "document", elapsed=4, rate="3000 documents/s")
    'BPE tokenizer: 12,000 documents | 3000 documents/s | 4s elapsed'
    >>> progress_line("w0", 40, 300, elapsed=200, idle=45, state="all-reduce")
    'w0: step 40/300 (13%) | 3m20s elapsed | all-reduce for 45s'
    >>> progress_line("checkpoint 7", 0, None, "", elapsed=31, idle=31, state="writing 1.2 GB")
    'checkpoint 7: 31s elapsed | writing 1.2 GB for 31s'
    """
    if not unit:
        parts = []
    elif total is not None:
        pct = 100.0 * done / total if total else 100.0
        parts = [f"{unit} {done:,}/{total:,} ({pct:.0f}%)"]
    else:
        parts = [f"{done:,} {unit}{'' if done == 1 else 's'}"]
    parts += [f"{k.replace('_', ' ')} {_value(v)}" for k, v in (fields or {}).items() if v is not None]
    if rate:
        parts.append(rate)
    parts.append(f"{duration(elapsed)} elapsed")
    if idle > 0:
        parts.append(f"{state or 'no ' + (unit or 'step') + ' finished'} for {duration(idle)}")
    elif eta is not None and total is not None and done < total:
        parts.append(f"ETA {duration(eta)}")
    return f"{what}: " + " | ".join(parts)


_live: list["Progress"] = []  # the terminal's live lines, innermost last: only the innermost draws
_live_lock = threading.Lock()


class Progress:
    """The position of one long loop: ``update`` it after each step; lines are written when due.

    A line is due at the first update, every ``every`` steps (0: by time only), when ``interval``
    seconds passed since the last line, at the last step (``total``), and at :meth:`close`.
    :meth:`poll` (called by the heartbeat thread, or a test) writes a line when ``interval`` seconds
    passed with no update, saying for how long. ``write`` replaces the logger (tests); ``tty`` the
    stderr check; ``clock`` ``time.monotonic``.
    """

    def __init__(self, what: str, total: int | None = None, *, unit: str = "step", start: int = 0,
                 interval: float | None = None, every: int = 0, heartbeat: bool = False,
                 clock: Callable[[], float] = time.monotonic, write: Callable[[str], None] | None = None,
                 stream: TextIO | None = None, tty: bool | None = None, level: int = logging.INFO):
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.interval = _interval if interval is None else interval
        if not self.interval > 0:
            raise ValueError(f"a progress interval is positive (got {self.interval})")
        self.clock, self.level = clock, level
        self._write = write or (lambda line: log.log(level, "%s", line))
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self._isatty(self.stream) if tty is None else tty
        self.start = self.done = start
        self.tokens = 0
        # rates and the ETA count from the first update: loading a model or a corpus is no step
        self.first: tuple[float, int, int] | None = None  # (time, done, tokens) at the first update
        self.fields: dict[str, Any] = {}
        self.state = ""  # what the current step is doing, for heartbeat lines (e.g. "all-reduce")
        self.state_since = 0.0
        self.t0 = self.last_line = self.last_update = self.last_draw = clock()
        self.lines = 0
        self.begun = self.closed = self.quiet = False
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._heartbeat = heartbeat

    @staticmethod
    def _isatty(stream: TextIO) -> bool:
        try:
            return stream.isatty()
        except (AttributeError, ValueError):  # a closed or replaced stream
            return False

    # ------------------------------------------------------------------ lines

    def begin(self, message: str = "", *, quiet: bool = False) -> None:
        """The first line: what is starting (e.g. "training BPE tokenizer on 3 files"); starts the
        heartbeat thread if asked for. ``quiet``: no first line (nor a last one, unless a heartbeat
        wrote some), for what is usually short (a checkpoint upload) but must not be silent when not."""
        with self._lock:
            self.begun, self.quiet = True, quiet
            self.t0 = self.last_line = self.last_update = self.clock()
            if not quiet:
                self.emit(f"{self.what}: {message or 'starting'}")
        if self._heartbeat and self._thread is None:
            self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._beat,),
                                            name=f"progress-{self.what}", daemon=True)
            self._thread.start()
        if self.tty and not quiet:
            with _live_lock:
                _live.append(self)

    def note(self, message: str) -> None:
        """A line of its own now (a phase starting: "evaluating checkpoint 3 on 64 sequences")."""
        with self._lock:
            self.emit(f"{self.what}: {message}")

    def emit(self, line: str) -> None:
        """Write ``line`` through the logger (clearing a live terminal line around it)."""
        with self._lock:
            self.last_line = self.clock()
            self.lines += 1
            self._clear()
            self._write(line)
            self._draw(force=True)

    def line(self, now: float | None = None) -> str:
        """The current position as a line."""
        now = self.clock() if now is None else now
        idle = now - (self.state_since if self.state else self.last_update)
        idle = idle if now - self.last_update >= self.interval else 0.0
        rate, eta = "", None
        if self.first is not None and self.last_update > self.first[0] and self.done > self.first[1]:
            seconds, moved = self.last_update - self.first[0], self.done - self.first[1]
            rate = self._rate(seconds, moved, self.tokens - self.first[2])
            if self.total is not None:
                eta = seconds / moved * (self.total - self.done) - (now - self.last_update)
        return progress_line(self.what, self.done, self.total, self.unit, elapsed=now - self.t0, rate=rate,
                             eta=None if eta is None else max(eta, 0.0), fields=self.fields, idle=idle,
                             state=self.state)

    def _rate(self, seconds: float, moved: int, tokens: int) -> str:
        if tokens:
            return f"{quantity(tokens / seconds)} tokens/s"
        per = moved / seconds
        return f"{quantity(per)} {self.unit or 'item'}s/s" if per >= 1 else f"{quantity(1 / per)} s/{self.unit or 'item'}"

    # ------------------------------------------------------------------ updates

    def update(self, done: int | None = None, *, advance: int = 1, tokens: int = 0, **fields: Any) -> str | None:
        """Move to ``done`` (or by ``advance``), add ``tokens`` to the rate's count, keep ``fields`` (shown
        in every later line until replaced; None hides one); the line written, if one was due."""
        with self._lock:
            now = self.clock()
            first = self.first is None
            self.done = self.done + advance if done is None else done
            self.tokens += tokens
            if first:
                self.first = (now, self.done, self.tokens)
            self.fields.update(fields)
            self.last_update, self.state = now, ""
            due = (first or now - self.last_line >= self.interval
                   or (self.every and self.done % self.every == 0)
                   or (self.total is not None and self.done >= self.total))
            if due:
                line = self.line(now)
                self.emit(line)
                return line
            self._draw()
            return None

    def waiting(self, state: str) -> None:
        """Say what the current step is doing (heartbeat lines name it): "all-reduce", "boundary"."""
        with self._lock:
            self.state, self.state_since = state, self.clock()

    def poll(self) -> str | None:
        """The heartbeat: a line if ``interval`` seconds passed since the last one."""
        with self._lock:
            if self.closed or self.clock() - self.last_line < self.interval:
                self._draw()
                return None
            line = self.line()
            self.emit(line)
            return line

    def _beat(self) -> None:
        # wakes when the next line falls due (at least every second, to redraw a terminal's live line)
        while True:
            with self._lock:
                due = self.last_line + self.interval - self.clock()
            if self._stop.wait(min(max(due, 0.01), 1.0)):
                return
            try:
                self.poll()
            except Exception:  # a reporting failure must never stop the run  # noqa: BLE001
                log.debug("progress heartbeat failed", exc_info=True)

    def close(self, message: str | None = None) -> None:
        """The last line: ``message``, or "done" with the count and the time."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            if self.closed:
                return
            if message is None and not (self.quiet and not self.lines):
                moved = self.done - self.start
                count = f"{moved:,} {self.unit}{'' if moved == 1 else 's'} in " if self.unit else ""
                message = f"done, {count}{duration(self.clock() - self.t0)}"
            if message:
                self.emit(f"{self.what}: {message}")
            self._clear()
            self.closed = True
        with _live_lock:
            if self in _live:
                _live.remove(self)
            if _live:
                _live[-1]._draw(force=True)

    def __enter__(self) -> Progress:
        if not self.begun:
            self.begin()
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.close(None if kind is None else f"stopped by {kind.__name__} at {self.unit} {self.done:,}")

    # ------------------------------------------------------------------ terminal

    def _mine(self) -> bool:
        return self.tty and not self.closed and bool(_live) and _live[-1] is self

    def _clear(self) -> None:
        if self._mine():
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        now = self.clock()
        if not self._mine() or (not force and now - self.last_draw < REDRAW):
            return
        self.last_draw = now
        width = shutil.get_terminal_size().columns - 1  # a wrapped line would not be cleared by \r
        self.stream.write("\r\x1b[K" + self.line(now)[:width])
        self.stream.flush()


__all__ = ["DEFAULT_INTERVAL", "LOGGER", "Progress", "configure", "duration", "interval", "progress_line", "quantity",
           "to_stderr"]
