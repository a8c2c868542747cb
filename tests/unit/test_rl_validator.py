"""The validator against bad input, each a test: every bad file is rejected with its reason in the
ledger, the honest submission of the same step is still accepted, and nothing raises."""

import dataclasses
import hashlib
import io
import math

import pyarrow.parquet as pq
import pytest

from intellect.config import ModelConfig
from intellect.data.arithmetic import Problem
from intellect.inference import TorchEngine
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.rl.wire.assignment import assign_prompts
from intellect.rl.wire.rollouts import RolloutLimits, encode_submission, rows_to_table, submission_path, write_submission
from intellect.rl.worker.submission import (
    SubmissionConfig,
    advantages_of,
    completion_text,
    generate_assigned,
    generate_submission,
    math_task_reward,
    sample_seed,
    unclaimed_reward,
)
from intellect.rl.service.validator import assigned_seeds, validate_submission
from intellect.storage import RunStorage
from intellect.trust.keys import SigningKey

TINY = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
CFG = SubmissionConfig(prompts_per_submission=2, group_size=3, max_tokens=4)
TASKS = [Problem(a, "+", b).to_task() for a in range(4) for b in range(3)]
RUN = "test"


@pytest.fixture(scope="module")
def tiny():
    model, tok = build_model(TINY)
    return TorchEngine.for_tokenizer(model, tok, capture_hidden=False), tok, {}


class Env:
    def __init__(self, tiny, tmp_path):
        self.engine, self.tok, self._generated = tiny
        self.storage = RunStorage(f"file://{tmp_path}/run")
        self.ledger = Ledger(tmp_path / "ledger.duckdb")
        self.limits = RolloutLimits(vocab_size=len(self.tok))

    def rows(self, worker, step=0, k=0, policy_step=0):
        key = (worker, step, k, policy_step)  # generation is deterministic: share it between tests
        if key not in self._generated:
            self._generated[key] = generate_submission(
                self.engine, self.tok, TASKS, worker, step, k, policy_step, CFG, run=RUN)
        return list(self._generated[key])

    def honest(self, worker="honest", step=0, policy_step=0):
        return write_submission(self.storage, step, worker, 0, self.rows(worker, step, 0, policy_step))

    def raw(self, step, worker, k, data: bytes):
        rel = submission_path(step, worker, k)
        self.storage.write_bytes(rel, data)
        return rel

    def validate(self, step, files, async_level=2, **kw):
        """Validate and record each file; returns the ledger's ``{file: [(row, status, reason)]}``."""
        for rel in files:
            verdicts = validate_submission(
                self.storage, rel, tasks=TASKS, tokenizer=self.tok, step=step, async_level=async_level,
                limits=self.limits, cfg=CFG, run=RUN, **kw,
            )
            self.ledger.record_verdicts(step, verdicts)
        got = {}
        for r in self.ledger._query("SELECT file, row_index, status, reason FROM rollouts ORDER BY file, row_index"):
            got.setdefault(r["file"], []).append((r["row_index"], r["status"], r["reason"]))
        return got


@pytest.fixture
def env(tiny, tmp_path):
    e = Env(tiny, tmp_path)
    yield e
    e.ledger.close()


def all_accepted(entries):
    return entries and all(status == "accepted" and reason is None for _, status, reason in entries)


def test_honest_submission_is_accepted_with_the_validators_advantages(env):
    rows = env.rows("honest")
    assert len(rows) == CFG.prompts_per_submission * CFG.group_size
    assert [r.seed for r in rows] == [sample_seed("honest", 0, 0, r.group_id, i % CFG.group_size)
                                      for i, r in enumerate(rows)]
    # the worker's advantages are not trusted: whatever it claims, the ledger holds the recomputed ones
    rel = write_submission(env.storage, 0, "honest", 0, [dataclasses.replace(r, advantage=5.0) for r in rows])
    got = env.validate(0, [rel])
    assert all_accepted(got[rel])
    truth = [math_task_reward(completion_text(env.tok, r.output_tokens), next(t for t in TASKS if t.id == r.prompt_id))
             for r in rows]
    want = advantages_of(truth, [r.group_id for r in rows])
    accepted = env.ledger.accepted(0)
    assert [a["reward"] for a in accepted] == pytest.approx(truth)
    assert [a["advantage"] for a in accepted] == pytest.approx(want, abs=1e-6)


def test_wrong_schema_is_rejected(env):
    ok = env.honest()
    bad_table = rows_to_table(env.rows("bad")).drop_columns(["proof"])
    buf = io.BytesIO()
    pq.write_table(bad_table, buf)
    bad = env.raw(0, "bad", 0, buf.getvalue())
    garbage = env.raw(0, "garbage", 0, b"PAR1 not really parquet")
    got = env.validate(0, [bad, garbage, ok])
    assert got[bad] == [(-1, "rejected", "schema")]
    assert got[garbage] == [(-1, "rejected", "unreadable")]
    assert all_accepted(got[ok])


@pytest.mark.parametrize(
    ("change", "reason"),
    [({"reward": math.nan}, "nan"), ({"advantage": math.inf}, "nan"), ({"advantage": 1e9}, "range"),
     ({"task_reward": -1e4}, "range"), ({"output_tokens": (10**6,)}, "range")],
)
def test_nan_and_out_of_range_values_are_rejected(env, change, reason):
    ok = env.honest()
    rows = env.rows("bad")
    rows[1] = dataclasses.replace(rows[1], **change)
    bad = env.raw(0, "bad", 0, encode_submission(rows))
    got = env.validate(0, [bad, ok])
    assert got[bad] == [(-1, "rejected", reason)]
    assert all_accepted(got[ok])


def test_wrong_step_is_rejected(env):
    ok = env.honest()
    bad = env.raw(0, "bad", 0, encode_submission(env.rows("bad", step=1)))  # rows for step 1 in step 0
    got = env.validate(0, [bad, ok])
    assert got[bad] == [(-1, "rejected", "wrong_step")]
    assert all_accepted(got[ok])


def test_stale_policy_step_is_rejected(env):
    ok = env.honest(step=3, policy_step=1)
    stale = env.honest("stale", step=3, policy_step=0)  # lag 3 > async_level 2
    got = env.validate(3, [stale, ok], async_level=2)
    assert got[stale] == [(-1, "rejected", "stale")]
    assert all_accepted(got[ok])


def test_contradicted_reward_claim_rejects_that_row_only(env):
    ok = env.honest()
    rows = env.rows("liar")
    truth = rows[0].task_reward
    rows[0] = dataclasses.replace(rows[0], reward=1.0 - truth, task_reward=1.0 - truth)
    rows[4] = dataclasses.replace(rows[4], length_penalty=0.5, reward=rows[4].task_reward - 0.5)
    liar = write_submission(env.storage, 0, "liar", 0, rows)
    got = env.validate(0, [liar, ok])
    assert [(i, reason) for i, status, reason in got[liar] if status == "rejected"] == [
        (0, "reward_mismatch"), (4, "reward_mismatch")]
    assert all_accepted([e for e in got[liar] if e[0] not in (0, 4)])
    assert all_accepted(got[ok])


def test_prompts_not_matching_the_assignment_are_rejected(env):
    ok = env.honest()
    assert assign_prompts(len(TASKS), "other", 0, 0, 2) != assign_prompts(len(TASKS), "cheat", 0, 0, 2)
    # the prompts another worker was assigned (say, easier ones), relabelled as its own
    rows = [dataclasses.replace(r, worker="cheat") for r in env.rows("other")]
    cheat = write_submission(env.storage, 0, "cheat", 0, rows)
    # right prompt ids, but other prompt tokens
    rows = env.rows("swap")
    rows = [dataclasses.replace(r, prompt_tokens=(1, 5, 5)) if r.group_id == 1 else r for r in rows]
    swap = write_submission(env.storage, 0, "swap", 0, rows)
    got = env.validate(0, [cheat, swap, ok])
    assert got[cheat] == [(i, "rejected", "assignment") for i in range(len(rows))]
    assert got[swap] == [(i, "rejected", "assignment") for i in range(len(rows))]
    assert all_accepted(got[ok])


def test_copy_of_another_workers_rollouts_carries_seeds_not_its_own(env):
    original = env.honest("honest")
    mine = assign_prompts(len(TASKS), "honest", 0, 0, 2)
    # a submission index whose assignment shares a prompt with the original, so the copy passes it
    k = next(k for k in range(100) if set(assign_prompts(len(TASKS), "copier", 0, k, 2)) & set(mine))
    theirs = assign_prompts(len(TASKS), "copier", 0, k, 2)
    j = next(j for j, t in enumerate(theirs) if t in mine)
    source = [r for r in env.rows("honest") if r.group_id == mine.index(theirs[j])]
    rows = env.rows("copier", k=k)
    copied = iter(dataclasses.replace(r, worker="copier", submission=k, group_id=j) for r in source)
    rows = [next(copied) if r.group_id == j else r for r in rows]
    copy = write_submission(env.storage, 0, "copier", k, rows)
    got = env.validate(0, [copy, original])  # the copy first: it cannot make the original a duplicate
    assert all_accepted(got[original])
    assert [(i, s, why) for i, s, why in got[copy] if rows[i].group_id == j] == [
        (i, "rejected", "seed") for i, r in enumerate(rows) if r.group_id == j]
    assert all_accepted([e for e in got[copy] if rows[e[0]].group_id != j])


def test_a_seed_other_than_the_assigned_one_is_rejected_and_checks_see_the_assigned_one(env):
    """The seed check is always on: a row sampled from a seed of the worker's choosing is ``seed``,
    and the extra checks (TOPLOC's seeded re-check) get the validator's seed, never the row's."""
    rows = env.rows("chooser")
    want = assigned_seeds(rows)
    rows[2] = dataclasses.replace(rows[2], seed=12345)
    rel = write_submission(env.storage, 0, "chooser", 0, rows)
    seen = []
    got = env.validate(0, [rel], extra_checks=[lambda rs: seen.extend(r.seed for r in rs) or [None] * len(rs)])
    assert [why for _, _, why in got[rel]] == [None, None, "seed"] + [None] * (len(rows) - 3)
    assert seen == want and 12345 not in seen


def test_a_salted_worker_answers_its_salted_assignment_and_claims_no_reward(env):
    """A worker of the service has a salt (its registry's): its assignment and seeds derive from it,
    and it claims reward 0 (it is told no answer); the same rows checked without the salt fail."""
    salt = bytes(range(32))
    assigned = [TASKS[i] for i in assign_prompts(len(TASKS), "salty", 0, 0, CFG.prompts_per_submission, salt)]
    rows = generate_assigned(env.engine, env.tok, assigned, "salty", 0, 0, 0, CFG, run=RUN,
                             reward_fn=unclaimed_reward, salt=salt)
    rel = write_submission(env.storage, 0, "salty", 0, rows)
    assert all_accepted(env.validate(0, [rel], salt=salt)[rel])
    liar = write_submission(env.storage, 0, "salty", 1, [dataclasses.replace(r, submission=1) for r in rows])
    assert {why for _, _, why in env.validate(0, [liar], salt=salt)[liar]} == {"assignment"}
    unsalted = generate_submission(env.engine, env.tok, TASKS, "plain", 0, 0, 0, CFG, run=RUN)
    rel = write_submission(env.storage, 0, "plain", 0, unsalted)
    assert {why for _, _, why in env.validate(0, [rel], salt=salt)[rel]} == {"assignment"}


def test_extra_checks_hook_rejects_rows_and_drops_them_from_the_baseline(env):
    rel = env.honest()
    got = env.validate(0, [rel], extra_checks=[lambda rows: ["toploc" if i == 0 else None for i in range(len(rows))]])
    assert got[rel][0] == (0, "rejected", "toploc")
    assert all_accepted(got[rel][1:])
    rows = env.rows("honest")
    truth = [math_task_reward(completion_text(env.tok, r.output_tokens), next(t for t in TASKS if t.id == r.prompt_id))
             for r in rows]
    want = advantages_of(truth[1:], [r.group_id for r in rows[1:]])
    assert [a["advantage"] for a in env.ledger.accepted(0)] == pytest.approx(want, abs=1e-6)


def test_revalidating_a_file_records_nothing_twice(env):
    rel = env.honest()
    first = env.validate(0, [rel])
    assert env.validate(0, [rel]) == first
    assert len(env.ledger.accepted(0)) == len(first[rel])


def test_the_service_record_binds_a_file_to_its_key_id_and_bytes(env):
    """A file is validated as the worker the service recorded it for (a key id), with the bytes it
    recorded: a named squatter, a record for another worker, and changed bytes are refused."""

    wid = SigningKey.from_seed(b"w" * 32).public.id
    rel = write_submission(env.storage, 0, wid, 0, env.rows(wid))
    data = env.storage.read_bytes(rel)
    sha = hashlib.sha256(data).hexdigest()
    other = SigningKey.from_seed(b"o" * 32).public.id
    named = write_submission(env.storage, 0, "alice", 0, env.rows("alice"))
    got = env.validate(0, [rel], worker=wid, sha256=sha, size=len(data))
    assert all_accepted(got[rel])
    got = env.validate(0, [named], worker="alice")  # a chosen name is not an identity
    assert got[named] == [(-1, "rejected", "identity")]
    forged = env.raw(0, wid, 1, data)
    got = env.validate(0, [forged], worker=other)  # recorded for another worker than its path says
    assert got[forged] == [(-1, "rejected", "identity")]
    changed = env.raw(0, wid, 2, data)
    got = env.validate(0, [changed], worker=wid, sha256="0" * 64, size=len(data))
    assert got[changed] == [(-1, "rejected", "sha256_mismatch")]


def test_outputs_past_max_tokens_or_with_a_false_finish_reason_are_rejected(env):
    rows = env.rows("lengthy")
    eos = env.tok.eos_token_id
    long = [dataclasses.replace(r, output_tokens=tuple(r.output_tokens) + (5,) * 3, finish_reason="length")
            for r in rows]
    rel = write_submission(env.storage, 0, "lengthy", 0, long)
    assert {reason for _, _, reason in env.validate(0, [rel])[rel]} == {"too_long"}
    short = [dataclasses.replace(r, output_tokens=(5,), finish_reason="length") for r in env.rows("lengthy", k=1)]
    rel = write_submission(env.storage, 0, "lengthy", 1, short)
    assert {reason for _, _, reason in env.validate(0, [rel])[rel]} == {"finish_reason"}
    early = [dataclasses.replace(r, output_tokens=(eos, 5), finish_reason="stop") for r in env.rows("lengthy", k=2)]
    rel = write_submission(env.storage, 0, "lengthy", 2, early)
    assert {reason for _, _, reason in env.validate(0, [rel])[rel]} == {"finish_reason"}
