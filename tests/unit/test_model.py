import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from intellect.config import ModelConfig
from intellect.data.arithmetic import ALPHABET
from intellect.model.checkpoint import build_model, load_checkpoint, parameter_count, save_checkpoint
from intellect.model.generate import generate, left_pad
from intellect.model.tokenizer import CHARS, build_tokenizer


def test_tokenizer_covers_the_task_alphabet_one_token_per_char():
    tok = build_tokenizer()
    assert set(ALPHABET) <= set(CHARS)
    text = "12*34=408 (a, b: x/y.)"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.convert_tokens_to_ids("<unk>") == tok("#")["input_ids"][1]


def test_default_model_is_tiny_and_seeded():
    a, _ = build_model(ModelConfig())
    b, _ = build_model(ModelConfig())
    c, _ = build_model(ModelConfig(init_seed=1))
    assert 0.5e6 <= parameter_count(a) <= 2e6
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_checkpoint_round_trips_bit_exactly_with_plain_transformers(tmp_path):
    model, tok = build_model(ModelConfig(num_layers=2, init_seed=3))
    with torch.no_grad():  # non-trivial values everywhere, norms included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    folder = save_checkpoint(model, tok, tmp_path / "ckpt")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert not list(tmp_path.glob(".tmp-*"))
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    for loaded, ltok in (
        load_checkpoint(folder),
        (AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)),
    ):
        s1, s2 = model.state_dict(), loaded.state_dict()
        assert s1.keys() == s2.keys()
        for k in s1:
            assert s1[k].dtype == s2[k].dtype and torch.equal(s1[k], s2[k]), k
        assert ltok("3+4=")["input_ids"] == tok("3+4=")["input_ids"]
        assert (ltok.eos_token_id, ltok.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)


def test_pretrained_path_goes_through_the_same_loader(tmp_path):
    model, tok = build_model(ModelConfig(num_layers=1))
    save_checkpoint(model, tok, tmp_path / "m")
    again, _ = build_model(ModelConfig(pretrained=str(tmp_path / "m")))
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)
    with pytest.raises(FileNotFoundError, match="not an HF checkpoint"):
        load_checkpoint(tmp_path)


def _greedy_without_cache(model, prompt, n, eos):
    ids = list(prompt)
    out = []
    for _ in range(n):
        nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        if nxt == eos:
            break
        out.append(nxt)
        ids.append(nxt)
    return out


def test_cached_batched_generation_matches_step_by_step_greedy():
    torch.manual_seed(0)
    model, tok = build_model(ModelConfig(num_layers=2, init_seed=5))
    prompts = [tok(p)["input_ids"] for p in ("1+1=", "23*45=", "9-", "77+8=")]
    gens = generate(model, prompts, max_new_tokens=6, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    with torch.no_grad():
        for p, g in zip(prompts, gens):
            assert g.tokens == _greedy_without_cache(model, p, 6, tok.eos_token_id)


def test_sampling_is_reproducible_and_stops_at_eos():
    model, tok = build_model(ModelConfig(num_layers=1))
    prompts = [tok("12+3=")["input_ids"]] * 4

    def run(s):
        return generate(model, prompts, max_new_tokens=8, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                        temperature=1.0, generator=torch.Generator().manual_seed(s))

    assert run(1) == run(1)
    for g in run(2):
        assert tok.eos_token_id not in g.tokens
        assert g.finished or len(g.tokens) == 8


def test_left_pad_and_bad_prompts():
    ids, mask = left_pad([[1], [1, 2, 3]], pad_id=0)
    assert ids.tolist() == [[0, 0, 1], [1, 2, 3]] and mask.sum().item() == 4
    model, tok = build_model(ModelConfig(num_layers=1))
    assert generate(model, [], max_new_tokens=2, eos_id=2, pad_id=0) == []
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[]], max_new_tokens=2, eos_id=2, pad_id=0)
