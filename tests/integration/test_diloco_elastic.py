"""DiLoCo workers as real processes over gloo: commits, faults, joins, a lost coordinator.

Every test runs a coordinator in this process (store + local subprocess
workers) on a tiny model, and checks after each committed outer step that
the members' ``theta_sync`` digests are equal.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from diloco_faults import FaultPlan, faulty_launcher
from diloco_runs import digests, killed_in_reduction, logs, run_cfg, wait_progress

from intellect.checkpoints import fetch
from intellect.diloco import worker_state
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.coordinator import EXIT_DONE, Coordinator, worker_launcher
from intellect.storage import RunStorage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def assert_identical_replicas(coord: Coordinator, steps: range) -> None:
    for t in steps:
        d = digests(coord, t)
        assert d, f"no digest for step {t}"
        assert len(set(d.values())) == 1, f"replicas differ at step {t}: {d}"


@pytest.fixture
def coordinator(tmp_path):
    made = []

    def make(cfg: DilocoRunConfig, env: dict | None = None, faults: FaultPlan | None = None) -> Coordinator:
        c = Coordinator(cfg, faulty_launcher(tmp_path / "logs", faults), env=env or {})
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_two_workers_commit_identical_replicas_and_checkpoints(tmp_path, coordinator):
    cfg = run_cfg(tmp_path)
    c = coordinator(cfg)
    c.start()
    codes = c.watch(timeout=180)
    assert codes == {"w0": EXIT_DONE, "w1": EXIT_DONE}, logs(tmp_path)
    assert_identical_replicas(c, range(3))
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    assert storage.complete_steps("checkpoints") == [0, 1, 2, 3]
    m = json.loads(c.store.get("metrics/2/w0"))
    assert m["members"] == ["w0", "w1"] and m["contributors"] == 2 and m["bytes_sent"] > 0
    assert m["algorithm"] == "direct" and m["estimates"] == {}  # auto, two workers: no probe, direct


def test_kill_during_inner_phase_survivors_continue(tmp_path, coordinator):
    c = coordinator(run_cfg(tmp_path, **{"diloco.workers": 3, "diloco.outer_steps": 4, "diloco.inner_steps": 30}))
    c.start()
    wait_progress(c, 1)
    os.kill(c.handles["w2"].pid, signal.SIGKILL)
    codes = c.watch(timeout=180)
    assert codes["w0"] == EXIT_DONE and codes["w1"] == EXIT_DONE, logs(tmp_path)
    assert_identical_replicas(c, range(4))
    last = json.loads(c.store.get("metrics/3/w0"))
    assert last["members"] == ["w0", "w1"]
    # three members: the ring was measured and solved, auto chose from the estimates, and
    # everyone ran the one agreed plan
    plan = json.loads(c.store.get("plan/0/0"))
    assert sorted(plan["order"]) == [0, 1, 2] and set(plan["estimates"]) == {"direct", "ring-owner"}
    assert plan["estimates"][plan["algorithm"]] == min(plan["estimates"].values())
    first = [json.loads(c.store.get(f"metrics/0/{w}")) for w in ("w0", "w1")]  # w2 may die before writing its own
    assert {m["algorithm"] for m in first} == {plan["algorithm"]}


def test_sigterm_deathrattle_is_faster_than_the_heartbeat_timeout(tmp_path, coordinator):
    cfg = run_cfg(tmp_path, **{"diloco.workers": 3, "diloco.outer_steps": 4, "diloco.heartbeat_timeout": 30,
                               "diloco.heartbeat_interval": 1})
    c = coordinator(cfg)
    c.start()
    wait_progress(c, 1)
    t0 = time.monotonic()
    c.handles["w2"].terminate()
    wait_progress(c, 3, timeout=60)
    assert time.monotonic() - t0 < 30, "the leaver was only dropped by the heartbeat timeout"
    assert c.store.check(["dead/w2"])
    codes = c.watch(timeout=120)
    assert codes["w0"] == EXIT_DONE and codes["w1"] == EXIT_DONE, logs(tmp_path)
    assert_identical_replicas(c, range(4))


def test_joiner_is_onboarded_at_a_boundary(tmp_path, coordinator):
    # no intermediate checkpoints: the joiner can only catch up through the peers' broadcast
    c = coordinator(run_cfg(tmp_path, **{"diloco.outer_steps": 5, "diloco.inner_steps": 10,
                                         "diloco.checkpoint_every": 100}))
    c.start()
    wait_progress(c, 1)
    c.start_worker("w2")
    codes = c.watch(timeout=180)
    assert codes == {"w0": EXIT_DONE, "w1": EXIT_DONE, "w2": EXIT_DONE}, logs(tmp_path)
    joined = [t for t in range(5) if "w2" in digests(c, t)]
    assert joined and joined[-1] == 4
    assert json.loads(c.store.get(f"metrics/{joined[0]}/w2"))["onboarded"]
    assert_identical_replicas(c, range(5))


@pytest.mark.parametrize("onboarding,liar,overlap", [("blocking", "*", "none"), ("non_blocking", "*", "none"),
                                                    ("non_blocking", "w0", "none"), ("non_blocking", "w0", "eager")])
def test_a_joiner_refuses_the_state_of_a_source_that_lies(tmp_path, coordinator, onboarding, liar, overlap):
    # "*": each member, the first time it is w2's onboarding source, sends other weights than it committed;
    # "w0": w0 does every time. w2 keeps its own state, says why, and joins at a later boundary with the
    # members' weights: the source turns over by step, so a liar cannot keep a joiner out (eager: the
    # state of the step in flight, checked against the digest the members record after the boundary)
    # non-blocking: the members do not wait for w2, so the run must outlast its start-up
    steps, inner = (8, 10) if onboarding == "blocking" else (25, 60)
    c = coordinator(run_cfg(tmp_path, **{"diloco.outer_steps": steps, "diloco.inner_steps": inner,
                                         "diloco.checkpoint_every": 100, "diloco.onboarding": onboarding,
                                         "diloco.overlap": f'"{overlap}"'}),
                    faults=FaultPlan(onboard_lie_worker=liar, onboard_lies=1 if liar == "*" else 10**6))
    c.start()
    wait_progress(c, 1)
    c.start_worker("w2")
    codes = c.watch(timeout=240)
    assert codes == {"w0": EXIT_DONE, "w1": EXIT_DONE, "w2": EXIT_DONE}, logs(tmp_path)
    text = (tmp_path / "logs" / "w2.log").read_text()
    refused = re.findall(r"refused the state (w\d) sent at step (\d+): its theta_sync hashes to \w+, the members "
                         r"recorded \w+", text)
    assert (1 <= len(refused) <= 2) if liar == "*" else len(refused) <= 1, text[-3000:]
    assert liar == "*" or {w for w, _ in refused} <= {"w0"}
    joined = [t for t in range(steps) if "w2" in digests(c, t)]
    assert joined and (not refused or joined[0] > int(refused[-1][1])) and joined[-1] == steps - 1
    assert_identical_replicas(c, range(joined[0], steps))  # the rendezvous keeps the newest KEEP_STEPS steps


def test_a_joiner_given_a_wrong_momentum_leaves_once_it_drifts_and_is_onboarded_again(tmp_path, coordinator):
    # the momentum has no digest of its own: w3 takes a wrong one (each member lies once as its source), and
    # its theta_sync drifts at its first commit; at the next boundary its digest is not the majority's
    # (three members to side with), so it leaves and is onboarded afresh, until a source sends the truth
    c = coordinator(run_cfg(tmp_path, **{"diloco.workers": 3, "diloco.outer_steps": 12, "diloco.inner_steps": 10,
                                         "diloco.checkpoint_every": 100}),
                    faults=FaultPlan(onboard_lie_worker="*", onboard_lies=1, onboard_lie="momentum"))
    c.start()
    wait_progress(c, 1)
    c.start_worker("w3")
    codes = c.watch(timeout=240)
    assert set(codes.values()) == {EXIT_DONE}, logs(tmp_path)
    text = (tmp_path / "logs" / "w3.log").read_text()
    drifted = re.findall(r"theta_sync after step (\d+) hashes to \w+, the members recorded \w+", text)
    assert 1 <= len(drifted) <= 3 and "refused the state" not in text, text[-3000:]  # each source lies once
    first = min(t for t in range(12) if "w3" in digests(c, t))
    assert digests(c, first)["w3"] != digests(c, first)["w0"] and int(drifted[0]) == first
    assert digests(c, 11)["w3"] == digests(c, 11)["w0"]
    assert_identical_replicas(c, range(int(drifted[-1]) + 2, 12))


def test_nan_pseudo_gradient_is_excluded_not_averaged(tmp_path, coordinator):
    c = coordinator(run_cfg(tmp_path), faults=FaultPlan(nan_step=1, nan_worker="w1"))
    c.start()
    codes = c.watch(timeout=180)
    assert codes == {"w0": EXIT_DONE, "w1": EXIT_DONE}, logs(tmp_path)
    assert json.loads(c.store.get("metrics/1/w0"))["contributors"] == 1
    assert json.loads(c.store.get("metrics/2/w0"))["contributors"] == 2
    assert_identical_replicas(c, range(3))


def test_kill_during_allreduce_retries_with_survivors(tmp_path, coordinator):
    # w2 stalls inside step 1's all-reduce (after announcing ready): the others block on it
    c, m = killed_in_reduction(coordinator, run_cfg(tmp_path, **{"diloco.workers": 3, "diloco.outer_steps": 3}),
                               tmp_path)
    assert m["attempts"] >= 2 and m["members"] == ["w0", "w1"]
    assert_identical_replicas(c, range(3))


COORDINATOR_SCRIPT = """
import sys, time
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.coordinator import Coordinator, worker_launcher
cfg = DilocoRunConfig.model_validate_json(open(sys.argv[1]).read())
c = Coordinator(cfg, worker_launcher(sys.argv[2]))
c.start()
print("started", flush=True)
codes = c.watch(timeout=240)
print("codes", codes, flush=True)
"""


def text_corpus(tmp_path) -> dict:
    """Overrides that train on a small text corpus (documents of different lengths) written here."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    words = "the cat dog sat ran on mat log and a big red box of six".split()
    for i in range(150):
        (folder / f"doc{i:03d}.txt").write_text(f"doc {i}: " + " ".join(words[(i * k) % 15] for k in range(i % 40 + 5)))
    return {"data.kind": '"text"', "data.text.files": f'["{folder}"]', "data.text.seq_len": 32,
            "data.text.eval_sequences": 4, "data.heldout_percent": 10, "model.max_position_embeddings": 64}


@pytest.mark.parametrize("kind", ["arithmetic", "text", "topk"])
def test_coordinator_killed_workers_stop_and_run_resumes(tmp_path, kind):
    """The whole run (coordinator and workers) killed and resumed ends with the weights of a run that
    was never killed, each worker resuming from its own saved inner AdamW state and data position
    (on a text corpus too: a resumed position is current, nobody realigns; with top-k pseudo-gradients,
    its error-feedback residual too)."""
    data = text_corpus(tmp_path) if kind == "text" else {}
    if kind == "topk":
        data = {"diloco.compression": '"topk"', "diloco.topk_chunk": 256, "diloco.topk_k": 8}
    cfg = run_cfg(tmp_path, **{"diloco.outer_steps": 6, "diloco.inner_steps": 10, **data})
    ref_cfg = cfg.model_copy(update={"run_name": "unkilled"})
    ref = Coordinator(ref_cfg, worker_launcher(tmp_path / "logs-ref"))
    try:
        ref.start()
        assert ref.watch(timeout=180) == {"w0": EXIT_DONE, "w1": EXIT_DONE}, logs(tmp_path)
    finally:
        ref.close()
    ref_storage = RunStorage.from_config(ref_cfg.storage, ref_cfg.run_name)
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(cfg.model_dump_json())
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    # its temporary folder in ours: a SIGKILLed coordinator cannot remove it
    proc = subprocess.Popen([sys.executable, "-c", COORDINATOR_SCRIPT, str(cfg_file), str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while (storage.latest_step("checkpoints") or 0) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, logs(tmp_path)
            time.sleep(0.1)
        # the workers are the coordinator's children, not ours: their PIDs before it dies (only this
        # test's, never another run's workers on the same machine)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        proc.kill()
        proc.wait(timeout=10)
        t0 = time.monotonic()
        while _alive(workers) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        assert not _alive(workers), "workers kept running without their coordinator"
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _alive(workers):
            os.kill(pid, signal.SIGKILL)
    resumed_from = storage.latest_step("checkpoints")
    assert 2 <= resumed_from < 6
    c = Coordinator(cfg, worker_launcher(tmp_path / "logs2"))
    try:
        c.start()
        codes = c.watch(timeout=180)
        assert codes == {"w0": EXIT_DONE, "w1": EXIT_DONE}, logs(tmp_path)
        assert storage.latest_step("checkpoints") == 6
        assert_identical_replicas(c, range(resumed_from, 6))
    finally:
        c.close()
    # every worker resumed from the position and the inner step an unkilled worker had there
    for w in ("w0", "w1"):
        saved, unkilled = (worker_state.load(s, w, resumed_from) for s in (storage, ref_storage))
        assert saved is not None and unkilled is not None and saved.data == unkilled.data
        assert (saved.members, saved.rows_per_step) == (unkilled.members, unkilled.rows_per_step)
        if kind != "text":
            assert saved.data["read"] == resumed_from * 10 * 8  # outer steps x inner steps x batch
        if kind == "topk":  # what the worker had not sent yet, as the unkilled worker had it
            assert saved.feedback is not None and unkilled.feedback is not None and saved.feedback.abs().sum() > 0
            assert torch.equal(saved.feedback, unkilled.feedback)
    want, got = (fetch(s, 6)[0].state_dict() for s in (ref_storage, storage))
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]


def _children(pid: int) -> list[int]:
    """The DiLoCo worker processes that process ``pid`` started."""
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "intellect.diloco.coordinator worker"],
                         capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie counts as gone: it computes nothing)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive
