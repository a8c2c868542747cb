import doctest

import pytest
import torch
from pydantic import ValidationError
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

import intellect.inference.sampling

from intellect.config import ModelConfig
from intellect.inference import (
    Request,
    SamplingParams,
    TorchEngine,
    chosen_logprobs,
    sample,
    sample_token,
    top_p_mask,
    uniforms,
)
from intellect.model.checkpoint import build_model

PROMPTS = ("1+1=", "23*45=", "9-", "77+8=", "5", "600*7=")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    model, tok = build_model(ModelConfig(num_layers=2, init_seed=5))
    with torch.no_grad():  # a peaked distribution (random init is near uniform), so greedy and top-p bite
        model.model.norm.weight.mul_(5)
    return model, tok


def _requests(tok, seeds=None):
    return [Request(tok(p)["input_ids"], seed=i if seeds is None else seeds[i]) for i, p in enumerate(PROMPTS)]


# ---------------------------------------------------------------------- sampling (pure)


def test_sampling_docstring_examples():
    assert doctest.testmod(intellect.inference.sampling).failed == 0


def test_uniforms_are_a_pure_function_of_seed_position_and_token_id():
    u = uniforms([0, 1, 2**62 + 5], 7, 1000)
    assert u.shape == (3, 1000) and u.dtype == torch.float32
    assert bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u[2], uniforms(2**62 + 5, 7, 1000))
    assert torch.equal(u[:, :10], uniforms([0, 1, 2**62 + 5], 7, 10))  # vocab size does not move the stream
    assert torch.equal(uniforms(3, [0, 1, 2], 4)[1], uniforms(3, 1, 4))
    rows = uniforms(torch.arange(50), torch.arange(50) % 3, 64)
    assert len({tuple(r.tolist()) for r in rows}) == 50
    big = uniforms(11, torch.arange(4000), 50).flatten()
    assert abs(big.mean().item() - 0.5) < 0.005 and abs(big.var().item() - 1 / 12) < 0.002
    hist = torch.histc(big, bins=10, min=0, max=1) / big.numel()
    assert (hist - 0.1).abs().max() < 0.005
    # neighbouring seeds and positions are uncorrelated
    a, b = uniforms(torch.arange(2000), 0, 50), uniforms(torch.arange(2000) + 1, 0, 50)
    assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < 0.02
    with pytest.raises(ValueError, match="seeds must be"):
        uniforms(-1, 0, 4)


def test_top_p_keeps_the_smallest_prefix_reaching_p_and_always_the_top_token():
    z = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]], dtype=torch.float64)).float()

    def kept(p):
        return (top_p_mask(z, torch.tensor([p])) > float("-inf"))[0].tolist()

    assert kept(1.0) == [True] * 4
    assert kept(0.39) == [False, True, False, False]
    assert kept(0.41) == [False, True, False, True]
    assert kept(0.75) == [False, True, True, True]
    assert kept(0.95) == [True] * 4
    assert kept(1e-9) == [False, True, False, False]
    tie = torch.zeros(1, 4)  # equal probabilities: ranked by token id
    assert (top_p_mask(tie, torch.tensor([0.5])) > float("-inf"))[0].tolist() == [True, True, False, False]
    both = top_p_mask(torch.cat([z, z]), torch.tensor([0.39, 1.0]))
    assert torch.isinf(both[0]).sum() == 3 and not torch.isinf(both[1]).any()


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.5, 1.0), (1.0, 0.75), (2.0, 0.9)])
def test_gumbel_max_draws_from_the_tempered_nucleus_distribution(temperature, top_p):
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0, 0.5])
    n = 40_000
    u = uniforms(99, torch.arange(n), 5)
    tokens = sample(logits.expand(n, 5), torch.full((n,), temperature), torch.full((n,), top_p), u)
    z = logits / temperature
    expected = torch.softmax(top_p_mask(z[None], torch.tensor([top_p]))[0], -1)
    freq = torch.bincount(tokens, minlength=5) / n
    assert (freq - expected).abs().max() < 0.01, (freq, expected)


def test_greedy_rows_ignore_noise_and_take_the_first_maximum():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    assert sample(logits, torch.zeros(2), torch.ones(2), None).tolist() == [1, 0]
    mixed = sample(logits, torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]), uniforms([1, 2], 0, 4))
    assert mixed[0] == 1
    assert sample_token(logits[0], 0.0, 0.3, uniforms(5, 5, 4)) == 1


def test_sample_token_is_the_batched_rule_row_by_row():
    logits = torch.randn(64, 51, generator=torch.Generator().manual_seed(0)) * 3
    t, p = torch.rand(64) + 0.2, torch.rand(64) * 0.9 + 0.1
    u = uniforms(torch.arange(64), torch.arange(64), 51)
    batched = sample(logits, t, p, u)
    assert [sample_token(logits[i], float(t[i]), float(p[i]), u[i]) for i in range(64)] == batched.tolist()


def test_chosen_logprobs_are_tempered_log_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    lp = chosen_logprobs(logits, torch.tensor([2, 2]), torch.tensor([0.0, 0.5]))
    assert torch.allclose(lp, torch.stack([torch.log_softmax(logits[0], -1)[2], torch.log_softmax(logits[1] * 2, -1)[2]]))


def test_sampling_params_and_requests_are_validated():
    assert SamplingParams().temperature == 1.0
    for bad in ({"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_tokens": 0}, {"typo": 1}):
        with pytest.raises(ValidationError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="at least one token"):
        Request([], seed=0)
    with pytest.raises(ValueError, match="seed must be"):
        Request([1], seed=-1)


# ---------------------------------------------------------------------- engine


def _greedy_without_cache(model, prompt, n, eos):
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == eos:
                break
            ids.append(nxt)
    return out


def test_greedy_equals_step_by_step_argmax_and_eos_ends_with_stop(tiny):
    model, tok = tiny
    reqs = _requests(tok)
    free = TorchEngine(model, eos_token_id=-1, pad_token_id=tok.pad_token_id, max_batch_size=4)
    runs = free.generate(reqs, SamplingParams(temperature=0, max_tokens=8))
    for r, c in zip(reqs, runs):
        assert c.tokens == _greedy_without_cache(model, r.prompt_ids, 8, -1)
        assert c.finish_reason == "length" and len(c.tokens) == 8
    # make a token the first prompt emits at step 3 the EOS: that row stops there, EOS included
    eos = runs[0].tokens[3]
    stopping = TorchEngine(model, eos_token_id=[eos, -5], pad_token_id=tok.pad_token_id)
    for c, ref in zip(stopping.generate(reqs, SamplingParams(temperature=0, max_tokens=8)), runs):
        cut = ref.tokens.index(eos) + 1 if eos in ref.tokens else 8
        assert c.tokens == ref.tokens[:cut]
        assert c.finish_reason == ("stop" if eos in ref.tokens else "length")
        assert c.hidden_states.shape == (cut, model.config.hidden_size) and c.logprobs.shape == (cut,)
    ignore = stopping.generate(reqs[:1], SamplingParams(temperature=0, max_tokens=8, stop_at_eos=False))[0]
    assert ignore.tokens == runs[0].tokens and ignore.finish_reason == "length"


def test_sampling_depends_only_on_seed_not_batch_order_size_or_padding(tiny):
    model, tok = tiny
    reqs = _requests(tok)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10)
    engine = TorchEngine.for_tokenizer(model, tok)
    ref = engine.generate(reqs, sp)
    alone = [engine.generate([r], sp)[0] for r in reqs]
    reversed_ = engine.generate(reqs[::-1], sp)[::-1]
    small = TorchEngine.for_tokenizer(model, tok, max_batch_size=2).generate(reqs, sp)
    padded = engine.generate([Request(tok("123456789*987654=")["input_ids"], seed=77)] + reqs, sp)[1:]
    for run in (alone, reversed_, small, padded):
        for a, b in zip(ref, run):
            assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
            assert torch.allclose(a.logprobs, b.logprobs, atol=1e-4)
    other = engine.generate(_requests(tok, seeds=[1000 + i for i in range(len(PROMPTS))]), sp)
    assert sum(a.tokens != b.tokens for a, b in zip(ref, other)) >= len(PROMPTS) - 1
    twins = engine.generate([reqs[0], Request(reqs[0].prompt_ids, seed=1)], sp)
    assert twins[0].tokens != twins[1].tokens


def test_mixed_sampling_params_and_lengths_in_one_batch(tiny):
    model, tok = tiny
    reqs = _requests(tok)[:3]
    params = [
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0.7, top_p=0.5, max_tokens=9),
        SamplingParams(temperature=1.5, max_tokens=1),
    ]
    engine = TorchEngine(model, eos_token_id=-1, pad_token_id=tok.pad_token_id)
    out = engine.generate(reqs, params)
    assert [len(c.tokens) for c in out] == [3, 9, 1]
    assert [engine.generate([r], p)[0].tokens for r, p in zip(reqs, params)] == [c.tokens for c in out]
    with pytest.raises(ValueError, match="2 SamplingParams for 3"):
        engine.generate(reqs, params[:2])
    assert engine.generate([], SamplingParams()) == []


def test_hidden_states_are_post_norm_lm_head_inputs():
    """transformers 5.24: ``hidden_states[-1]`` is tied to ``last_hidden_state`` (after ``model.norm``)."""
    model, tok = build_model(ModelConfig(num_layers=2, init_seed=1))
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.linspace(0.5, 2.0, model.config.hidden_size))  # a non-trivial norm
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    last_layer = []
    handle = model.model.layers[-1].register_forward_hook(lambda m, a, o: last_layer.append(o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    handle.remove()
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert torch.allclose(out.hidden_states[-1], model.model.norm(last_layer[0]), atol=1e-6)
    assert not torch.allclose(out.hidden_states[-1], last_layer[0], atol=1e-2)
    assert torch.allclose(model.lm_head(out.hidden_states[-1]), out.logits, atol=1e-5)

    engine = TorchEngine.for_tokenizer(model, tok)
    c = engine.generate([Request(ids[0].tolist(), seed=3)], SamplingParams(max_tokens=6, stop_at_eos=False))[0]
    full = torch.tensor([ids[0].tolist() + c.tokens])
    with torch.no_grad():
        ref = model(full, output_hidden_states=True).hidden_states[-1][0].to(torch.bfloat16)
    p = ids.shape[1]
    produced = ref[p - 1 : p - 1 + len(c.tokens)]  # position len(prompt)-1+i produced token i
    assert torch.allclose(c.hidden_states.float(), produced.float(), rtol=1e-2, atol=1e-2)
    fed = ref[p : p + len(c.tokens)]
    assert not torch.allclose(c.hidden_states.float(), fed[: len(c.tokens)].float(), rtol=1e-2, atol=1e-2)


def test_prefill_reproduces_hidden_states_logprobs_and_choices(tiny):
    model, tok = tiny
    reqs = _requests(tok)
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12)
    engine = TorchEngine.for_tokenizer(model, tok, max_batch_size=4)
    gens = engine.generate(reqs, sp)
    scored = engine.prefill(reqs, [c.tokens for c in gens], sp)
    for r, c, s in zip(reqs, gens, scored):
        assert s.hidden_states.dtype == torch.bfloat16 and s.hidden_states.shape == c.hidden_states.shape
        assert torch.allclose(s.hidden_states.float(), c.hidden_states.float(), rtol=1e-2, atol=1e-2)
        assert torch.allclose(s.logprobs, c.logprobs, atol=1e-4)
        assert s.resampled.tolist() == c.tokens
        # a loop over sample_token on a plain forward's logits gives the same choices
        with torch.no_grad():
            logits = model(torch.tensor([r.prompt_ids + c.tokens[:-1]])).logits[0, len(r.prompt_ids) - 1:]
        u = uniforms(r.seed, torch.arange(len(c.tokens)), logits.shape[-1])
        assert [sample_token(logits[i], sp.temperature, sp.top_p, u[i]) for i in range(len(c.tokens))] == c.tokens
    # a forged token is caught by resampling
    forged = list(gens[0].tokens)
    forged[1] = (forged[1] + 1) % model.config.vocab_size
    assert engine.prefill(reqs[:1], [forged], sp)[0].resampled[1] != forged[1]
    empty = engine.prefill(reqs[:2], [[], gens[1].tokens], sp)
    assert empty[0].hidden_states.shape == (0, model.config.hidden_size) and empty[1].resampled.tolist() == gens[1].tokens
    with pytest.raises(ValueError, match="1 outputs for 2"):
        engine.prefill(reqs[:2], [[]], sp)


def test_capture_can_be_turned_off(tiny):
    model, tok = tiny
    sp = SamplingParams(max_tokens=4)
    on = TorchEngine.for_tokenizer(model, tok).generate(_requests(tok), sp)
    off = TorchEngine.for_tokenizer(model, tok, capture_hidden=False).generate(_requests(tok), sp)
    assert all(c.hidden_states is None for c in off)
    assert [c.tokens for c in on] == [c.tokens for c in off]
    assert not model.lm_head._forward_pre_hooks  # the hook never outlives a call


def _other_architecture(name):
    torch.manual_seed(0)
    if name == "qwen2":  # INTELLECT-2's base (QwQ-32B) family: GQA, untied head
        cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        return Qwen2ForCausalLM(cfg).eval()
    cfg = GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(cfg).eval()  # learned positions, LayerNorm named ln_f


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_other_hf_architectures(arch):
    model = _other_architecture(arch)
    engine = TorchEngine(model, eos_token_id=-1, pad_token_id=0, max_batch_size=2)
    reqs = [Request([5, 6, 7][: k + 1] * (k + 1), seed=k) for k in range(3)]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6)
    gens = engine.generate(reqs, sp)
    assert [engine.generate([r], sp)[0].tokens for r in reqs] == [c.tokens for c in gens]
    for r, c, s in zip(reqs, gens, engine.prefill(reqs, [c.tokens for c in gens], sp)):
        assert s.resampled.tolist() == c.tokens
        with torch.no_grad():
            ref = model(torch.tensor([r.prompt_ids + c.tokens]), output_hidden_states=True).hidden_states[-1][0]
        p = len(r.prompt_ids)
        assert torch.allclose(c.hidden_states.float(), ref[p - 1 : p + 5].to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_cuda_engine_matches_cpu(tiny):
    model, tok = tiny
    assert torch.equal(uniforms(torch.arange(8), 3, 51, device="cuda").cpu(), uniforms(torch.arange(8), 3, 51))
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10)
    cpu = TorchEngine.for_tokenizer(model, tok).generate(_requests(tok), sp)
    gpu_model, _ = build_model(ModelConfig(num_layers=2, init_seed=5))
    gpu_model.load_state_dict(model.state_dict())
    gpu = TorchEngine.for_tokenizer(gpu_model.cuda(), tok).generate(_requests(tok), sp)
    assert sum(a.tokens == b.tokens for a, b in zip(cpu, gpu)) >= len(PROMPTS) - 1
    assert all(torch.allclose(a.hidden_states.float(), b.hidden_states.float(), rtol=2e-2, atol=2e-2)
               for a, b in zip(cpu, gpu) if a.tokens == b.tokens)
