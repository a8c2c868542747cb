"""TOPLOC inside an RL step: honest workers' proofs pass the validator's prefill check, and each
cheat (another model, weights perturbed by 20%, an edited token, hybrid sampling, early
truncation, a copied or cut proof, an unknown checkpoint) is rejected with its reason, next to
honest rows of the same submission."""

import copy
import dataclasses

import pytest
import torch

from intellect.config import ModelConfig
from intellect.data.arithmetic import Problem
from intellect.inference import TorchEngine
from intellect.model.checkpoint import build_model
from intellect.rl.rollouts import RolloutLimits, write_submission
from intellect.rl.submission import SubmissionConfig, generate_submission
from intellect.rl.validator import validate_submission
from intellect.storage import RunStorage
from intellect.inference.protocol import Request
from intellect.toploc.check import toploc_check
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
    return {"model": model, "other": other, "perturbed": perturbed, "tok": tok}


def rows_from(models, which, step=0, worker="w"):
    return generate_submission(engine(models[which], models["tok"]), models["tok"], TASKS, worker, step, 0, 0, CFG,
                               run="t", proofs=PROOFS)


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


def forged(models, row, tokens):
    """``row`` claiming ``tokens``, with proofs built from the right model's hidden states of them: a
    cheater who has the model but chose the tokens himself."""
    scored = engine(models["model"], models["tok"]).prefill([Request(list(row.prompt_tokens), row.seed)], [tokens],
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
                           PROOFS.model_copy(update={"max_resampled_fraction": 0.1}), [tok.eos_token_id])
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
