"""The progress lines of long runs (:mod:`intellect.progress`), driven by a fake clock: when a line is
due, what it says, the heartbeat of a step that runs long, the terminal's live line, the config bound."""

from __future__ import annotations

import io
import logging
import re

import pytest

from intellect import progress
from intellect.config import ConfigError, SmokeConfig, load_config
from intellect.progress import DEFAULT_INTERVAL, Progress, duration, progress_line, quantity

STEP = re.compile(r": step (\d+)/(\d+)")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def make(total: int | None = 10, clock: Clock | None = None, **kw) -> tuple[Progress, list[str], Clock]:
    clock = clock or Clock()
    lines: list[str] = []
    kw.setdefault("tty", False)
    return Progress("run", total, clock=clock, write=lines.append, **kw), lines, clock


def test_lines_come_at_the_first_step_every_interval_and_the_last():
    p, lines, clock = make(100, interval=5)
    p.begin("100 steps on cpu")
    for n in range(1, 101):
        clock.now += 1.5
        p.update(n, tokens=300, loss=2.0)
    p.close()
    assert lines[0] == "run: 100 steps on cpu" and lines[-1] == "run: done, 100 steps in 2m30s"
    steps = [int(m.group(1)) for line in lines if (m := STEP.search(line))]
    assert steps[0] == 1 and steps[-1] == 100 and steps == sorted(steps)
    # a line whenever 5 s passed: at 1.5 s per step, every 4th step after the first
    assert steps[1:4] == [5, 9, 13]
    assert "loss 2.0000" in lines[2] and "200 tokens/s" in lines[2] and "ETA 2m22s" in lines[2]


def test_rates_and_the_eta_leave_out_what_came_before_the_first_step():
    p, lines, clock = make(10, interval=20, every=1)
    p.begin()
    clock.now += 60  # loading a model and a corpus
    assert p.update(1, tokens=100) == "run: step 1/10 (10%) | 1m00s elapsed"
    clock.now += 2
    assert p.update(2, tokens=100) == "run: step 2/10 (20%) | 50 tokens/s | 1m02s elapsed | ETA 16s"
    clock.now += 30  # after the last update, the rate stays that of the steps; the ETA runs down
    assert p.line() == "run: step 2/10 (20%) | 50 tokens/s | 1m32s elapsed | no step finished for 30s"
    clock.now -= 29
    assert p.line().endswith("| ETA 15s")


def test_every_n_steps_as_well_as_by_time():
    p, lines, clock = make(20, interval=30, every=5)
    p.begin()
    for n in range(1, 21):
        clock.now += 0.1
        p.update(n)
    steps = [int(m.group(1)) for line in lines if (m := STEP.search(line))]
    assert steps == [1, 5, 10, 15, 20]


def test_no_gap_longer_than_the_interval_when_one_step_runs_long():
    """The heartbeat (what the thread calls every second, here by hand) repeats the position and
    says for how long the step has been running; the gap between two lines never exceeds the interval
    plus the heartbeat's tick."""
    p, lines, clock = make(3, interval=10)
    p.begin()
    times = [clock.now]
    write = p._write

    def timed(line: str) -> None:
        times.append(clock.now)
        write(line)

    p._write = timed
    for n, seconds in enumerate((4, 95, 3), start=1):  # the second step takes 95 s
        for _ in range(seconds):
            clock.now += 1
            p.poll()
        p.update(n)
    assert max(b - a for a, b in zip(times, times[1:])) <= 10
    beats = [line for line in lines if "no step finished for" in line]
    assert len(beats) == 9 and beats[0].startswith("run: step 1/3 (33%)")
    assert "no step finished for 10s" in beats[0] and "no step finished for 1m30s" in beats[-1]


def test_a_named_wait_is_what_the_heartbeat_reports():
    p, lines, clock = make(4, interval=10)
    p.begin()
    clock.now += 2
    p.update(1)
    p.waiting("all-reduce")
    clock.now += 12
    assert p.poll() is not None and lines[-1].endswith("| all-reduce for 12s")
    clock.now += 3
    assert p.poll() is None  # 3 s after the last line: not due
    p.update(2)
    assert p.state == "" and "all-reduce" not in p.line()


def test_quiet_progress_writes_nothing_unless_it_outlasts_the_interval():
    p, lines, clock = make(None, unit="", interval=10)
    p.begin(quiet=True)
    p.waiting("writing 12.0MB")
    clock.now += 5
    p.poll()
    p.close()
    assert lines == []
    p, lines, clock = make(None, unit="", interval=10)
    p.begin(quiet=True)
    p.waiting("writing 1.20GB")
    clock.now += 11
    p.poll()
    p.close("written")
    assert lines == ["run: 11s elapsed | writing 1.20GB for 11s", "run: written"]


def test_a_failure_inside_says_where_it_stopped():
    p, lines, clock = make(10)
    with pytest.raises(KeyError), p:
        p.update(3)
        raise KeyError("boom")
    assert lines[-1] == "run: stopped by KeyError at step 3"


def test_on_a_terminal_a_live_line_is_redrawn_and_cleared_around_log_lines():
    tty = Tty()
    p, lines, clock = make(10, interval=30, stream=tty, tty=None)
    assert p.tty
    p.begin()
    clock.now += 1
    p.update(1)  # the first step: a log line
    clock.now += 1
    p.update(2)  # not due: only the live line
    p.close()
    out = tty.getvalue()
    assert "\r\x1b[Krun: step 2/10 (20%)" in out and out.endswith("\r\x1b[K")
    assert [line for line in lines if "step 2/10" in line] == []  # the log only got what was due


def test_the_rate_of_slow_steps_reads_as_seconds_per_step():
    p, lines, clock = make(10, interval=1000)
    p.begin()
    clock.now += 32
    p.update(1)
    clock.now += 32
    p.update(2)
    assert "32 s/step" in p.line()


def test_resumed_runs_count_and_estimate_from_where_they_resumed():
    p, lines, clock = make(100, start=40, interval=1000)
    p.begin()
    clock.now += 1
    p.update(41)
    clock.now += 9
    p.update(50)
    line = p.line()
    assert "step 50/100 (50%)" in line and "1 steps/s" in line and "ETA 50s" in line


def test_the_heartbeat_thread_runs_in_the_callers_context_and_stops():
    lines: list[str] = []
    p = Progress("run", 2, interval=0.05, heartbeat=True, write=lines.append, tty=False)
    p.begin()
    assert p._thread is not None and p._thread.daemon
    thread = p._thread
    thread.join(timeout=0.3)  # it keeps beating: the join times out
    p.close()
    assert not thread.is_alive() and any("no step finished" in line for line in lines)


def test_lines_go_to_the_intellect_progress_logger(caplog):
    caplog.set_level(logging.INFO, logger=progress.LOGGER)
    p = Progress("run", 2, tty=False)
    p.begin("two steps")
    assert [r.getMessage() for r in caplog.records if r.name == progress.LOGGER] == ["run: two steps"]


def test_formatting():
    assert [duration(s) for s in (59, 60, 3599, 3600)] == ["59s", "1m00s", "59m59s", "1h00m"]
    assert quantity(9999) == "9999" and quantity(10_000) == "10.0k"
    assert progress_line("x", 0, 0) == "x: step 0/0 (100%) | 0s elapsed"


def test_the_interval_is_a_bounded_config_field_and_sets_the_default():
    assert SmokeConfig().logging.progress_seconds == DEFAULT_INTERVAL == 30
    for bad in ("0", "31", "-1"):
        with pytest.raises(ConfigError, match="logging.progress_seconds"):
            load_config(SmokeConfig, overrides=[f"logging.progress_seconds={bad}"])
    with pytest.raises(ValueError):
        progress.configure(0)
    before = progress.interval()
    try:
        progress.configure(2)
        assert Progress("run", 1).interval == 2
    finally:
        progress.configure(before)
