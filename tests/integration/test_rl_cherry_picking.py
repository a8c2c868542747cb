"""Cherry-picking, run against the real validator, TOPLOC check, ledger and submission service: the
assignment's seed decides the sample, a regenerated copy of another worker's group poisons nothing,
and grinding keys for easy assignments does no better than chance.

* **Chosen seeds.** A worker draws many samples per prompt from the real policy and keeps the ones it
  likes; another writes tokens, prefills them once and searches a seed under which the seeded
  sampler "picks" them. Both pass TOPLOC when it replays the row's own seed (the attack as it was);
  the validator computes the seed itself, so every row is ``seed``, and the same rows relabelled
  with the assigned seeds fail TOPLOC's re-check with that seed.
* **Duplicate poisoning.** A key whose id sorts first regenerates the victim's group with the
  victim's seeds and files it, recorded before the victim's file: its rows are ``seed``, and every
  row of the victim's is accepted.
* **Key grinding.** A grinder makes keys offline and registers those whose (publicly computable,
  unsalted) assignments hold only easy prompts: the real assignments, drawn from the salt the
  service reveals at registration, hold easy prompts at the pool's rate. Registering without the
  proof of work is refused, re-registering draws no new salt, and a key cannot look ahead at
  submission ``k + 1`` before it stored ``k``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from intellect.config import ModelConfig
from intellect.data.arithmetic import Problem
from intellect.data.loaders import MathTask
from intellect.inference import TorchEngine
from intellect.inference.protocol import Request
from intellect.inference.sampling import scores, uniforms
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.rl.wire import work
from intellect.rl.wire.assignment import assign_prompts
from intellect.rl.wire.rollouts import RolloutLimits, write_submission
from intellect.rl.service.server import ServiceConfig, SubmissionService
from intellect.rl.worker.client import ServiceClient, ServiceError
from intellect.rl.worker.submission import SubmissionConfig, generate_assigned, sample_seed, unclaimed_reward
from intellect.rl.service.validator import validate_submission
from intellect.storage import RunStorage
from intellect.toploc.check import toploc_check
from intellect.toploc.proofs import ToplocConfig, build_proofs, completion_proofs
from intellect.trust.keys import SigningKey

TINY = ModelConfig(num_layers=1, hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=128)
CFG = SubmissionConfig(prompts_per_submission=2, group_size=2, max_tokens=24, temperature=1.0)
PROOFS = ToplocConfig()
TASKS = [Problem(a, "+", b).to_task() for a in range(6) for b in range(4)]
RUN = "cherry"


@pytest.fixture(scope="module")
def policy():
    model, tok = build_model(TINY)
    return model, tok, TorchEngine.for_tokenizer(model, tok, capture_hidden=True)


class Validator:
    """validate_submission with TOPLOC on, each file's verdicts recorded in the order given."""

    def __init__(self, policy, tmp_path: Path):
        self.model, self.tok, self.engine = policy
        self.storage = RunStorage(f"file://{tmp_path}/run")
        self.ledger = Ledger(tmp_path / "ledger.duckdb")
        self.check = toploc_check(lambda _policy: self.engine, CFG.sampling(), PROOFS, [self.tok.eos_token_id])

    def __call__(self, files: list[tuple[str, bytes]]) -> dict[str, list[str | None]]:
        verdicts = []
        for rel, salt in files:
            verdicts += validate_submission(self.storage, rel, tasks=TASKS, tokenizer=self.tok, step=0, async_level=0,
                                            limits=RolloutLimits(vocab_size=len(self.tok)), cfg=CFG, run=RUN,
                                            extra_checks=[self.check], salt=salt)
        self.ledger.record_verdicts(0, verdicts)
        got: dict[str, list[str | None]] = {}
        for r in self.ledger._query("SELECT file, row_index, reason FROM rollouts ORDER BY file, row_index"):
            got.setdefault(r["file"], []).append(r["reason"])
        return got


def assigned(worker: str, salt: bytes, k: int = 0) -> list[MathTask]:
    return [TASKS[i] for i in assign_prompts(len(TASKS), worker, 0, k, CFG.prompts_per_submission, salt)]


def honest_rows(v: Validator, worker: str, salt: bytes, k: int = 0):
    return generate_assigned(v.engine, v.tok, assigned(worker, salt, k), worker, 0, k, 0, CFG, run=RUN,
                             proofs=PROOFS, salt=salt, reward_fn=unclaimed_reward)


def best_of(v: Validator, worker: str, salt: bytes, n: int = 16):
    """Per assigned prompt, ``n`` real samples under seeds of the worker's choosing, keeping the
    ``group_size`` longest (the ones it likes), each with its true seed and honest proofs."""
    rows = honest_rows(v, worker, salt)
    out = []
    for j in range(CFG.prompts_per_submission):
        group = [r for r in rows if r.group_id == j]
        seeds = [int.from_bytes(os.urandom(7), "big") for _ in range(n)]
        done = v.engine.generate([Request(list(group[0].prompt_tokens), s) for s in seeds], CFG.sampling())
        proofs = completion_proofs(done, PROOFS)
        liked = sorted(range(n), key=lambda i: -len(done[i].tokens))[:CFG.group_size]
        out += [dataclasses.replace(r, seed=seeds[i], output_tokens=tuple(done[i].tokens),
                                    finish_reason=done[i].finish_reason, proof=proofs[i])
                for r, i in zip(group, liked)]
    return out


def seed_that_picks(v: Validator, prompt: list[int], out: list[int], start: int, batch: int = 1 << 14) -> int:
    """The first seed from ``start`` under which the seeded sampler picks every token of ``out``,
    found from one forward over ``prompt + out`` (no decoding)."""
    with torch.no_grad():
        logits = v.model(input_ids=torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()
    vocab = logits.shape[-1]
    for first in range(start, start + (1 << 26), batch):
        seeds = torch.arange(first, first + batch)
        ok = torch.ones(batch, dtype=torch.bool)
        for t, token in enumerate(out):
            sc = scores(logits[t].expand(batch, vocab), torch.full((batch,), CFG.temperature),
                        torch.full((batch,), CFG.top_p), uniforms(seeds, t, vocab))
            ok &= sc.argmax(-1) == token
        if bool(ok.any()):
            return int(seeds[ok.nonzero()[0, 0]])
    raise AssertionError("no seed found")


def written(v: Validator, worker: str, salt: bytes):
    """Rows whose outputs are written (each task's answer, then EOS), each with a seed searched so
    that the seeded sampler picks them, and proofs from one prefill of the written tokens."""
    rows, start = [], 0
    for r in honest_rows(v, worker, salt):
        task = next(t for t in TASKS if t.id == r.prompt_id)
        out = v.tok(task.answer, add_special_tokens=False)["input_ids"] + [v.tok.eos_token_id]
        seed = seed_that_picks(v, list(r.prompt_tokens), out, start)
        start = seed + 1
        (scored,) = v.engine.prefill([Request(list(r.prompt_tokens), seed)], [out], CFG.sampling())
        rows.append(dataclasses.replace(r, seed=seed, output_tokens=tuple(out), finish_reason="stop",
                                        proof=build_proofs(scored.hidden_states)))
    return rows


@pytest.mark.slow
def test_chosen_seeds_and_searched_seeds_get_no_row_accepted(policy, tmp_path):
    mine = Validator(policy, tmp_path / "own-seeds")
    salts = {w: os.urandom(32) for w in ("honest", "chooser", "writer")}
    cheats = {"chooser": best_of(mine, "chooser", salts["chooser"]),
              "writer": written(mine, "writer", salts["writer"])}
    for worker, rows in cheats.items():
        # TOPLOC replaying each row's own seed lets them all through: the attack as it stood
        assert mine.check(rows) == [None] * len(rows), worker
    n = CFG.prompts_per_submission * CFG.group_size
    honest = (write_submission(mine.storage, 0, "honest", 0, honest_rows(mine, "honest", salts["honest"])),
              salts["honest"])
    got = mine([honest] + [(write_submission(mine.storage, 0, w, 0, rows), salts[w]) for w, rows in cheats.items()])
    assert got[honest[0]] == [None] * n
    for worker in cheats:
        assert got[f"rollouts/step_0/{worker}-0.parquet"] == ["seed"] * n, worker
    assert {a["worker"] for a in mine.ledger.accepted(0)} == {"honest"}
    mine.ledger.close()

    # the same rows claiming their assigned seeds pass the seed check, and TOPLOC replays those seeds
    assigned_seeds = Validator(policy, tmp_path / "assigned-seeds")
    files = []
    for worker, rows in cheats.items():
        relabelled = [dataclasses.replace(r, seed=sample_seed(worker, 0, 0, r.group_id, i % CFG.group_size,
                                                              salts[worker])) for i, r in enumerate(rows)]
        files.append((write_submission(assigned_seeds.storage, 0, worker, 0, relabelled), salts[worker]))
    got = assigned_seeds(files)
    for rel, _ in files:
        assert got[rel] and all(r is not None and r.startswith("toploc_") for r in got[rel]), (rel, got[rel])
    assigned_seeds.ledger.close()


def test_a_regenerated_copy_of_a_victims_group_rejects_no_honest_row(policy, tmp_path):
    v = Validator(policy, tmp_path)
    victim, salt = "victim", os.urandom(32)
    theirs = honest_rows(v, victim, salt)
    # a ground id that sorts first, whose own assignment holds the victim's first prompt as its group
    # 0 (one key in 24 has that), regenerates the victim's group with the victim's seeds (the sampler
    # is deterministic) and files it as its own, next to an honest group of its own
    ground = "0000-ground"
    ground_salt = next(s for s in iter(lambda: os.urandom(32), None)
                       if assigned(ground, s)[0].id == assigned(victim, salt)[0].id)
    regenerated = generate_assigned(v.engine, v.tok, assigned(victim, salt), victim, 0, 0, 0, CFG, run=RUN,
                                    proofs=PROOFS, salt=salt, reward_fn=unclaimed_reward)
    copied = [dataclasses.replace(r, worker=ground) for r in regenerated if r.group_id == 0]
    assert [(r.seed, r.output_tokens) for r in copied] == [(r.seed, r.output_tokens) for r in theirs if r.group_id == 0]
    own = [r for r in honest_rows(v, ground, ground_salt) if r.group_id != 0]
    copy = write_submission(v.storage, 0, ground, 0, copied + own)
    original = write_submission(v.storage, 0, victim, 0, theirs)
    got = v([(copy, ground_salt), (original, salt)])  # the copy arrives and is recorded first
    assert got[original] == [None] * len(theirs)
    assert got[copy][:len(copied)] == ["seed"] * len(copied)  # (TOPLOC's pooled test may fail the rest)


EASY = {t.id for t in TASKS[: len(TASKS) // 2]}


def test_grinding_keys_for_easy_assignments_does_no_better_than_chance(tmp_path):
    bits = 8
    svc = SubmissionService(ServiceConfig(registration_work_bits=bits, registrations_per_minute=1000,
                                          registrations_per_minute_total=1000),
                            run=RUN, storage=RunStorage(str(tmp_path / "run")), state_dir=tmp_path / "state",
                            run_info=lambda: {}, tasks=TASKS, prompts_per_submission=2, committed=-1)
    svc.start()
    try:
        # offline: keys whose assignments, were they a public function of the key, hold only easy prompts
        keys = (SigningKey.generate() for _ in range(100_000))
        ground = []
        while len(ground) < 40:
            key = next(keys)
            if set(t.id for t in assigned(key.public.id, b"")) <= EASY:
                ground.append(key)
        easy = total = 0
        for key in ground:
            with ServiceClient(svc.url, key, audience=RUN, timeout=30, retries=0) as c:
                c.register()
                salt = c.salt
                assert c.register() and c.salt == salt == svc.registry.salt(key.public.id)  # no re-roll
                got = c.assignment(0, 0)
                assert all(set(t) == {"id", "prompt"} for t in got)  # no reference answers
                easy += sum(t["id"] in EASY for t in got)
                total += len(got)
                with pytest.raises(ServiceError) as e:
                    c.assignment(0, 1)  # a look at the next draw before this one is filed
                assert (e.value.status, e.value.reason) == (409, "out_of_range")
        # the pool's share is 1/2: 80 draws at chance fall at or below 60 easy ones but with odds under 1e-5
        assert easy / total <= 0.75, (easy, total)
        # a registration without the proof of work, or with one for another key, is refused
        lazy_key = next(k for k in iter(SigningKey.generate, None) if not work.check(RUN, k.public.raw, 0, bits))
        lazy = ServiceClient(svc.url, lazy_key, audience=RUN, timeout=30, retries=0)
        for doc in ({}, {"work": 0}):
            with pytest.raises(ServiceError) as e:
                lazy._call("POST", "/v1/register", doc=doc)
            assert (e.value.status, e.value.reason) == (403, "work")
        lazy.close()
        assert svc.registry.key(lazy.worker) is None
    finally:
        svc.stop()
