"""TOPLOC inside an RL step: honest workers' proofs pass the validator's prefill check, and each
cheat (another model, weights perturbed by 20%, an edited token, hybrid sampling, also with the
seeded re-check off, early truncation, a copied or cut proof, an unknown checkpoint, a checkpoint
older than the lag bound, a checkpoint one or three RL updates older than the claimed one) is
rejected with its reason, next to honest rows of the same submission."""

import copy
import dataclasses
import logging

import pytest
import torch

from intellect.config import ModelConfig
from intellect.data.arithmetic import Problem
from intellect.inference import TorchEngine
from intellect.model.checkpoint import build_model
from intellect.rl.wire.rollouts import RolloutLimits, write_submission
from intellect.rl.worker.submission import SubmissionConfig, generate_submission
from intellect.rl.trainer.grpo import GRPOTrainer, RLTrainerConfig, Sample
from intellect.rl.service.validator import validate_submission
from intellect.storage import RunStorage
from intellect.inference.protocol import Request
from intellect.toploc.check import low_prob_surprise, toploc_check
from intellect.toploc.proofs import ToplocConfig, build_proofs

TINY = ModelConfig(num_layers=1, hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=128)
CFG = SubmissionConfig(prompts_per_submission=4, group_size=4, max_tokens=40, temperature=1.0)
PROOFS = ToplocConfig()
TASKS = [Problem(a, "*", b).to_task() for a in range(5) for b in range(4)]


def engine(model, tok):
    return TorchEngine.for_tokenizer(model, tok, capture_hidden=True)


@pytest.fixture(scope="module")
def models():
    model, tok = build_model(TINY)
    other, _ = build_model(TINY.model_copy(update={"init_seed": TINY.init_seed + 1}))
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.mul_(1 + 0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    # a confident model (logits x12: the final norm feeds only the LM head), for the distribution
    # check: the random models above predict nearly uniformly, so any token is as likely as another
    sharp = copy.deepcopy(model)
    with torch.no_grad():
        sharp.model.norm.weight.mul_(12.0)
    return {"model": model, "other": other, "perturbed": perturbed, "sharp": sharp,
            "updated": one_update(model, tok), "tok": tok}


def one_update(model, tok):
    """The checkpoint after ``model``: one AdamW step (lr 1e-2) of next-token loss on random tokens."""
    new = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(new.parameters(), lr=1e-2)
    ids = torch.randint(3, len(tok), (8, 24), generator=torch.Generator().manual_seed(5))
    new(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return new.eval()


def rows_from(models, which, step=0, worker="w", policy=0):
    return generate_submission(engine(models[which], models["tok"]), models["tok"], TASKS, worker, step, 0, policy,
                               CFG, run="t", proofs=PROOFS)


def checker(models):
    validator = engine(models["model"], models["tok"])

    def engine_for(policy):
        if policy != 0:
            raise FileNotFoundError(f"checkpoint {policy}")
        return validator

    return toploc_check(engine_for, CFG.sampling(), PROOFS, [models["tok"].eos_token_id])


def test_honest_rows_carry_proofs_and_pass(models):
    rows = rows_from(models, "model")
    assert all(len(r.proof) == 258 * -(-len(r.output_tokens) // 32) for r in rows)
    assert any(len(r.output_tokens) > 32 for r in rows)  # some rows hold two chunks
    assert checker(models)(rows) == [None] * len(rows)


@pytest.mark.parametrize("which", ["other", "perturbed"])
def test_rows_of_another_model_fail(models, which):
    reasons = checker(models)(rows_from(models, which))
    assert all(r is not None and r.startswith("toploc_") for r in reasons), reasons


def forged(models, row, tokens, right="model"):
    """``row`` claiming ``tokens``, with proofs built from the right model's hidden states of them: a
    cheater who has the model but chose the tokens himself."""
    scored = engine(models[right], models["tok"]).prefill([Request(list(row.prompt_tokens), row.seed)], [tokens],
                                                          CFG.sampling())[0]
    return dataclasses.replace(row, output_tokens=tuple(tokens), proof=build_proofs(scored.hidden_states))


def test_sampling_and_termination_cheats_are_caught(models):
    rows = rows_from(models, "model")
    tok = models["tok"]
    long = [i for i, r in enumerate(rows) if r.finish_reason == "length"]
    a, b, c, d = long[:4]
    edited = list(rows[a].output_tokens)
    edited[5] = (edited[5] + 1) % len(tok)
    rows[a] = forged(models, rows[a], edited)  # one token edited, proofs rebuilt honestly for the edit
    hybrid = rows_from(models, "other")[b]  # another model samples; the right one builds the proofs
    rows[b] = forged(models, rows[b], list(hybrid.output_tokens))
    rows[c] = forged(models, rows[c], list(rows[c].output_tokens[:20]))  # stopped early, no EOS
    rows[d] = forged(models, rows[d], list(rows[d].output_tokens[:19]) + [tok.eos_token_id])  # an EOS slipped in
    reasons = checker(models)(rows)
    assert [reasons[i] for i in (a, b, c, d)] == ["toploc_sampling", "toploc_sampling", "toploc_truncated",
                                                  "toploc_sampling"]
    assert all(r is None for n, r in enumerate(reasons) if n not in (a, b, c, d))
    lenient = toploc_check(lambda p: engine(models["model"], tok), CFG.sampling(),
                           PROOFS.model_copy(update={"max_resampled_fraction": 0.1, "flip_margin": 100.0}),
                           [tok.eos_token_id])
    assert lenient([rows[d]]) == ["toploc_eos_unlikely"]  # past the sampling allowance, the EOS rule holds


def test_copied_and_cut_proofs_are_caught_row_by_row(models):
    """(An edited token is the sampling check's to catch: on this one-layer model it changes only the
    hidden rows after it, too few of a chunk's top-k for the computation check.)"""
    rows = rows_from(models, "model")
    long = [i for i, r in enumerate(rows) if len(r.output_tokens) >= 8]
    j, k, m = long[:3]
    rows[j] = dataclasses.replace(rows[j], proof=rows[k].proof)  # a proof copied from another rollout
    rows[m] = dataclasses.replace(rows[m], proof=rows[m].proof[:-1])
    reasons = checker(models)(rows)
    assert reasons[j] in ("toploc_exponent", "toploc_proof_count") and reasons[m] == "toploc_malformed"
    assert all(r is None for n, r in enumerate(reasons) if n not in (j, m))


def test_unknown_checkpoint_and_ledger_reasons(models, tmp_path):
    storage = RunStorage(f"file://{tmp_path}")
    honest = rows_from(models, "model", step=1)
    unknown = [dataclasses.replace(r, policy_step=1) for r in rows_from(models, "model", step=1, worker="v")]
    files = [write_submission(storage, 1, "w", 0, honest), write_submission(storage, 1, "v", 0, unknown)]

    def verdicts(rel):
        return [v.reason for v in validate_submission(
            storage, rel, tasks=TASKS, tokenizer=models["tok"], step=1, async_level=2,
            limits=RolloutLimits(vocab_size=len(models["tok"])), cfg=CFG, run="t", extra_checks=[checker(models)])]

    assert verdicts(files[0]) == [None] * len(honest)
    assert verdicts(files[1]) == ["toploc_no_checkpoint"] * len(unknown)


def test_hybrid_sampling_is_caught_by_the_distribution_check_alone(models, caplog):
    """Seed 002, section 4.4, with the seeded re-check off (a vLLM worker has no reproducible sampler):
    a weak model (the near-uniform twin) samples, the confident right model builds the proofs. Every
    row is rejected as ``toploc_sampling`` and the log says it was the distribution; the right model's
    own rows pass under the same checks."""
    tok = models["tok"]
    cfg = PROOFS.model_copy(update={"seeded_check": False})
    validator = engine(models["sharp"], tok)
    check = toploc_check(lambda p: validator, CFG.sampling(), cfg, [tok.eos_token_id])
    honest = rows_from(models, "sharp")
    assert check(honest) == [None] * len(honest)
    hybrid = [forged(models, row, list(row.output_tokens), right="sharp") for row in rows_from(models, "other")]
    # without the distribution check every hybrid row passes: its proofs are the right model's
    assert toploc_check(lambda p: validator, CFG.sampling(), cfg.model_copy(update={"distribution_check": False})
                        )(hybrid) == [None] * len(hybrid)
    with caplog.at_level(logging.INFO, logger="intellect.toploc.check"):
        reasons = check(hybrid)
    assert reasons == ["toploc_sampling"] * len(hybrid)
    assert len(caplog.messages) == len(hybrid) and all("distribution" in m for m in caplog.messages)
    assert any("distribution (rollout)" in m for m in caplog.messages)  # long rows fail alone, not only pooled


COMPUTATION = {"toploc_exponent", "toploc_mantissa", "toploc_sign"}


def test_a_checkpoint_older_than_the_lag_bound(models, tmp_path):
    """Step 3 with ``async_level`` 2 takes checkpoints 1 to 3; a worker still holding checkpoint 0
    (i) claims checkpoint 1: the validator prefills checkpoint 1, whose hidden states are not the
    committed ones, and rejects every row by the computation check; or (ii) says 0: the whole file is
    ``stale`` before any prefill. An honest worker of checkpoint 1 passes.

    Checkpoint 1 here is one AdamW step at lr 1e-2 past 0. Only weights that moved beyond the
    computation check's tolerance are caught this way: two checkpoints of the tiny RL run one update
    apart (lr 1e-4) are not told apart by it (0 or 1 of 128 rows rejected); the seeded re-check
    pooled per submission catches those (the next test)."""
    tok = models["tok"]
    storage = RunStorage(f"file://{tmp_path}")
    checkpoints = {0: engine(models["model"], tok), 1: engine(models["updated"], tok)}

    def engine_for(policy):
        if policy not in checkpoints:
            raise FileNotFoundError(f"checkpoint {policy}")
        return checkpoints[policy]

    check = toploc_check(engine_for, CFG.sampling(), PROOFS, [tok.eos_token_id])
    honest = rows_from(models, "updated", step=3, worker="w", policy=1)
    claimed = rows_from(models, "model", step=3, worker="v", policy=1)
    labelled = rows_from(models, "model", step=3, worker="u", policy=0)
    files = [write_submission(storage, 3, w, 0, rows) for w, rows in (("w", honest), ("v", claimed), ("u", labelled))]

    def verdicts(rel):
        return validate_submission(storage, rel, tasks=TASKS, tokenizer=tok, step=3, async_level=2,
                                   limits=RolloutLimits(vocab_size=len(tok)), cfg=CFG, run="t", extra_checks=[check])

    assert [v.reason for v in verdicts(files[0])] == [None] * len(honest)
    got = [v.reason for v in verdicts(files[1])]
    assert len(got) == len(claimed) and set(got) <= COMPUTATION, got
    assert [(v.row, v.reason) for v in verdicts(files[2])] == [(-1, "stale")]


#: a submission of configs/rl-tiny.toml: 32 prompts x 8 samples, 8 tokens at most, temperature 1
RL_TINY = SubmissionConfig(prompts_per_submission=32, group_size=8, max_tokens=8, temperature=1.0)
RL_TASKS = [Problem(a, op, b).to_task() for a in range(10) for op in "+-*" for b in range(10)]
#: honest_flip_rate of CPU workers in fp32 (configs/rl-tiny.toml): they flip no near-tie
CPU_FLIP_RATE = 1e-4


def ones(text, _task):
    """A reward the random model can learn (it cannot do arithmetic): the digits 1 it writes."""
    return float(text.count("1"))


@pytest.fixture(scope="module")
def rl_checkpoints(models):
    """Checkpoints 0 to 3 of a GRPO run at rl-tiny's lr (1e-4, one optimizer step per RL step, each
    step on one rl-tiny-sized submission of the previous checkpoint's rollouts), after three steps
    of burn-in so that AdamW's moments are a running optimizer's, not a first step's sign update."""
    tok = models["tok"]
    trainer = GRPOTrainer(copy.deepcopy(models["model"]), tok,
                          RLTrainerConfig(lr=1e-4, warmup_steps=0, steps_per_rollout=1, micro_batch_tokens=4096))
    out = []
    for step in range(7):
        rows = generate_submission(engine(trainer.model.eval(), tok), tok, RL_TASKS, "trainer", step, 0, step, RL_TINY,
                                   run="t", reward_fn=ones)
        if step >= 3:
            out.append(copy.deepcopy(trainer.model).eval())
        if step < 6:
            trainer.train_step([Sample(r.prompt_tokens, r.output_tokens, r.advantage) for r in rows])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("lag", [1, 3])
def test_a_checkpoint_a_few_rl_updates_stale_is_caught_pooled(models, rl_checkpoints, lag, caplog):
    """A worker generates with checkpoint ``3 - lag`` of an RL run at rl-tiny's lr and claims 3. The
    computation check does not tell such close weights apart, and few rows hold a token the seeded
    re-check disowns; pooled per submission at the CPU flip rate those tokens fail every row that
    passed the computation check. Honest submissions of checkpoint 3 pass at both rates."""
    tok = models["tok"]
    validator = engine(rl_checkpoints[3], tok)
    sampling = RL_TINY.sampling()
    cpu = PROOFS.model_copy(update={"honest_flip_rate": CPU_FLIP_RATE})
    checks = {rate: toploc_check(lambda _p: validator, sampling, cfg, [tok.eos_token_id])
              for rate, cfg in ((PROOFS.honest_flip_rate, PROOFS), (CPU_FLIP_RATE, cpu))}

    def submission(model, worker):
        return generate_submission(engine(model, tok), tok, RL_TASKS, worker, 9, 0, 3, RL_TINY, run="t", proofs=PROOFS)

    honest = [submission(rl_checkpoints[3], f"h{s}") for s in range(2)]
    stale = [submission(rl_checkpoints[3 - lag], f"s{s}") for s in range(2)]
    for rows in honest:
        for rate, check in checks.items():
            assert check(rows) == [None] * len(rows), rate
    for rows in stale:
        scored = validator.prefill([Request(list(r.prompt_tokens), r.seed) for r in rows],
                                   [list(r.output_tokens) for r in rows], sampling)
        differ = [int((s.resampled != torch.tensor(r.output_tokens)).sum()) for s, r in zip(scored, rows)]
        tokens = sum(len(r.output_tokens) for r in rows)
        at_default = checks[PROOFS.honest_flip_rate](rows)
        with caplog.at_level(logging.INFO, logger="intellect.toploc.check"):
            caplog.clear()
            reasons = checks[CPU_FLIP_RATE](rows)
        computation = sum(r in COMPUTATION for r in reasons)
        print(f"{lag} update(s) stale: {sum(differ)} of {tokens} tokens differ ({sum(d > 0 for d in differ)} rows); "
              f"{computation} rows fail the computation check; surprise "
              f"{float(low_prob_surprise(float(sum(differ)), CPU_FLIP_RATE * tokens)):.1f} at {CPU_FLIP_RATE:g}, "
              f"{float(low_prob_surprise(float(sum(differ)), PROOFS.honest_flip_rate * tokens)):.1f} at "
              f"{PROOFS.honest_flip_rate:g}; rows rejected at {PROOFS.honest_flip_rate:g}: "
              f"{sum(r is not None for r in at_default)} of {len(rows)}")
        assert computation < len(rows) // 4  # the computation check alone lets most rows through
        assert set(reasons) <= COMPUTATION | {"toploc_sampling"}, reasons
        assert any("seeded re-check (submission)" in m for m in caplog.messages)
