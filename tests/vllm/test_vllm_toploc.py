"""TOPLOC proofs from the vLLM engine, checked by the torch validator: honest rollouts pass the
computation, sampling and termination checks over many seeds; a swapped model, a hand-written
completion, a hybrid (another model samples), early termination and a slipped-in EOS fail as they
do for the torch engine's workers (tests/integration/test_toploc_rl.py)."""

from __future__ import annotations

import dataclasses

import pytest

from intellect.data.arithmetic import Problem
from intellect.inference import Request, TorchEngine
from intellect.rl.worker.submission import SubmissionConfig, generate_submission
from intellect.toploc.check import toploc_check
from intellect.toploc.proofs import ToplocConfig, build_proofs

CFG = SubmissionConfig(prompts_per_submission=4, group_size=4, max_tokens=40, temperature=1.0)
PROOFS = ToplocConfig()
TASKS = [Problem(a, "*", b).to_task() for a in range(5) for b in range(4)]


def rows_from(engine, tok, worker="w", step=0, k=0):
    return generate_submission(engine, tok, TASKS, worker, step, k, 0, CFG, run="t", proofs=PROOFS)


@pytest.fixture(scope="module")
def validator(checkpoints):
    return TorchEngine.for_tokenizer(checkpoints["models"]["model"], checkpoints["tok"], capture_hidden=True)


@pytest.fixture(scope="module")
def check(validator, checkpoints):
    return toploc_check(lambda policy: validator, CFG.sampling(), PROOFS, [checkpoints["tok"].eos_token_id])


def test_honest_vllm_rollouts_pass_over_many_seeds(engine, checkpoints, check):
    tok = checkpoints["tok"]
    rows = [r for w in ("w", "v") for k in range(4) for r in rows_from(engine, tok, worker=w, step=1, k=k)]
    assert len(rows) == 128 and len({r.seed for r in rows}) == 128
    assert any(len(r.output_tokens) > 32 for r in rows) and any(r.finish_reason == "stop" for r in rows)
    assert check(rows) == [None] * len(rows)


def test_rollouts_of_a_swapped_model_fail(vllm_engines, checkpoints, check):
    reasons = check(rows_from(vllm_engines("other", "other"), checkpoints["tok"]))
    assert all(r is not None and r.startswith("toploc_") for r in reasons), reasons


def forged(validator, row, tokens):
    """``row`` claiming ``tokens``, its proofs built honestly from the right model's hidden states of
    them: a cheater with the model who wrote the tokens himself."""
    scored = validator.prefill([Request(list(row.prompt_tokens), row.seed)], [tokens], CFG.sampling())[0]
    return dataclasses.replace(row, output_tokens=tuple(tokens), proof=build_proofs(scored.hidden_states))


def test_written_hybrid_and_early_stopped_completions_fail(engine, checkpoints, validator, check):
    tok = checkpoints["tok"]
    rows = rows_from(engine, tok)
    long = [i for i, r in enumerate(rows) if r.finish_reason == "length"]
    a, b, c, d = long[:4]
    edited = list(rows[a].output_tokens)
    edited[5] = (edited[5] + 1) % len(tok)
    rows[a] = forged(validator, rows[a], edited)  # a hand-written token
    hybrid = TorchEngine.for_tokenizer(checkpoints["models"]["other"], tok, capture_hidden=True)
    rows[b] = forged(validator, rows[b], list(rows_from(hybrid, tok)[b].output_tokens))  # another model sampled
    rows[c] = forged(validator, rows[c], list(rows[c].output_tokens[:20]))  # stopped early, no EOS
    rows[d] = forged(validator, rows[d], list(rows[d].output_tokens[:19]) + [tok.eos_token_id])  # an EOS slipped in
    reasons = check(rows)
    assert [reasons[i] for i in (a, b, c, d)] == ["toploc_sampling", "toploc_sampling", "toploc_truncated",
                                                  "toploc_sampling"]
    assert all(r is None for n, r in enumerate(reasons) if n not in (a, b, c, d))
