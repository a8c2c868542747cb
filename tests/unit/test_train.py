import doctest

import torch

import intellect.pretrain
import intellect.train
from intellect.config import DataConfig, ModelConfig, TrainConfig
from intellect.data.arithmetic import Problem, heldout_problems, train_stream
from intellect.model.checkpoint import build_model
from intellect.train import Trainer, encode_texts, evaluate, lr_at, pass_counts


def test_docstring_examples():
    for mod in (intellect.train, intellect.pretrain):
        assert doctest.testmod(mod).failed == 0


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(steps=200, lr=1e-2, warmup_steps=20, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(200)]
    assert lrs[:20] == sorted(lrs[:20]) and abs(lrs[19] - 1e-2) < 1e-12
    assert lrs[20:] == sorted(lrs[20:], reverse=True) and abs(lrs[-1] - 1e-3) < 1e-12
    assert lr_at(0, TrainConfig(warmup_steps=0, lr=1e-3)) == 1e-3


def test_encode_pads_right_and_masks_labels():
    _, tok = build_model(ModelConfig(num_layers=1))
    b = encode_texts(tok, ["1+1=2", "12*12=144"], max_len=64)
    assert b["input_ids"].shape == (2, 11)
    assert b["input_ids"][0, 6].item() == tok.eos_token_id and b["labels"][0, 7:].eq(-100).all()
    assert encode_texts(tok, ["1" * 100], max_len=16)["input_ids"].shape == (1, 16)


def test_training_lowers_loss_and_clips_gradients():
    torch.manual_seed(0)
    model, tok = build_model(ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128))
    cfg = TrainConfig(steps=60, batch_size=32, lr=3e-3, warmup_steps=5, grad_clip=0.5)
    trainer = Trainer(model, tok, cfg)
    stream = train_stream(DataConfig())
    logs = trainer.train_steps(60, iter(lambda: [next(stream).text for _ in range(32)], None))
    assert trainer.step == 60
    assert sum(log["loss"] for log in logs[-10:]) / 10 < logs[0]["loss"] - 1.0
    assert all(log["tokens"] > 0 for log in logs)
    state = trainer.state_dict()
    again = Trainer(model, tok, cfg)
    again.load_state_dict(state)
    assert again.step == 60


def test_evaluate_counts_exact_matches():
    model, tok = build_model(ModelConfig(num_layers=1))
    tasks = heldout_problems(DataConfig(), 16)
    res = evaluate(model, tok, tasks, batch_size=5)
    assert res.n == 16 and 0.0 <= res.accuracy <= 1.0 and res.loss > 0
    expected = sum(a.strip() == t.answer for a, t in zip(res.answers, tasks)) / 16
    assert res.accuracy == expected
    counts = pass_counts(model, tok, [Problem(1, "+", 1)] * 3, k=4, seed=0)
    assert len(counts) == 3 and all(0 <= c <= 4 for c in counts)
