"""The overlapped outer step (``diloco.overlap``: delayed, eager) with real worker processes over gloo.

Each test runs a coordinator in this process (store + local subprocess workers) on a tiny model: the
reduction of step t runs while phase t+1 trains, and the commit protocol's guarantees hold as in a
blocking run (replicas' digests equal after every commit, a failed reduction rolled back everywhere).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from diloco_faults import FaultPlan, faulty_launcher
from diloco_runs import digests, killed_in_reduction, logs, run_cfg, wait_progress

from intellect.checkpoints import fetch
from intellect.diloco.coordinator import EXIT_DONE, Coordinator
from intellect.storage import RunStorage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def overlapped(tmp_path, overlap: str, **over):
    return run_cfg(tmp_path, **{"diloco.overlap": f'"{overlap}"', "diloco.onboarding": '"non_blocking"', **over})


@pytest.fixture
def coordinator(tmp_path):
    made = []

    def make(cfg, faults: FaultPlan | None = None, logs_in=None) -> Coordinator:
        c = Coordinator(cfg, faulty_launcher((logs_in or tmp_path) / "logs", faults), env={})
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def run(c: Coordinator, tmp_path, timeout: float = 180) -> Coordinator:
    c.start()
    codes = c.watch(timeout=timeout)
    assert set(codes.values()) == {EXIT_DONE}, logs(tmp_path)
    return c


def final_weights(cfg) -> dict[str, torch.Tensor]:
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    model, _ = fetch(storage, cfg.diloco.outer_steps)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_eager_with_one_worker_equals_the_blocking_run(tmp_path, coordinator):
    # one worker: its own share is the whole average, so the eager preview is the outer step itself
    common = {"diloco.workers": 1, "diloco.compression": '"fp32"', "diloco.outer_steps": 4}
    weights = {}
    for overlap in ("none", "eager"):
        cfg = overlapped(tmp_path / overlap, overlap, **common) if overlap != "none" else run_cfg(tmp_path / overlap, **common)
        run(coordinator(cfg, logs_in=tmp_path / overlap), tmp_path / overlap)
        weights[overlap] = final_weights(cfg)
    for k, v in weights["none"].items():
        assert torch.equal(v, weights["eager"][k]), k


@pytest.mark.parametrize("overlap", ["delayed", "eager", "eager-own"])
def test_two_overlapped_workers_commit_identical_replicas_every_step(tmp_path, coordinator, overlap):
    # eager-own: each worker's next phase starts from an outer step on its own pseudo-gradient at
    # weight 1 (diloco.eager_weight), so the two phases start apart; the commits still agree
    over = {"diloco.eager_weight": 1.0} if overlap == "eager-own" else {}
    cfg = overlapped(tmp_path, overlap.removesuffix("-own"), **{"diloco.outer_steps": 4, **over})
    c = run(coordinator(cfg), tmp_path)
    for t in range(4):
        d = digests(c, t)
        assert sorted(d) == ["w0", "w1"] and len(set(d.values())) == 1, (t, d)
    if overlap == "eager-own":  # against the default weight (1/2): the same step 0, other steps after it
        ref = run(coordinator(overlapped(tmp_path / "ref", "eager", **{"diloco.outer_steps": 4}),
                              logs_in=tmp_path / "ref"), tmp_path / "ref")
        assert digests(ref, 0) == digests(c, 0)
        assert all(set(digests(ref, t).values()).isdisjoint(digests(c, t).values()) for t in (1, 2, 3))
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    assert storage.complete_steps("checkpoints") == [0, 1, 2, 3, 4]
    m = json.loads(c.store.get("metrics/3/w1"))
    assert m["committed"] and m["contributors"] == 2 and m["compute_utilization"] > 0


def test_a_worker_killed_with_a_step_in_flight_is_left_out_and_nobody_applies_half_a_step(tmp_path, coordinator):
    # w2 stalls inside step 1's reduction (every member ready) while its next phase trains, and is killed
    # there: the survivors roll the attempt back, retry without it and commit; step 2, which w2 had
    # joined at the boundary it reached meanwhile, goes on without it
    cfg = overlapped(tmp_path, "eager", **{"diloco.workers": 3, "diloco.outer_steps": 4})
    c, m = killed_in_reduction(coordinator, cfg, tmp_path)
    assert m["attempts"] >= 2 and m["members"] == ["w0", "w1"] and m["contributors"] == 2
    assert "w2" not in digests(c, 1)
    for t in range(4):
        d = digests(c, t)
        assert {"w0", "w1"} <= set(d) and len(set(d.values())) == 1, (t, d)


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_a_joiner_enters_with_a_step_in_flight(tmp_path, coordinator, overlap):
    # no intermediate checkpoints: w2 can only get the state from a member, once that member committed the
    # step in flight at the boundary w2 arrives at
    # steps long enough that the joiner (seconds of imports) arrives well before the run ends
    cfg = overlapped(tmp_path, overlap, **{"diloco.outer_steps": 24, "diloco.inner_steps": 100,
                                          "diloco.checkpoint_every": 100})
    c = coordinator(cfg)
    c.start()
    wait_progress(c, 1)
    c.start_worker("w2")
    codes = c.watch(timeout=240)
    assert codes == {"w0": EXIT_DONE, "w1": EXIT_DONE, "w2": EXIT_DONE}, logs(tmp_path)
    joined = [t for t in range(24) if "w2" in digests(c, t)]
    assert joined and joined[-1] == 23, logs(tmp_path)
    for t in range(8, 24):  # the rendezvous keeps the last 16 steps' keys
        d = digests(c, t)
        assert len(set(d.values())) == 1, (t, d)
    first = json.loads(c.store.get(f"metrics/{joined[0]}/w2"))
    assert first["committed"] and first["onboarded"]
    after = json.loads(c.store.get(f"metrics/{joined[-1]}/w0"))
    assert after["members"] == ["w0", "w1", "w2"] and after["contributors"] == 3


@pytest.mark.parametrize("ranks", [1, 2])
def test_an_overlapped_run_killed_and_resumed_ends_as_the_unkilled_run(tmp_path, coordinator, ranks):
    """The whole run killed (coordinator and workers) with a step in flight and resumed from its newest
    checkpoint: each worker reduces its saved pseudo-gradient of the step in flight again, skips the phase
    it had trained, and the run ends with the weights of a run that was never killed (top-k: with the
    error-feedback residual it had; workers of two ranks: each rank its shard of them)."""
    over = {"diloco.outer_steps": 6, "diloco.inner_steps": 10, "diloco.compression": '"topk"',
            "diloco.topk_chunk": 256, "diloco.topk_k": 8, "diloco.ranks_per_worker": ranks}
    cfg = overlapped(tmp_path, "eager", **over)
    ref_cfg = cfg.model_copy(update={"run_name": "unkilled"})
    run(coordinator(ref_cfg, logs_in=tmp_path / "ref"), tmp_path / "ref")
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    c = coordinator(cfg)
    c.start()
    deadline = time.monotonic() + 120
    while (storage.latest_step("checkpoints") or 0) < 2:
        assert time.monotonic() < deadline, logs(tmp_path)
        time.sleep(0.05)
    for h in c.handles.values():  # every worker at once (its other ranks die with it), its step in flight lost
        os.kill(h.pid, signal.SIGKILL)
    c.close()
    resumed_from = storage.latest_step("checkpoints")
    assert resumed_from is not None and 2 <= resumed_from < 6
    run(coordinator(cfg, logs_in=tmp_path / "resumed"), tmp_path / "resumed")
    assert "its pseudo-gradient of step" in logs(tmp_path / "resumed")
    want, got = (final_weights(x) for x in (ref_cfg, cfg))
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]


def test_overlapped_workers_of_two_ranks_commit_identical_replicas(tmp_path, coordinator):
    # each local rank's ring reduces its shard of step t while the worker's ranks train phase t+1
    cfg = overlapped(tmp_path, "eager", **{"diloco.outer_steps": 4, "diloco.ranks_per_worker": 2})
    c = run(coordinator(cfg), tmp_path)
    for t in range(4):
        d = digests(c, t)
        assert sorted(d) == ["w0", "w1"] and len(set(d.values())) == 1, (t, d)
    assert RunStorage.from_config(cfg.storage, cfg.run_name).complete_steps("checkpoints") == [0, 1, 2, 3, 4]
