"""The one engine seam: every engine is built by ``make_engine`` from a checkpoint folder, and an engine
takes a new policy in place, decoding exactly as a fresh engine of the new weights would."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from intellect.config import ComputeConfig, ModelConfig
from intellect.inference import Request, SamplingParams, TorchEngine
from intellect.inference import engines
from intellect.inference.config import EngineConfig
from intellect.inference.engines import EngineUnavailable, folder_stop_ids, load_tokenizer, make_engine, vllm_installed
from intellect.inference.weight_folder import load_in_place, read_state_dict
from intellect.model.checkpoint import build_model, save_checkpoint
from intellect.rl.config import RLRunConfig
from intellect.rl.service.validator import length_check
from intellect.rl.trainer.step import worker_engines
from intellect.rl.wire.rollouts import Rollout
from intellect.rl.worker.worker import WorkerRunInfo

ROOT = Path(__file__).resolve().parents[2]
# where engines may be constructed: the seam itself and the engines' own modules
BUILDERS = {"intellect/inference/engines.py", "intellect/inference/torch_engine.py",
            "intellect/inference/vllm_engine.py"}
# every place that needs an engine, and how many make_engine calls it holds
SITES = {"intellect/rl/trainer/step.py": 1, "intellect/rl/worker/worker.py": 1,
         "intellect/rl/trainer/evaluation.py": 1, "flows/filter.py": 1}
CONSTRUCTORS = {"TorchEngine", "VllmEngine", "for_tokenizer", "from_folder", "torch_engine"}
TINY = dict(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=64)


def _called(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of every call whose callee is a plain name or the last part of a dotted one."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name is not None:
                out.append((name, node.lineno))
    return out


def _sources() -> dict[str, ast.AST]:
    files = [p for top in ("intellect", "flows", "tasks") for p in sorted((ROOT / top).rglob("*.py"))]
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text(), str(p)) for p in files}


def test_every_engine_is_built_by_make_engine():
    sources = _sources()
    stray = [f"{rel}:{line} {name}()" for rel, tree in sources.items() if rel not in BUILDERS
             for name, line in _called(tree) if name in CONSTRUCTORS]
    assert not stray, f"engines built outside make_engine: {stray}"
    calls = {rel: sum(name == "make_engine" for name, _ in _called(sources[rel])) for rel in SITES}
    assert calls == SITES


def _folder(tmp_path: Path, name: str, **fields) -> Path:
    model, tok = build_model(ModelConfig(**{**TINY, **fields}))
    return save_checkpoint(model, tok, tmp_path / name)


def _requests(tok) -> list[Request]:
    return [Request(tok(p)["input_ids"], seed=i) for i, p in enumerate(("1+2=", "33+4=", "5+66=", "7"))]


SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("precision", [None, "bf16-mixed", "bf16"])
def test_an_updated_engine_decodes_as_a_fresh_engine_of_the_new_weights(tmp_path, tied, precision):
    old = _folder(tmp_path, "old", init_seed=1, tie_word_embeddings=tied)
    new = _folder(tmp_path, "new", init_seed=2, tie_word_embeddings=tied)
    compute = None if precision is None else ComputeConfig(device="cpu", precision=precision)
    tok = load_tokenizer(old)
    engine = make_engine("torch", old, compute, EngineConfig(max_batch_size=3), capture_hidden=True)
    before = engine.generate(_requests(tok), SAMPLING)
    dtypes = {p.dtype for p in engine.model.parameters()}
    engine.update_weights(new)
    got = engine.generate(_requests(tok), SAMPLING)
    fresh = make_engine("torch", new, compute, EngineConfig(max_batch_size=3), capture_hidden=True)
    want = fresh.generate(_requests(tok), SAMPLING)
    assert [c.tokens for c in got] == [c.tokens for c in want] != [c.tokens for c in before]
    for g, w in zip(got, want):
        assert g.finish_reason == w.finish_reason
        assert torch.equal(g.logprobs, w.logprobs)
        assert g.hidden_states is not None and w.hidden_states is not None
        assert torch.equal(g.hidden_states, w.hidden_states)
    assert {p.dtype for p in engine.model.parameters()} == dtypes  # the precision's, kept
    assert engine.stats.weight_updates == 1 and engine.stats.weight_update_seconds > 0
    assert fresh.stats.weight_updates == 0
    engine.stats.reset()
    assert engine.stats.weight_updates == 0 and engine.stats.weight_update_seconds == 0.0


def test_a_folder_of_another_model_never_loads_half_way(tmp_path):
    engine = make_engine("torch", _folder(tmp_path, "a"), None)
    held = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(ValueError, match="shapes differ"):
        engine.update_weights(_folder(tmp_path, "wide", hidden_size=128, intermediate_size=128))
    with pytest.raises(ValueError, match="lacks"):
        engine.update_weights(_folder(tmp_path, "deep", num_layers=2))
    # an untied head missing from the folder is not the embedding: refused, never left stale
    state = read_state_dict(_folder(tmp_path, "untied", tie_word_embeddings=False))
    untied = make_engine("torch", tmp_path / "untied", None)
    with pytest.raises(ValueError, match="not tied"):
        load_in_place(untied.model, {k: v for k, v in state.items() if k != "lm_head.weight"})
    assert all(torch.equal(v, held[k]) for k, v in engine.model.state_dict().items())
    assert engine.stats.weight_updates == 0


def test_engine_kind_is_the_workers_config_and_reaches_them():
    cfg = RLRunConfig.model_validate({"workers": {"engine": {"kind": "vllm", "max_batch_size": 8}}})
    assert cfg.workers.engine.kind == "vllm" and RLRunConfig().workers.engine.kind == "torch"
    info = WorkerRunInfo.of(cfg, -1, ["http://127.0.0.1:1"])
    assert info.engine == cfg.workers.engine
    with pytest.raises(ValueError, match="kind"):
        RLRunConfig.model_validate({"workers": {"engine": {"kind": "tensorrt"}}})


def test_worker_engines_build_the_runs_engine(tmp_path):
    cfg = RLRunConfig.model_validate({"workers": {"engine": {"max_batch_size": 5, "scheduling": "static"}},
                                      "compute": {"device": "cpu", "precision": "bf16"}})
    engine = worker_engines(cfg)(_folder(tmp_path, "m"))
    assert isinstance(engine, TorchEngine)
    assert engine.config == cfg.workers.engine and engine.capture_hidden and engine.precision == "bf16"


@pytest.mark.skipif(vllm_installed(), reason="vLLM is installed here")
def test_vllm_without_vllm_says_how_to_get_it(tmp_path):
    with pytest.raises(EngineUnavailable, match="make venv-vllm"):
        make_engine("vllm", _folder(tmp_path, "m"), None)


def test_engines_and_the_validator_stop_at_the_same_ids(tmp_path):
    """A chat checkpoint lists more EOS ids in its generation config than its tokenizer's one: every engine
    stops at all of them and the validator takes a completion that ends at any of them (one rule,
    ``protocol.stop_ids``), where the tokenizer's EOS alone would reject the honest rollout."""
    model, tok = build_model(ModelConfig(**TINY))
    eos = tok.eos_token_id
    assert isinstance(eos, int)
    extra = next(i for i in range(len(tok)) if i not in (eos, tok.pad_token_id, tok.bos_token_id))
    model.generation_config.eos_token_id = [eos, extra]
    folder = save_checkpoint(model, tok, tmp_path / "chat")
    ids = folder_stop_ids(folder)
    assert ids == sorted({eos, extra})
    assert make_engine("torch", folder, None).eos == ids
    row = Rollout("r", 0, 0, "w", 0, 1, "p", 0, (1,), (5, extra), "stop", 0.0, 0.0, 0.0, 0.0)
    assert length_check(4, ids)([row]) == [None]
    assert length_check(4, [eos])([row]) == ["finish_reason"]


def test_vllm_workers_run_under_the_vllm_environment_or_are_refused(monkeypatch, tmp_path):
    assert engines.worker_python("vllm", {engines.VLLM_PYTHON_ENV: "/x/bin/python"}) == "/x/bin/python"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    monkeypatch.setattr(engines, "VLLM_VENV", tmp_path)
    assert engines.worker_python("vllm", {}) == str(tmp_path / "bin" / "python")  # what `make venv-vllm` built
    monkeypatch.setattr(engines, "VLLM_VENV", tmp_path / "absent")
    monkeypatch.setattr(engines, "vllm_installed", lambda: False)
    with pytest.raises(EngineUnavailable, match="make venv-vllm"):
        engines.worker_python("vllm", {})


def test_a_bf16_checkpoint_runs_in_float32_unless_the_compute_says_otherwise(tmp_path):
    """A trainer with ``inference_dtype = "bf16"`` publishes bf16 weights; an engine built without a compute
    config upcasts them (bf16 arithmetic is many times slower on CPUs without native bf16), and decodes
    as the fp32 model holding the rounded weights does."""
    model, tok = build_model(ModelConfig(**TINY))
    folder = save_checkpoint(model, tok, tmp_path / "bf16", torch.bfloat16)
    engine = make_engine("torch", folder, None)
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    want = TorchEngine.for_tokenizer(model, tok)
    reqs, sp = [Request([1, 5, 9], seed=3)], SamplingParams(temperature=1.0, max_tokens=12)
    assert [c.tokens for c in engine.generate(reqs, sp)] == [c.tokens for c in want.generate(reqs, sp)]
