"""INTELLECT-2's online filter on the trainer's side (issue 38, item 4): a step trains once it holds
``online_filter.min_signal_samples`` validated samples with signal, asking the workers for more in
rounds; a step that cannot get there trains at its bound with the reason recorded; a worker's claimed
rewards never enter the count.

Workers generating in the trainer's process (``run_rl_step``, as ``rl-step`` and the learning benchmark
run) and ``intellect worker`` clients over HTTP with the submission service and SHARDCAST (as
``rl-train`` runs them) are both exercised, on the tiny model.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from intellect.checkpoints import publish, record
from intellect.config import ModelConfig
from intellect.data.arithmetic import Problem
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.inference.torch_engine import TorchEngine
from intellect.rl.config import RLRunConfig
from intellect.rl.trainer.local_step import run_rl_step
from intellect.rl.trainer.online_filter import read_report
from intellect.rl.trainer.run import RLRun
from intellect.rl.wire.rollouts import list_submissions, parse_submission_path, write_submission
from intellect.rl.worker.submission import generate_submission
from intellect.rl.worker.worker import run_worker
from intellect.storage import RunStorage
from intellect.trust.keys import SigningKey

pytestmark = pytest.mark.slow

TINY = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
TASKS = [Problem(a, "+", b).to_task() for a in range(4) for b in range(3)]
WORKERS = ["alice", "bob"]
PROMPTS, GROUP = 2, 4
PER_ROUND = len(WORKERS) * PROMPTS * GROUP  # samples a round brings: one submission per worker


def cfg_with(max_submissions: int = 6, **online_filter) -> RLRunConfig:
    return RLRunConfig.model_validate({
        "run_name": "t", "toploc": False, "trusted_workers": True,
        "submission": {"prompts_per_submission": PROMPTS, "group_size": GROUP, "max_tokens": 4},
        "trainer": {"lr": 1e-2, "warmup_steps": 0, "steps_per_rollout": 1},
        "workers": {"names": WORKERS, "max_submissions": max_submissions, "poll_interval": 0.02},
        "online_filter": online_filter,
    })


def parity_reward(completion, task):  # noqa: ARG001 - the reward signature
    # the untrained tiny model never solves a sum: a reward it hits about half the time gives most groups signal
    return float(sum(map(ord, completion)) % 2)


def no_reward(completion, task):  # noqa: ARG001 - the reward signature
    return 0.0  # no group ever has signal


@pytest.fixture
def run(tmp_path):
    storage = RunStorage(f"file://{tmp_path}/run")
    model, tok = build_model(TINY)
    publish(model, tok, storage, 0)
    with Ledger(tmp_path / "ledger.duckdb") as ledger:
        record(storage, ledger, 0)
        yield storage, ledger


def files_by_worker(storage, step) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rel in list_submissions(storage, step):
        _, worker, k = parse_submission_path(rel)
        out.setdefault(worker, []).append(k)
    return out


def test_the_step_waits_for_the_count_with_rounds_from_every_worker(run):
    storage, ledger = run
    target = 2 * PER_ROUND  # more than two rounds of signal can bring: the first round and at least two more
    cfg = cfg_with(min_signal_samples=target, max_rounds=8)
    rep = run_rl_step(cfg, storage, ledger, 0, WORKERS, TASKS, reward_fn=parity_reward)
    f = rep.filter
    assert f is not None and f.reason == "reached" and f.signal >= target and f.rounds >= 2
    assert rep.trained and rep.trained_samples == f.signal  # trains on exactly what it counted
    held = files_by_worker(storage, 0)
    assert sorted(held) == WORKERS and all(ks == list(range(f.rounds + 1)) for ks in held.values())
    assert f.files == len(WORKERS) * f.rounds and f.accepted == rep.accepted == (f.rounds + 1) * PER_ROUND
    assert read_report(storage, 0) == f
    # the step's metrics in the ledger say what it held
    timings = ledger.get_step(0)["timings"]
    assert (timings["filter_signal"], timings["filter_rounds"], timings["filter_short"]) == (f.signal, f.rounds, 0)
    # off: one submission per worker, today's behaviour
    rep = run_rl_step(cfg_with(), storage, ledger, 1, WORKERS, TASKS, reward_fn=parity_reward)
    assert rep.filter is not None and rep.filter.reason == "off" and rep.filter.rounds == 0
    assert files_by_worker(storage, 1) == {w: [0] for w in WORKERS}
    assert "filter_rounds" not in ledger.get_step(1)["timings"]


def test_a_step_that_cannot_reach_the_count_trains_at_its_bound_with_the_reason(run):
    storage, ledger = run
    rep = run_rl_step(cfg_with(min_signal_samples=1, max_rounds=2), storage, ledger, 0, WORKERS, TASKS,
                      reward_fn=no_reward)
    f = rep.filter
    assert f is not None and (f.reason, f.rounds, f.files, f.signal) == ("max_rounds", 2, 4, 0) and f.short
    assert rep.committed and rep.trained and rep.trained_samples == 0  # the unchanged weights, the run goes on
    assert ledger.get_step(0)["timings"]["filter_short"] == 1
    # the workers' submissions cap the rounds: a round that brings no file ends the filter
    cfg = cfg_with(max_submissions=2, min_signal_samples=1, max_rounds=50)
    rep = run_rl_step(cfg, storage, ledger, 1, WORKERS, TASKS, reward_fn=no_reward)
    assert rep.filter is not None and (rep.filter.reason, rep.filter.rounds, rep.filter.files) == ("no_submissions", 2, 2)
    assert files_by_worker(storage, 1) == {w: [0, 1] for w in WORKERS}


def test_a_worker_lying_about_rewards_does_not_change_the_count(run):
    storage, ledger = run
    cfg = cfg_with(min_signal_samples=1, max_rounds=1)
    # mallory claims alternating rewards: every one of its groups would have signal if claims counted
    _, tok = build_model(TINY)
    model, _ = build_model(TINY)
    engine = TorchEngine.for_tokenizer(model, tok)
    lies = iter(range(1 << 20))
    fake = generate_submission(engine, tok, TASKS, "mallory", 0, 0, 0, cfg.submission, run=cfg.run_name,
                               reward_fn=lambda c, t: float(next(lies) % 2))
    write_submission(storage, 0, "mallory", 0, fake)
    rep = run_rl_step(cfg, storage, ledger, 0, WORKERS, TASKS, reward_fn=no_reward)
    f = rep.filter
    assert f is not None and (f.reason, f.signal) == ("max_rounds", 0)  # claims made no step train early
    reasons = {r["reason"] for r in ledger.summary() if r["step"] == 0 and r["status"] == "rejected"}
    assert reasons == {"reward_mismatch"} and rep.trained_samples == 0
    # what was accepted of its file carries the validator's reward, never the claim
    assert {r["reward"] for r in ledger.accepted(0) if r["worker"] == "mallory"} <= {0.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def service_run(root, steps: int, reward_fn, **online_filter):
    """An RL run with its submission service and SHARDCAST origin, and a function that starts an
    ``intellect worker`` client (a thread here, over HTTP) for a key and returns its stop event."""
    model, tok = build_model(TINY)
    publish(model, tok, RunStorage(f"file://{root}/base"), 0)
    keys = [SigningKey.from_seed(bytes([i + 1]) * 32) for i in range(2)]
    cfg = RLRunConfig.model_validate({
        "run_name": "rl", "storage": {"url": f"file://{root}"}, "init": {"from_run": "base"},
        "tasks": {"size": 64, "data": {"max_digits": 1}}, "steps": steps, "async_level": 0,
        "toploc": False, "trusted_workers": True,
        "submission": {"prompts_per_submission": PROMPTS, "group_size": GROUP, "max_tokens": 4},
        "trainer": {"lr": 1e-2, "warmup_steps": 0, "steps_per_rollout": 1}, "trainer_threads": 1,
        "workers": {"names": ["unused"], "poll_interval": 0.02, "max_submissions": 6, "checkpoint_timeout": 300},
        "online_filter": online_filter,
        "service": {"port": free_port(), "admission": "allowlist", "allowlist": [k.public.hex for k in keys]},
        "eval": {"every": 0, "size": 8},
    })
    errors: list[BaseException] = []
    threads: list[tuple[threading.Thread, threading.Event]] = []
    with RLRun(cfg, reward_fn=reward_fn) as run:
        run.prepare()
        run.start_shardcast()
        run.broadcast(0)
        url = run.start_service(0)

        def start(key: SigningKey) -> tuple[threading.Thread, threading.Event]:
            stop = threading.Event()

            def work() -> None:
                try:
                    run_worker(url, key, run.key.public, root / f"cache-{key.public.id}", stop=stop.is_set,
                               device="cpu")
                except BaseException as e:  # noqa: BLE001 - reported by the test
                    errors.append(e)

            t = threading.Thread(target=work, daemon=True)
            t.start()
            threads.append((t, stop))
            return t, stop

        try:
            yield run, keys, start, errors
        finally:
            for _, stop in threads:
                stop.set()


def ingest(run: RLRun, step: int, workers: int, errors: list) -> None:
    """``collect -> validate -> record`` of ``step`` as rl-train does them, once ``workers`` are done."""
    assert run.service is not None
    deadline = time.monotonic() + 300
    while len(run.service.done(step)) < workers:
        assert not errors and time.monotonic() < deadline, errors
        time.sleep(0.05)
    reports = run.validate(step, run.step_files(step))
    run.record(step, [(r.verdicts, r.mac) for r in reports])


@pytest.mark.timeout(600)
def test_service_workers_answer_rounds_until_the_step_holds_the_count(tmp_path):
    """``intellect worker`` clients answer the rounds the service's status answer opens, after their
    done record; the trainer counts what the validator accepted."""
    steps, target = 2, PER_ROUND + 4  # more than the first round's samples: at least one round each step
    with service_run(tmp_path, steps, parity_reward, min_signal_samples=target, max_rounds=4,
                     round_timeout=120) as (run, keys, start, errors):
        assert run.service is not None
        threads = [start(k)[0] for k in keys]
        for step in range(steps):
            ingest(run, step, len(keys), errors)
            upd = run.update(step, step)
            f = upd.filter
            assert f is not None and f.reason == "reached" and f.signal >= target and f.rounds >= 1, f
            assert upd.trained_samples == f.signal
            by_worker = {w: len(fs) for w, fs in run.step_files(step).items()}
            # every worker answered every round, after its done record
            assert sorted(by_worker) == sorted(k.public.id for k in keys)
            assert all(n == 1 + f.rounds for n in by_worker.values()), by_worker
            assert all(len(rec.files) == 1 for rec in run.service.done(step).values())
            run.broadcast(step + 1)
            run.commit(step, {})
            assert run.ledger.get_step(step)["timings"]["filter_rounds"] == f.rounds
        for t in threads:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in threads)  # they end once the last step commits


@pytest.mark.timeout(600)
def test_a_worker_that_stops_answering_costs_one_round_timeout_and_the_step_trains(tmp_path):
    """The trainer waits for a silent worker one ``round_timeout``, then for the others alone; a count
    out of reach ends at ``max_rounds`` with the step trained on what it holds."""
    timeout = 4.0
    with service_run(tmp_path, 1, no_reward, min_signal_samples=1, max_rounds=3,
                     round_timeout=timeout) as (run, keys, start, errors):
        assert run.service is not None
        live, gone = keys
        start(live)
        silent, stop = start(gone)
        ingest(run, 0, 2, errors)
        stop.set()  # it leaves after its first submission
        silent.join(60)
        t0 = time.monotonic()
        upd = run.update(0, 0)
        waited = time.monotonic() - t0
        f = upd.filter
        assert f is not None and (f.reason, f.rounds, f.signal) == ("max_rounds", 3, 0) and f.short
        assert upd.trained and upd.trained_samples == 0
        files = {w: len(fs) for w, fs in run.step_files(0).items()}
        assert files == {live.public.id: 4, gone.public.id: 1} and f.files == 3
        assert timeout <= waited < 2 * timeout + 30  # one round's timeout, not three
        run.broadcast(1)
        run.commit(0, {})
        assert run.ledger.get_step(0)["timings"]["filter_short"] == 1 and not errors
