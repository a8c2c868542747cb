"""Continuous batching: rows that end leave, waiting requests join mid-decode, and every request
decodes as it would alone (tokens, finish reason, logprobs, hidden states)."""

import logging

import pytest
import torch
from pydantic import ValidationError
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from intellect.config import ModelConfig
from intellect.inference import EngineConfig, Request, SamplingParams, TorchEngine
from intellect.inference.kv_slots import KVSlots
from intellect.model.checkpoint import build_model

PROMPTS = ("1+1=", "23*45=", "9-", "77+8=", "5", "600*7=", "12345+678=", "3*3=", "88-9=", "4", "1000-1=")
MAX_TOKENS = (1, 17, 3, 9, 2, 24, 5, 12, 1, 7, 30)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    model, tok = build_model(ModelConfig(num_layers=2, init_seed=5))
    with torch.no_grad():  # a peaked distribution, so greedy and top-p bite and EOS choices repeat
        model.model.norm.weight.mul_(5)
    return model, tok


def _requests(tok):
    return [Request(tok(p)["input_ids"], seed=100 + i) for i, p in enumerate(PROMPTS)]


def _params(temperature, top_p):
    # every third request ignores EOS, so some rows stop early while others run to max_tokens
    return [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=m, stop_at_eos=i % 3 != 2)
            for i, m in enumerate(MAX_TOKENS)]


def _engine(model, eos, pad, **config):
    return TorchEngine(model, eos_token_id=eos, pad_token_id=pad, config=EngineConfig(**config))


def _an_eos_that_occurs(model, tok, reqs, params):
    """A token that several requests sample early on, so making it the EOS stops them midway."""
    free = _engine(model, -1, tok.pad_token_id, max_batch_size=1, scheduling="static")
    counts: dict[int, int] = {}
    for c in free.generate(reqs, params):
        for t in set(c.tokens[1:6]):
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=lambda t: counts[t])


def _assert_same(got, ref):
    for a, b in zip(got, ref):
        assert a.tokens == b.tokens
        assert a.finish_reason == b.finish_reason
        assert torch.allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
        assert a.hidden_states.shape == b.hidden_states.shape
        assert torch.allclose(a.hidden_states.float(), b.hidden_states.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 0.9)])
def test_rows_join_mid_decode_and_decode_as_alone(tiny, temperature, top_p):
    model, tok = tiny
    reqs, params = _requests(tok), _params(temperature, top_p)
    eos = _an_eos_that_occurs(model, tok, reqs, params)
    alone = _engine(model, eos, tok.pad_token_id, max_batch_size=1, scheduling="static").generate(reqs, params)
    assert {c.finish_reason for c in alone} == {"stop", "length"}
    assert len({len(c.tokens) for c in alone}) >= 5  # very different lengths

    static = _engine(model, eos, tok.pad_token_id, max_batch_size=3, scheduling="static")
    _assert_same(static.generate(reqs, params), alone)
    useful = sum(len(c.tokens) for c in alone)
    assert static.stats.tokens == useful and static.stats.useful_share < 0.8  # short rows wait for the longest

    for batch in (2, 3, 64):
        engine = _engine(model, eos, tok.pad_token_id, max_batch_size=batch)
        _assert_same(engine.generate(reqs, params), alone)
        s = engine.stats
        # no forward carries a finished row: one row-step per returned token
        assert s.tokens == useful and s.row_steps == useful and s.useful_share == 1.0
        assert s.prefill_rows == len(reqs) and s.decode_rows == useful - len(reqs)
        assert s.peak_rows == min(batch, len(reqs))
        if batch < len(reqs):
            assert s.prefill_forwards > len(reqs) // batch  # newcomers joined a running batch


def test_order_and_duplicates_do_not_matter(tiny):
    model, tok = tiny
    reqs, params = _requests(tok), _params(1.0, 1.0)
    engine = _engine(model, -1, tok.pad_token_id, max_batch_size=2)
    ref = engine.generate(reqs, params)
    _assert_same(engine.generate(reqs[::-1], params[::-1])[::-1], ref)
    twice = engine.generate(reqs + reqs, params + params)
    _assert_same(twice[: len(reqs)], ref)
    _assert_same(twice[len(reqs):], ref)
    assert engine.generate([], SamplingParams()) == []


def test_kv_budget_holds_requests_back_and_one_always_runs(tiny):
    model, tok = tiny
    reqs, params = _requests(tok), _params(1.0, 0.9)
    ref = _engine(model, -1, tok.pad_token_id, max_batch_size=1, scheduling="static").generate(reqs, params)
    reserve = [len(r.prompt_ids) + p.max_tokens for r, p in zip(reqs, params)]
    budget = sorted(reserve)[-1] + sorted(reserve)[-2]  # the two largest fit together, not three
    for scheduling in ("continuous", "static"):
        engine = _engine(model, -1, tok.pad_token_id, max_batch_size=8, kv_budget_tokens=budget,
                         scheduling=scheduling)
        _assert_same(engine.generate(reqs, params), ref)
        assert engine.stats.peak_reserved_tokens <= budget
        assert 2 <= engine.stats.peak_rows < 8
    tight = _engine(model, -1, tok.pad_token_id, max_batch_size=8, kv_budget_tokens=1)  # below any request
    _assert_same(tight.generate(reqs, params), ref)
    assert tight.stats.peak_rows == 1 and tight.stats.useful_share == 1.0


def test_config_and_keyword_arguments(tiny):
    model, tok = tiny
    assert EngineConfig().scheduling == "continuous" and EngineConfig().kv_budget_tokens is None
    for bad in ({"max_batch_size": 0}, {"kv_budget_tokens": 0}, {"scheduling": "dynamic"}, {"typo": 1}):
        with pytest.raises(ValidationError):
            EngineConfig(**bad)
    cfg = EngineConfig(max_batch_size=5, scheduling="static", kv_budget_tokens=100)
    engine = TorchEngine.for_tokenizer(model, tok, config=cfg, max_batch_size=2)
    assert engine.max_batch_size == 2 and engine.config.scheduling == "static"
    assert engine.config.kv_budget_tokens == 100 and cfg.max_batch_size == 5
    with pytest.raises(ValueError, match="max_batch_size"):
        TorchEngine.for_tokenizer(model, tok, max_batch_size=0)
    engine.generate(_requests(tok)[:2], SamplingParams(max_tokens=3))
    assert engine.stats.tokens > 0
    engine.stats.reset()
    assert engine.stats.tokens == 0 and engine.stats.useful_share == 1.0


def _qwen2(**extra):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **extra)
    return Qwen2ForCausalLM(cfg).eval()


def test_qwen2_continuous_equals_alone():
    model = _qwen2()
    reqs = [Request([5, 6, 7, 8, 9][: k % 5 + 1] * (k % 3 + 1), seed=k) for k in range(7)]
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=m) for m in (2, 11, 4, 7, 1, 9, 3)]
    alone = TorchEngine(model, eos_token_id=-1, pad_token_id=0, max_batch_size=1,
                        config=EngineConfig(scheduling="static")).generate(reqs, params)
    engine = TorchEngine(model, eos_token_id=-1, pad_token_id=0, max_batch_size=2)
    _assert_same(engine.generate(reqs, params), alone)
    assert engine.stats.useful_share == 1.0


def test_a_cache_rows_cannot_leave_falls_back_to_static(caplog):
    # sliding-window layers keep a rolling window, not one key and value per column
    model = _qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    reqs = [Request([5, 6, 7][: k + 1], seed=k) for k in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (2, 6, 3)]
    engine = TorchEngine(model, eos_token_id=-1, pad_token_id=0, max_batch_size=2)
    with caplog.at_level(logging.WARNING, logger="intellect.inference"):
        got = engine.generate(reqs, params)
    assert "static batches instead" in caplog.text
    assert [len(c.tokens) for c in got] == [2, 6, 3]
    alone = [engine.generate([r], p)[0] for r, p in zip(reqs, params)]
    assert [c.tokens for c in got] == [c.tokens for c in alone]


def test_kv_slots_join_pads_on_the_left_and_keep_trims_shared_padding():
    def slots(rows, width, start):
        keys = torch.arange(start, start + rows * width, dtype=torch.float32).view(rows, 1, width, 1)
        mask = torch.ones(rows, width, dtype=torch.long)
        return KVSlots(DynamicCache([(keys, -keys)]), mask, {"id": torch.arange(start, start + rows)})

    a, b = slots(2, 3, 0), slots(1, 5, 100)
    a.join(b)
    layer = a.cache.layers[0]
    assert a.width == 5 and len(a) == 3 and layer.keys.shape == (3, 1, 5, 1)
    assert a.mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert layer.keys[0, 0, :, 0].tolist() == [0, 0, 0, 1, 2] and torch.equal(layer.values, -layer.keys)
    assert a.rows["id"].tolist() == [0, 1, 100]
    a.grow()
    assert a.mask.shape == (3, 6) and bool(a.mask[:, -1].all())
    a.keep(torch.tensor([1, 0]))  # the wide row leaves: its two columns were padding for the others
    assert a.width == 4 and a.mask.tolist() == [[1, 1, 1, 1]] * 2 and a.rows["id"].tolist() == [1, 0]
    assert layer.keys.shape == (2, 1, 3, 1)  # the cache gets the grown column from the next forward
    assert layer.keys[0, 0, :, 0].tolist() == [3, 4, 5]
