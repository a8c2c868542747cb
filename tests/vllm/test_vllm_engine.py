"""The vLLM engine against the torch engine and the validator's prefill: same seeded tokens, the same
log-probs and hidden states within the tolerances measured here, and weights updated in place."""

from __future__ import annotations

import doctest

import pytest
import torch

from intellect.inference import Request, SamplingParams, TorchEngine, vllm_engine

# Measured on the tiny fp32 model (tests below): log-probs agree within 1e-6 and bf16 hidden states
# within the rounding of fp32 values that differ in their last bits; the bounds leave a few times that.
LOGPROB_ATOL = 1e-5
HIDDEN_RTOL = 2 ** -7  # one bf16 ulp, relative
HIDDEN_ATOL = 1e-2

SETTINGS = [SamplingParams(temperature=1.0, max_tokens=40), SamplingParams(temperature=0.7, top_p=0.8, max_tokens=24),
            SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=1.0, max_tokens=20,
                                                                              stop_at_eos=False)]


def requests(n: int, seed0: int = 0) -> list[Request]:
    # prompts of different lengths (1 to 6 tokens), each with its own seed
    return [Request([1] + [3 + (i * 7 + j) % 40 for j in range(i % 6)], seed=seed0 + 1000 * i) for i in range(n)]


def torch_engine(checkpoints, which="model") -> TorchEngine:
    return TorchEngine.for_tokenizer(checkpoints["models"][which], checkpoints["tok"], capture_hidden=True)


def test_doctests():
    assert doctest.testmod(vllm_engine).failed == 0


def test_same_seed_same_tokens_alone_batched_or_reordered(engine):
    reqs, sp = requests(12), SETTINGS[0]
    first = engine.generate(reqs, sp)
    again = engine.generate(reqs[::-1], sp)[::-1]
    alone = [engine.generate([r], sp)[0] for r in reqs[:3]]
    assert [c.tokens for c in first] == [c.tokens for c in again]
    assert [c.tokens for c in first[:3]] == [c.tokens for c in alone]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(first, again))
    other = engine.generate([Request(r.prompt_ids, r.seed + 1) for r in reqs], sp)
    assert sum(a.tokens != b.tokens for a, b in zip(first, other)) >= 10  # the seed decides


@pytest.mark.parametrize("sp", SETTINGS, ids=["t1", "top_p", "greedy", "no_eos"])
def test_tokens_logprobs_and_hidden_states_equal_the_torch_engine(engine, checkpoints, sp):
    reqs = requests(16)
    got, want = engine.generate(reqs, sp), torch_engine(checkpoints).generate(reqs, sp)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason
        assert g.logprobs.dtype == torch.float32 and g.logprobs.shape == (len(g.tokens),)
        torch.testing.assert_close(g.logprobs, w.logprobs, atol=LOGPROB_ATOL, rtol=0)
        assert g.hidden_states is not None and g.hidden_states.dtype == torch.bfloat16
        torch.testing.assert_close(g.hidden_states.float(), w.hidden_states.float(), atol=HIDDEN_ATOL, rtol=HIDDEN_RTOL)
    if sp.stop_at_eos and sp.max_tokens >= 24:
        assert {"stop", "length"} <= {g.finish_reason for g in got}  # both endings are exercised
    if not sp.stop_at_eos:
        assert all(len(g.tokens) == sp.max_tokens for g in got)


def test_the_validators_prefill_recomputes_every_token(engine, checkpoints):
    reqs, sp = requests(16, seed0=7), SETTINGS[1]
    got = engine.generate(reqs, sp)
    scored = torch_engine(checkpoints).prefill(reqs, [c.tokens for c in got], sp)
    for c, s in zip(got, scored):
        assert s.resampled.tolist() == c.tokens
        torch.testing.assert_close(c.logprobs, s.logprobs, atol=LOGPROB_ATOL, rtol=0)
        torch.testing.assert_close(c.hidden_states.float(), s.hidden_states.float(), atol=HIDDEN_ATOL, rtol=HIDDEN_RTOL)


def test_prompts_prefilled_in_chunks_decode_as_the_torch_engine(vllm_engines, checkpoints):
    """vLLM splits prompts over steps when a step's token budget is spent (long prompts, large
    batches), and samples a discarded token after each partial chunk: the engine keeps the last."""
    eng = vllm_engines("chunked", max_num_batched_tokens=32, enable_chunked_prefill=True)
    reqs = [Request([1] + [3 + (i * 5 + j) % 40 for j in range(30 + i)], seed=i) for i in range(6)]
    sp = SamplingParams(max_tokens=20)
    got, want = eng.generate(reqs, sp), torch_engine(checkpoints).generate(reqs, sp)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.logprobs, w.logprobs, atol=LOGPROB_ATOL, rtol=0)
        torch.testing.assert_close(g.hidden_states.float(), w.hidden_states.float(), atol=HIDDEN_ATOL, rtol=HIDDEN_RTOL)
    assert eng.stats.prefill_rows > len(reqs)  # the partial chunks' rows ran too


def test_stats_count_rows_and_tokens(engine):
    engine.stats.reset()
    out = engine.generate(requests(5), SamplingParams(max_tokens=8, stop_at_eos=False))
    assert engine.stats.tokens == 40 == sum(len(c.tokens) for c in out)
    assert engine.stats.prefill_rows == 5 and engine.stats.row_steps == 40 and engine.stats.useful_share == 1.0


def test_without_capture_no_hidden_states(vllm_engines, checkpoints):
    out = vllm_engines("no-capture", capture_hidden=False).generate(requests(3), SETTINGS[0])
    want = torch_engine(checkpoints).generate(requests(3), SETTINGS[0])
    assert [c.tokens for c in out] == [c.tokens for c in want] and all(c.hidden_states is None for c in out)


def test_weights_update_in_place(vllm_engines, checkpoints):
    """After ``update_weights`` the running engine (the same vLLM object, no restart) samples and scores
    as a fresh torch engine on the new weights; with tied embeddings, vLLM's CPU backend alone would
    keep the old output head. A bf16 checkpoint loads into the fp32 engine as its values upcast."""
    eng = vllm_engines("updates")
    llm, reqs, sp = eng.llm, requests(12), SETTINGS[0]
    before = eng.generate(reqs, sp)  # fills the prefix cache with the old weights' prompts
    for which in ("updated", "updated-bf16", "other", "model"):
        eng.update_weights(checkpoints["folders"][which])
        got, want = eng.generate(reqs, sp), torch_engine(checkpoints, which).generate(reqs, sp)
        assert [c.tokens for c in got] == [c.tokens for c in want], which
        for g, w in zip(got, want):
            torch.testing.assert_close(g.logprobs, w.logprobs, atol=LOGPROB_ATOL, rtol=0)
            torch.testing.assert_close(g.hidden_states.float(), w.hidden_states.float(), atol=HIDDEN_ATOL,
                                       rtol=HIDDEN_RTOL)
    assert [c.tokens for c in got] == [c.tokens for c in before]  # back on the first weights
    assert eng.llm is llm and eng.stats.weight_updates == 4 and eng.stats.weight_update_seconds > 0


def test_a_request_longer_than_the_model_is_refused(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([Request([1] * 10, 0)], SamplingParams(max_tokens=engine.max_model_len))
