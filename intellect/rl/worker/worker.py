"""``intellect worker``: the permissionless inference worker of an RL run, as INTELLECT-2 ran it.

A worker is an Ed25519 key pair (``intellect worker keygen --out PATH``); its id is the key's
:func:`~intellect.trust.keys.key_id`, so it cannot pick a name that collides with or sorts before
another's. It needs the run's URL (the submission service), its key file and the trainer's public
key, and nothing else: no Prefect API, no storage credentials, no shared file system.

    intellect worker --run-url http://trainer:8750 --key worker.key --trainer-key <hex> [--cache DIR]

It computes on ``--device`` (default ``auto``: the GPU of its ``LOCAL_RANK`` among those
``CUDA_VISIBLE_DEVICES`` leaves visible, else the CPU; :func:`~intellect.device.resolve_device`) in
the precision the run's validator prefills in (``WorkerRunInfo.precision``), so that its TOPLOC
proofs are within the validator's tolerances.

It registers, reads the run's description (:class:`WorkerRunInfo`: steps, lag bound, sampling,
TOPLOC, the SHARDCAST relays), and for each step from the first uncommitted one to the last: waits
until a checkpoint the lag rule allows is on the relays (:func:`~intellect.rl.wire.lag.policy_for`),
downloads it (every version signed by the trainer's key, which the worker pins) and loads it into its
engine (built once, of the run's ``workers.engine.kind``; each new policy is loaded into the running
engine in place, :func:`~intellect.inference.engines.make_engine`), asks the service
for its assignment (prompts without reference answers), generates with the seeds its salt decides
(the registration answer's) and TOPLOC proofs, submits its file, and says it is done. It claims no
reward (the validator computes them). With the run's online filter on, it then keeps looking at the
steps it finished until they are committed (while it waits for a checkpoint, before each step, and
after the last): a step whose status answer opens a round of assignment it has not answered gets its
next submission (:mod:`intellect.rl.wire.refill`). A step
the service already holds as done is skipped, and one it holds submissions of is finished with
them, so a restarted worker resumes where it stopped (:meth:`ServiceClient.status`).
Nothing it sends is believed before the validator has checked it.

Exit codes: 0 after the last step, 3 when no fresh checkpoint appears within the run's
``checkpoint_timeout``, 4 when the relays cannot deliver one, 5 when the service refuses the worker
(not admitted, or unreachable past its retries), 6 when the run's engine cannot run in this Python
(``workers.engine.kind = "vllm"`` without vLLM installed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal

import httpx
import torch
from pydantic import Field

from intellect.config import ComputeConfig, StrictModel
from intellect.data.loaders import CodeTask, MathTask, TaskKind
from intellect.device import DeviceError, Precision, resolve_device, resolve_precision
from intellect.inference.config import EngineConfig
from intellect.inference.engines import Engine, EngineUnavailable, check_available, load_tokenizer, make_engine
from intellect.progress import Progress
from intellect.rl.wire.lag import PolicyLag, policy_for
from intellect.rl.wire.refill import StepStatus, owes_submission
from intellect.rl.wire.rollouts import RolloutLimits, encode_submission, submission_path
from intellect.rl.worker.client import ServiceClient, ServiceError
from intellect.rl.rewards.code import CodeRewardConfig
from intellect.rl.worker.submission import (
    SubmissionConfig, generate_assigned, unclaimed_reward,
)
from intellect.rl.worker.weights import ShardcastWeights, WeightSource
from intellect.shardcast.client import ShardcastClient, ShardcastError
from intellect.shardcast.config import ClientConfig, ClientTuning
from intellect.toploc.proofs import ToplocConfig
from intellect.trust.keys import SigningKey, VerifyKey

if TYPE_CHECKING:
    from intellect.rl.config import RLRunConfig

log = logging.getLogger("intellect.rl.worker.worker")

EXIT_NO_CHECKPOINT = 3
EXIT_NO_WEIGHTS = 4
EXIT_REFUSED = 5
EXIT_NO_ENGINE = 6
_HEALTH_BYTES = 4096
_RETRY = frozenset({"too_far_ahead", "busy", "unreachable"})  # the service says: not now
# seconds between looks at finished steps for a round of the online filter: each look is a signed
# request per step, and the service's replay guard bounds a key's requests per window
REFILL_POLL = 1.0


class CheckpointTimeout(TimeoutError):
    pass


def validator_precision(cfg: RLRunConfig) -> Precision:
    """The precision the run's validator prefills in, as its own device decides ``compute.precision``."""
    return resolve_precision(cfg.compute.precision, resolve_device(cfg.compute.device))


class WorkerRunInfo(StrictModel):
    """What the submission service tells a worker about the run (``GET /v1/run``): nothing secret."""

    run: str = Field(description="The run's name: the audience of every signed request.")
    steps: int = Field(ge=1, description="RL steps of the run (0 .. steps - 1 are generated).")
    committed: int = Field(ge=-1, description="The newest committed step (-1: none); a worker starts after it.")
    async_level: int = Field(ge=0, description="Most policy lag of a sample.")
    policy_lag: PolicyLag = Field(default="newest", description="Which fresh checkpoint to generate with (lag.py).")
    submission: SubmissionConfig
    toploc: ToplocConfig | None = Field(description="TOPLOC proofs the validator checks (None: off).")
    precision: Literal["fp32", "bf16-mixed", "bf16"] = Field(
        default="fp32", description="The precision the validator prefills in (the run's compute.precision as "
        "the validator's device decides it: never auto, which a worker's device could decide otherwise): a "
        "worker's engine generates in it.",
    )
    limits: RolloutLimits | None = Field(description="Bounds the validator applies; None: defaults.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="The engine and how it batches (workers.engine).",
    )
    task_kind: Literal["math", "code"] = Field(default="math", description="What the assigned tasks are (tasks.kind).")
    code_reward: CodeRewardConfig = Field(
        default_factory=CodeRewardConfig, description="How the validator scores code tasks (tasks.code).",
    )
    min_signal_samples: int = Field(
        ge=0, description="The online filter's count (OnlineFilterConfig; 0: off): a worker answers its rounds "
        "of assignment only when it is on.",
    )
    max_submissions: int = Field(ge=1, description="Most submissions per step (online filter rounds included).")
    relays: list[str] = Field(min_length=1, description="SHARDCAST relays to download checkpoints from.")
    client: ClientTuning = Field(default_factory=ClientTuning, description="SHARDCAST client settings.")
    poll_interval: float = Field(gt=0, description="Seconds between looks for a new checkpoint.")
    checkpoint_timeout: float = Field(gt=0, description="Give up after waiting this long for a checkpoint.")

    @classmethod
    def of(cls, cfg: RLRunConfig, committed: int, relays: list[str]) -> WorkerRunInfo:
        """What a run of ``cfg`` tells its workers, ``committed`` its newest committed step."""
        return cls(
            run=cfg.run_name, steps=cfg.steps, committed=committed, async_level=cfg.async_level, policy_lag=cfg.policy_lag,
            submission=cfg.submission, toploc=cfg.toploc, precision=validator_precision(cfg), limits=cfg.limits,
            task_kind=cfg.tasks.kind, code_reward=cfg.tasks.code, engine=cfg.workers.engine,
            min_signal_samples=cfg.online_filter.min_signal_samples, max_submissions=cfg.workers.max_submissions,
            relays=relays, client=cfg.weights_broadcast().client, poll_interval=cfg.workers.poll_interval,
            checkpoint_timeout=cfg.workers.checkpoint_timeout,
        )


def _tasks(rows: list, kind: TaskKind) -> list:
    """The assigned tasks of the service's answer: id and prompt (a worker is told no reference answer,
    so a task's answer or tests are empty here); a malformed one is the service's bad answer."""
    if not all(isinstance(t, dict) and all(isinstance(t.get(f), str) and t[f] for f in ("id", "prompt"))
               for t in rows):
        raise ServiceError(0, "bad_answer", f"assigned tasks: {str(rows)[:200]}")
    return [MathTask(t["id"], t["prompt"], "") if kind == "math" else CodeTask(t["id"], t["prompt"], ())
            for t in rows]


def wait_for_policy(complete_steps: Callable[[], list[int]], step: int, async_level: int, timeout: float,
                    poll: float, stop: Callable[[], bool] = lambda: False, lag: PolicyLag = "newest") -> int | None:
    """The checkpoint to generate ``step`` with, once one is complete (None when ``stop()`` says so)."""
    deadline = time.monotonic() + timeout
    while True:
        policy = policy_for(step, async_level, complete_steps(), lag)
        if policy is not None:
            return policy
        if stop():
            return None
        if time.monotonic() > deadline:
            raise CheckpointTimeout(f"no checkpoint within {async_level} of step {step} after {timeout:.0f} s")
        time.sleep(poll)


def relay_weights(info: WorkerRunInfo, trainer_key: VerifyKey, cache: Path) -> ShardcastWeights:
    """Checkpoints downloaded from the run's relays into ``cache``, verified against the trainer's key
    pinned on the command line, never one the service names."""
    pinned = ClientConfig(**info.client.model_dump(), trainer_key=trainer_key.hex)
    return ShardcastWeights(ShardcastClient(info.relays, pinned), cache, keep=info.async_level + 2)


def _call(fn: Callable, *args, deadline: float, poll: float, idle: Callable[[], object] = lambda: None):
    """``fn(*args)``, retried while the service says "not now" (ahead of the trainer, busy, unreachable);
    ``idle()`` between tries."""
    while True:
        try:
            return fn(*args)
        except ServiceError as e:
            if e.reason not in _RETRY or time.monotonic() > deadline:
                raise
        idle()
        time.sleep(poll)


def run_name(url: str, timeout: float = 30.0) -> str:
    """The run's name from the service's unsigned health answer (read with a byte cap): the audience
    the worker signs for. A wrong name only makes every signed request fail."""
    with httpx.Client(timeout=timeout) as http, http.stream("GET", url.rstrip("/") + "/v1/health") as r:
        body = b""
        for chunk in r.iter_bytes():
            body += chunk
            if len(body) > _HEALTH_BYTES:
                raise ServiceError(0, "bad_answer", "health answer too large")
    try:
        name = json.loads(body)["run"]
    except (ValueError, KeyError, TypeError):
        raise ServiceError(r.status_code, "bad_answer", f"not a health answer: {body[:200]!r}") from None
    if not isinstance(name, str):
        raise ServiceError(r.status_code, "bad_answer", "no run name")
    return name


def run_worker(
    url: str,
    key: SigningKey,
    trainer_key: VerifyKey,
    cache: str | os.PathLike,
    *,
    stop: Callable[[], bool] = lambda: False,
    timeout: float = 30.0,
    device: str = "auto",
) -> list[dict]:
    """Work for the run at ``url`` until its last step (see the module docstring); one record per step.
    ``device`` is a ``compute.device`` value; the precision is the run's."""
    try:
        run = run_name(url, timeout)
    except httpx.HTTPError as e:
        raise ServiceError(0, "unreachable", str(e)) from None
    client = ServiceClient(url, key, audience=run, timeout=timeout)
    out: list[dict] = []
    weights: WeightSource | None = None
    stack = contextlib.ExitStack()
    try:
        client.register()
        info = WorkerRunInfo.model_validate(client.run_info())
        check_available(info.engine.kind)  # before waiting for work: a worker that cannot generate says so now
        compute = ComputeConfig(device=device, precision=info.precision)
        weights = relay_weights(info, trainer_key, Path(cache))
        held: int | None = None
        engine: Engine | None = None
        tok, limits = None, None
        # a heartbeat line at least every progress interval, also while waiting for a checkpoint
        bar = Progress(f"worker {client.worker}", info.steps, start=info.committed + 1, heartbeat=True)
        bar.begin(f"run {run}, steps {info.committed + 1}..{info.steps - 1} on {compute.device}")
        stack.enter_context(bar)
        # the online filter's open steps this worker finished -> the newest round it answered there
        answered: dict[int, int] = {}
        last_look = 0.0

        def use_policy(policy: int) -> None:
            nonlocal held
            if engine is not None and policy != held:  # the running engine takes the new policy: no rebuild
                engine.update_weights(weights.folder(policy))
                held = policy

        def serve_refills() -> None:
            """One submission to each finished step whose online filter opened a round not answered yet."""
            nonlocal last_look
            if not answered or engine is None or tok is None or time.monotonic() - last_look < REFILL_POLL:
                return
            last_look = time.monotonic()
            for s in sorted(answered):
                deadline = time.monotonic() + info.checkpoint_timeout
                try:
                    st = StepStatus.model_validate(_call(client.status, s, deadline=deadline, poll=info.poll_interval))
                    if not st.open:
                        del answered[s]
                        continue
                    if not owes_submission(st, answered[s], info.max_submissions):
                        continue
                    policy = policy_for(s, info.async_level, weights.complete_steps(), info.policy_lag)
                    if policy is None:  # its checkpoint left the relays: the step cannot get fresh samples here
                        del answered[s]
                        continue
                    use_policy(policy)
                    k = len(st.submissions)  # the service assigns k only once 0..k-1 are stored
                    tasks = _tasks(_call(client.assignment, s, k, deadline=deadline, poll=info.poll_interval),
                                   info.task_kind)
                    rows = generate_assigned(engine, tok, tasks, client.worker, s, k, policy, info.submission,
                                             run=info.run, reward_fn=unclaimed_reward, proofs=info.toploc,
                                             salt=client.salt or b"")
                    _call(client.submit, s, k, encode_submission(rows, limits), deadline=deadline,
                          poll=info.poll_interval)
                    answered[s] = st.refill
                    log.info("worker %s: step %d round %d: submission %d", client.worker, s, st.refill, k)
                except ServiceError as e:
                    if e.reason == "closed":  # committed meanwhile
                        answered.pop(s, None)
                    elif e.reason == "finished":  # the round ended between the look and the upload
                        answered[s] = st.refill
                    else:
                        raise

        def stop_or_serve() -> bool:
            serve_refills()
            return stop()

        for step in range(info.committed + 1, info.steps):
            if stop():
                break
            try:
                wait = time.monotonic() + info.checkpoint_timeout
                # a step past the service's window waits for the trainer, which may wait for our rounds
                serve_refills()
                status = _call(client.status, step, deadline=wait, poll=info.poll_interval, idle=serve_refills)
                if status["done"]:
                    if info.min_signal_samples:
                        answered.setdefault(step, 0)
                    bar.update(step + 1)
                    continue
                t0 = time.perf_counter()
                bar.waiting(f"step {step}: waiting for a checkpoint")
                policy = wait_for_policy(weights.complete_steps, step, info.async_level, info.checkpoint_timeout,
                                         info.poll_interval, stop_or_serve, info.policy_lag)
                if policy is None:
                    break
                if engine is None or tok is None:
                    folder = weights.folder(policy)
                    engine = make_engine(info.engine.kind, folder, compute, info.engine,
                                         capture_hidden=info.toploc is not None)
                    tok = load_tokenizer(folder)
                    limits = info.limits or RolloutLimits(vocab_size=len(tok))
                    held = policy
                use_policy(policy)
                files = []
                if status["submissions"]:  # a restart mid-step: what the service holds is this step's work
                    files = [submission_path(step, client.worker, k) for k in status["submissions"]]
                else:
                    bar.waiting(f"step {step}: submission 0 with checkpoint {policy}")
                    tasks = _tasks(_call(client.assignment, step, 0, deadline=wait, poll=info.poll_interval),
                                   info.task_kind)
                    rows = generate_assigned(engine, tok, tasks, client.worker, step, 0, policy, info.submission,
                                             run=info.run, reward_fn=unclaimed_reward, proofs=info.toploc,
                                             salt=client.salt or b"")
                    rec = _call(client.submit, step, 0, encode_submission(rows, limits), deadline=wait,
                                poll=info.poll_interval)
                    files.append(rec.path)
                _call(client.finish, step, files, policy, deadline=wait, poll=info.poll_interval)
                if info.min_signal_samples:
                    answered.setdefault(step, 0)
                rec = {"step": step, "policy_step": policy, "files": len(files),
                       "seconds": round(time.perf_counter() - t0, 3), "weight_updates": engine.stats.weight_updates,
                       "weight_update_seconds": round(engine.stats.weight_update_seconds, 3)}
                log.info("worker %s %s", client.worker, rec)
                out.append(rec)
                bar.update(step + 1, policy=policy, files=len(files))
            except ServiceError as e:
                if e.reason != "closed":
                    raise
                # the trainer committed this step without us (we were slow or restarted late): on to the next
                log.info("step %d was committed without worker %s", step, client.worker)
                bar.update(step + 1)
        # the last steps may still ask for more: serve them until they are committed
        tail = time.monotonic() + info.checkpoint_timeout
        while answered and not stop() and time.monotonic() < tail:
            serve_refills()
            time.sleep(info.poll_interval)
    finally:
        stack.close()
        if weights is not None:
            weights.close()
        client.close()
    return out


def _exit_with_parent(parent: int) -> None:
    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)  # orphaned: the run that started us is gone

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def keygen(out: str | os.PathLike) -> SigningKey:
    """A new worker key written to ``out`` (mode 0600; an existing file is never overwritten)."""
    key = SigningKey.generate()
    key.save(out)
    return key


def main(argv: list[str] | None = None, prog: str = "intellect worker") -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keygen"]:
        kp = argparse.ArgumentParser(prog=f"{prog} keygen", description="Write a new worker key file (mode 0600).")
        kp.add_argument("--out", required=True, help="Key file to create (never overwritten).")
        args = kp.parse_args(argv[1:])
        try:
            key = keygen(args.out)
        except FileExistsError:
            print(f"{prog}: {args.out} exists; a key is never overwritten", file=sys.stderr)
            return 2
        print(f"worker id: {key.public.id}\npublic key: {key.public.hex}\nkey file: {args.out}")
        return 0
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-url", required=True, help="Base URL of the run's submission service.")
    ap.add_argument("--key", required=True, help="This worker's key file (`intellect worker keygen`).")
    ap.add_argument("--trainer-key", required=True, help="The trainer's public key (64 hex digits), pinned.")
    ap.add_argument("--cache", default=None, help="Folder for downloaded checkpoints (default ./worker-cache).")
    ap.add_argument("--threads", type=int, default=1, help="torch threads.")
    ap.add_argument("--device", default="auto",
                    help="auto (the GPU of LOCAL_RANK within CUDA_VISIBLE_DEVICES, else the CPU), cpu, cuda or cuda:N.")
    ap.add_argument("--parent", type=int, default=None, help=argparse.SUPPRESS)  # exit when this PID is gone
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per shard request otherwise
    if args.parent is not None:
        _exit_with_parent(args.parent)
    try:
        key = SigningKey.load(args.key)
        trainer = VerifyKey.from_hex(args.trainer_key)
    except (OSError, ValueError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    try:
        ComputeConfig(device=args.device)
        resolve_device(args.device)
    except ValueError:  # the config's own pattern
        print(f"{prog}: --device must be auto, cpu, cuda or cuda:N (got {args.device!r})", file=sys.stderr)
        return 2
    except DeviceError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        run_worker(args.run_url, key, trainer, args.cache or "worker-cache", device=args.device)
    except CheckpointTimeout as e:
        log.error("worker %s: %s", key.public.id, e)
        return EXIT_NO_CHECKPOINT
    except ShardcastError as e:
        log.error("worker %s: %s", key.public.id, e)
        return EXIT_NO_WEIGHTS
    except ServiceError as e:
        log.error("worker %s: the service refused: %s", key.public.id, e)
        return EXIT_REFUSED
    except EngineUnavailable as e:
        log.error("worker %s: %s", key.public.id, e)
        return EXIT_NO_ENGINE
    return 0


if __name__ == "__main__":
    sys.exit(main())
