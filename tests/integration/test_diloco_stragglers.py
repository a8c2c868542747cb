"""Slow members (``diloco.quorum`` < 1) with real worker processes over gloo: a member made slow from outside
(its process stopped and continued on a duty cycle, as a slower machine or a busy host would be) has its
inner phase closed by the others and contributes what it trained, weighted by its tokens; a member that
stops answering altogether is left out after the late window, not after ``boundary_timeout``."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from diloco_runs import digests, logs, run_cfg, wait_progress

from intellect.diloco.coordinator import EXIT_DONE, Coordinator, worker_launcher
from intellect.diloco.sync import MAX_LATE_STEPS
from intellect.launch import LocalProcess, Throttle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def coordinator(tmp_path):
    made = []

    def make(cfg) -> Coordinator:
        c = Coordinator(cfg, worker_launcher(tmp_path / "logs"), env={})
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def stragglers_cfg(tmp_path, **over):
    # phases long enough to be cut in the middle; a boundary_timeout no step of this test may wait out
    return run_cfg(tmp_path, **{"diloco.workers": 3, "diloco.inner_steps": 24, "diloco.outer_steps": 6,
                                "diloco.quorum": 0.6, "diloco.grace_ratio": 0.05, "diloco.grace_min": 0.2,
                                "diloco.heartbeat_interval": 0.2, "diloco.heartbeat_timeout": 20,
                                "diloco.boundary_timeout": 600, "diloco.compression": '"fp32"', **over})


def pid(c: Coordinator, worker: str) -> int:
    handle = c.handles[worker]
    assert isinstance(handle, LocalProcess)
    return handle.pid


def reports(c: Coordinator, steps: int, worker: str) -> list[dict]:
    out = []
    for t in range(steps):
        key = f"metrics/{t}/{worker}"
        out.append(json.loads(c.store.get(key)) if c.store.check([key]) else {})
    return out


@pytest.mark.parametrize("overlap", ["none", "eager"])
def test_a_slow_member_has_its_phase_closed_and_its_tokens_reach_the_model(tmp_path, coordinator, overlap):
    # overlapped, the others wait for the slow member in their vote on the step before, and close it there
    over = {"diloco.overlap": f'"{overlap}"', "diloco.onboarding": '"non_blocking"'} if overlap != "none" else {}
    cfg = stragglers_cfg(tmp_path, **over)
    c = coordinator(cfg)
    c.start()
    wait_progress(c, 1)  # imports and the first phase at full speed
    slow = Throttle(pid(c, "w2"), run=0.02, pause=0.08)  # w2 runs a fifth of the time
    try:
        codes = c.watch(timeout=240)
    finally:
        slow.stop()
    assert set(codes.values()) == {EXIT_DONE}, logs(tmp_path)
    w0, w2 = reports(c, 6, "w0"), reports(c, 6, "w2")
    closed = [t for t in range(1, 6) if w2[t].get("committed") and w2[t]["inner_steps"] < 24]
    assert closed, ([r.get("inner_steps") for r in w2], logs(tmp_path))
    for t in closed:
        # its partial phase is in the mean with its share of tokens, and the fast members waited for it
        assert w0[t]["contributors"] == 3 and w0[t]["members"] == ["w0", "w1", "w2"], (t, w0[t])
        assert 0 < w2[t]["weight"] < 1 and w2[t]["tokens"] < w0[t]["tokens"], (t, w2[t], w0[t])
        assert w0[t]["weight"] == 1.0 and w0[t]["inner_steps"] == 24
    for t in range(6):
        d = digests(c, t)
        assert len(set(d.values())) == 1, (t, d)
    # the slow member's phases never ran past the others' close by more than the late window allows: no step
    # retried without it
    assert all(r.get("attempts", 1) == 1 for r in w0[1:]), [r.get("attempts") for r in w0]


@pytest.mark.parametrize("onboarding", ["blocking", "non_blocking"])
def test_a_member_that_stops_answering_is_left_out_after_the_late_window(tmp_path, coordinator, onboarding):
    # w2 stops altogether (SIGSTOP) early in a phase: its heartbeat stops too, but the heartbeat timeout (20 s)
    # and the boundary timeout (600 s) are far off; the quorum's late window ends the wait. Continued once the
    # others committed that step without it, it finds itself left out and rejoins; catching up (non_blocking)
    # it relays the step it joins and merges into it the pseudo-gradient the others did not wait for
    cfg = stragglers_cfg(tmp_path, **{"diloco.outer_steps": 7, "diloco.onboarding": f'"{onboarding}"'})
    c = coordinator(cfg)
    c.start()
    wait_progress(c, 1)
    at = c.progress() or 0
    wait_progress(c, at + 1)
    w2 = pid(c, "w2")
    time.sleep(0.1)  # into the next phase
    os.kill(w2, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        wait_progress(c, at + 2, timeout=60)  # a step without w2, well inside the heartbeat timeout
        waited = time.monotonic() - t0
    finally:
        os.kill(w2, signal.SIGCONT)
    assert waited < cfg.diloco.heartbeat_timeout, (waited, logs(tmp_path))
    codes = c.watch(timeout=240)
    assert set(codes.values()) == {EXIT_DONE}, logs(tmp_path)
    left_out = [t for t in range(7) if "w2" not in digests(c, t)]
    assert at + 1 in left_out, (at, left_out, logs(tmp_path))
    for t in range(7):
        d = digests(c, t)
        assert len(set(d.values())) == 1, (t, d)
    merged = [r for r in reports(c, 7, "w2") if r.get("late_step", -1) >= 0]
    back = next((t for t in range(at + 2, 7) if "w2" in digests(c, t)), None)  # the step w2 rejoined at
    if onboarding == "non_blocking" and back is not None and back - (at + 1) <= MAX_LATE_STEPS:
        assert len(merged) == 1 and merged[0]["late_step"] == at + 1 and merged[0]["step"] == back, \
            (back, merged, logs(tmp_path))
        r = merged[0]
        assert r["committed"] and r["onboarded"] and r["contributors"] == 3 and r["tokens"] > 0, r
    else:  # a blocking joiner trains in the step it joins; one back later than the bound drops it
        assert not merged, (back, merged)
