"""Any transformers causal-LM family built from the size fields, no download: shapes, round trips, presets."""

import hashlib

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from intellect.config import MODEL_PRESETS, ModelConfig
from intellect.model.arch import ArchError, meta_model, model_config, supported_archs
from intellect.model.checkpoint import build_model, load_checkpoint, parameter_count, save_checkpoint
from intellect.model.generate import generate
from intellect.model.tokenizer import build_tokenizer
from word_tokenizer import word_tokenizer

SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)


def state_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def test_default_model_keeps_its_weights_bit_for_bit():
    # The digest of ModelConfig()'s tiny Llama: saved checkpoints and seeded tests rely on these exact weights.
    model, tok = build_model(ModelConfig())
    assert type(model).__name__ == "LlamaForCausalLM" and len(tok) == 51
    assert state_digest(model) == "7edcb7bc5551b91253735a4236b88d4cf527591521745008798c0799f550a4ad"
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert model.config.head_dim == 32 and model.config.pad_token_id == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_each_family_builds_runs_and_round_trips(arch, tmp_path):
    cfg = ModelConfig(arch=arch, rope_theta=50000.0, tie_word_embeddings=arch != "mistral", init_seed=4, **SMALL)
    model, tok = build_model(cfg)
    again, _ = build_model(cfg)
    assert model.config.model_type == arch and state_digest(model) == state_digest(again)
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, getattr(c, "head_dim", 16), c.vocab_size) == (64, 2, 4, 2, 96, 16, len(tok))
    assert c.rope_parameters["rope_theta"] == 50000.0
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == cfg.tie_word_embeddings
    ids = torch.tensor([tok("12+34=46")["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    with torch.no_grad():  # causal: a prefix's logits do not depend on what follows it
        assert torch.allclose(model(ids[:, :4]).logits, logits[:, :4], atol=1e-5)
    loaded, ltok = load_checkpoint(save_checkpoint(model, tok, tmp_path / arch))
    assert type(loaded) is type(model) and loaded.config.rope_parameters["rope_theta"] == 50000.0
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)
    assert ltok("12+34=46")["input_ids"] == ids[0].tolist()


def test_a_tokenizer_without_pad_token_from_a_folder(tmp_path):
    # Llama-3 style: BOS and EOS but no pad token; the model's vocabulary follows the tokenizer.
    word_tokenizer(300, pad=False).save_pretrained(tmp_path / "tok")
    cfg = ModelConfig(tokenizer=str(tmp_path / "tok"), **SMALL)
    model, tok = build_model(cfg)
    assert tok.pad_token_id is None and len(tok) == 300 and model.config.vocab_size == 300
    assert model.config.pad_token_id is None and (model.config.bos_token_id, model.config.eos_token_id) == (0, 1)
    assert model.generation_config.pad_token_id == tok.eos_token_id == 1
    prompts = [tok("w5 w6 w7")["input_ids"], tok("w9")["input_ids"]]
    gens = generate(model, prompts, max_new_tokens=4, eos_id=tok.eos_token_id)
    assert gens == generate(model, prompts, max_new_tokens=4, eos_id=tok.eos_token_id, pad_id=2)
    loaded, ltok = load_checkpoint(save_checkpoint(model, tok, tmp_path / "ckpt"))
    assert ltok.pad_token_id is None and loaded.config.pad_token_id is None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_model(ModelConfig(tokenizer=str(tmp_path / "missing")))


def test_unknown_and_unsizable_archs_fail_in_one_line():
    tok = build_tokenizer()
    for arch, says in (("nosuchnet", "no model type of that name"), ("t5", "no causal-LM model"),
                       ("gemma3", "its text model is arch 'gemma3_text'")):
        with pytest.raises(ArchError, match=says) as e:
            model_config(ModelConfig(arch=arch), tok)
        assert "\n" not in str(e.value) and "llama, qwen2" in str(e.value)
    with pytest.raises(ArchError, match="no grouped-query attention"):
        model_config(ModelConfig(arch="gpt2", num_kv_heads=2), tok)
    with pytest.raises(ArchError, match="no rotary position embedding"):
        model_config(ModelConfig(arch="gpt2", rope_theta=5e5), tok)
    with pytest.raises(ArchError, match="no eos token"):
        model_config(ModelConfig(), PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
            vocab={"a": 0, "b": 1}, unk_token="a"))))
    archs = supported_archs()
    assert {"llama", "qwen2", "qwen3", "mistral", "gpt2", "gemma3_text"} <= set(archs)
    assert "t5" not in archs and "gemma3" not in archs and list(archs) == sorted(archs)


def test_other_families_take_the_sizes_under_their_own_names():
    tok = build_tokenizer()
    gpt2 = model_config(ModelConfig(arch="gpt2", **{**SMALL, "num_kv_heads": 4}), tok)
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.n_inner, gpt2.n_positions) == (64, 2, 4, 96, 64)
    # Qwen3 defaults to 128-wide heads whatever the hidden size: the head width follows hidden / heads here.
    qwen3 = model_config(ModelConfig(arch="qwen3", **SMALL), tok)
    assert qwen3.head_dim == 16
    # Gemma 3's local (sliding) layers keep their own base; rope_theta sets the global ones'.
    gemma = model_config(ModelConfig(arch="gemma3_text", rope_theta=2e6, **SMALL), tok)
    assert gemma.rope_parameters["full_attention"]["rope_theta"] == 2e6
    assert gemma.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    for config in (gpt2, qwen3, gemma):
        model = meta_model(config)
        assert model.config.vocab_size == len(tok) and parameter_count(model) > 0


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_families_without_gqa_or_rope_build_as_causal_lms(arch):
    model, tok = build_model(ModelConfig(arch=arch, **{**SMALL, "num_kv_heads": 4}))
    ids = torch.tensor([tok("7*8=56")["input_ids"]])
    with torch.no_grad():  # BERT is built as a decoder: causal like the rest
        assert torch.allclose(model(ids[:, :3]).logits, model(ids).logits[:, :3], atol=1e-5)


# Parameter counts (unique, tied embeddings once) of each preset with a realistic vocabulary. Llama-3.2-1B
# (128,256 ids) has exactly 1,235,814,400 and Qwen2.5-0.5B (151,936) 494,032,768: the presets match them.
PRESET_PARAMS = {
    "llama-tiny": (51, 859_648),  # the built-in character tokenizer
    "llama-20m": (32_000, 22_909_824),
    "llama-150m": (32_000, 152_006_400),
    "llama-1b": (128_256, 1_235_814_400),
    "qwen2.5-0.5b": (151_936, 494_032_768),
}


def test_presets_have_the_documented_parameter_counts():
    assert set(PRESET_PARAMS) == set(MODEL_PRESETS)
    for preset, (vocab, params) in PRESET_PARAMS.items():
        tok = build_tokenizer() if vocab == 51 else word_tokenizer(vocab, pad=False)
        config = model_config(ModelConfig(preset=preset), tok)
        assert config.model_type == MODEL_PRESETS[preset]["arch"]
        assert parameter_count(meta_model(config)) == params, preset
