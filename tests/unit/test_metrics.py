"""FLOPs per token, peak FLOP/s, MFU (never above 1), and the local JSONL (+ TensorBoard) metrics log (on S3:
tests/integration/test_metrics_s3.py)."""

import doctest
import importlib.util
import json
import logging
import math
import time
from pathlib import Path

import duckdb
import pytest
import torch

from intellect import metrics as metrics_mod
from intellect.config import ComputeConfig, DataConfig, LoggingConfig, ModelConfig, TrainConfig
from intellect.data.arithmetic import train_stream
from intellect.device import prepare_model
from intellect.metrics import (TENSORBOARD_EXTRA, MetricsLog, Peak, flops_per_token, gpu_peak_flops,
                               measure_matmul_flops, mfu, peak_flops)
from intellect.train import Trainer, encode_texts
from intellect.model.arch import model_config
from intellect.model.checkpoint import build_model, parameter_count
from intellect.storage import RunStorage
from mfu_rows import mfu_above_one
from word_tokenizer import word_tokenizer

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


# --------------------------------------------------------------------- FLOPs


def test_flops_per_token_counts_the_blocks_the_head_and_attention():
    model, tok = build_model(ModelConfig(tie_word_embeddings=False, num_kv_heads=2))
    c = model.config
    embedding = model.get_input_embeddings().weight.numel()
    n = parameter_count(model) - embedding  # blocks, final norm and the (untied) head
    assert flops_per_token(c, 100) == 6 * n + 12 * c.num_hidden_layers * c.hidden_size * 100
    tied = model_config(ModelConfig(num_kv_heads=2), tok)
    assert flops_per_token(tied, 100) == flops_per_token(c, 100)  # the head's matmul is done either way
    mha = model_config(ModelConfig(), tok)
    kv_saving = 6 * 2 * c.num_hidden_layers * c.hidden_size * (c.hidden_size // 2)  # k_proj + v_proj halved
    assert flops_per_token(mha, 100) - flops_per_token(tied, 100) == kv_saving
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(c, 0)


def test_flops_per_token_of_the_150m_preset_by_hand():
    config = model_config(ModelConfig(preset="llama-150m"), word_tokenizer(32_000, pad=False))
    h, layers, inner, vocab = 768, 18, 2048, 32_000
    block = 4 * h * h + 3 * h * inner + 2 * h  # attention, SwiGLU, two RMSNorms
    n = layers * block + h + vocab * h  # + final norm + head
    assert flops_per_token(config, 1024) == 6 * n + 12 * layers * h * 1024 == 1_081_907_712


# --------------------------------------------------------------------- peak and MFU


@pytest.mark.parametrize("name, precision, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 PCIe", "bf16-mixed", 756.5),
    ("NVIDIA H100 PCIe", "fp32", 51.2), ("NVIDIA H200", "bf16", 989.4), ("NVIDIA H200", "fp32", 66.9),
    ("NVIDIA A100-SXM4-80GB", "bf16-mixed", 312.0), ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
    ("NVIDIA A10G", "bf16", 70.0), ("NVIDIA L4", "bf16", 121.0), ("NVIDIA L40S", "bf16", 362.05),
    ("NVIDIA L40S", "fp32", 91.6), ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
    ("NVIDIA GeForce RTX 3090", "fp32", 35.6),
])
def test_known_gpus_have_their_dense_peak(name, precision, tflops):
    assert gpu_peak_flops(name, precision) == pytest.approx(tflops * 1e12)


def test_unknown_gpus_are_measured_and_configured_peaks_win():
    for name in ("NVIDIA L40", "NVIDIA A10", "Tesla T4", "NVIDIA GeForce RTX 5090"):
        assert gpu_peak_flops(name, "bf16") is None, name
    assert peak_flops(torch.device("cpu"), "fp32", configured_tflops=2.5) == 2.5e12


def test_cpu_peak_is_a_matmul_benchmark_measured_once():
    cpu = torch.device("cpu")
    first = measure_matmul_flops(cpu, torch.float32, 256, 0.05)
    assert 1e8 < first < 1e15  # between a very slow CPU and far more than any CPU does
    assert measure_matmul_flops(cpu, torch.float32, 256, 0.05) is first  # cached, not measured again
    bf16 = measure_matmul_flops(cpu, torch.bfloat16, 256, 0.05)
    assert bf16 > 0 and bf16 != first
    peak = peak_flops(cpu, "bf16-mixed")  # runs in bf16 under autocast: the best of several sizes
    assert peak >= measure_matmul_flops(cpu, torch.bfloat16, 256, 0.25) and peak_flops(cpu, "bf16") == peak
    with pytest.raises(ValueError):
        measure_matmul_flops(cpu, torch.float32, 0, 1.0)
    # a re-measurement can only raise the peak (one taken while the cores were busy is too low)
    again = peak_flops(cpu, "bf16-mixed", remeasure=True)
    assert again >= peak and peak_flops(cpu, "bf16-mixed") == again
    assert peak_flops(cpu, "fp32", configured_tflops=2.5, remeasure=True) == 2.5e12


def test_the_cpu_peak_skips_sizes_whose_one_matmul_would_take_over_a_second(monkeypatch):
    sizes = []

    def measure(_device, _dtype, size, _seconds):  # an emulated-bf16 CPU: about 1 GFLOP/s at any size
        sizes.append(size)
        return 1e9

    monkeypatch.setattr(metrics_mod, "measure_matmul_flops", measure)
    assert metrics_mod._measure_peak(torch.device("cpu"), torch.bfloat16) == 1e9
    assert sizes == [256, 512]  # a 1024 matmul is 2.1 GFLOP: over a second at that rate


# --------------------------------------------------------------------- MFU, never above 1


def test_docstring_examples():
    assert doctest.testmod(metrics_mod).failed == 0


def test_mfu():
    assert mfu(2000.0, 5e8, 1e13) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="peak"):
        mfu(1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="peak"):
        Peak(0.0)


def train_a_known_model(steps: int = 4) -> list[tuple[float, float]]:
    """(tokens/s, FLOPs per token) of a few real training steps of a small Llama on arithmetic text."""
    model, tok = build_model(ModelConfig(num_layers=2, hidden_size=128, intermediate_size=256))
    prepare_model(model, ComputeConfig(device="cpu"), torch.device("cpu"))
    trainer = Trainer(model, tok, TrainConfig(batch_size=16, warmup_steps=0))
    stream = train_stream(DataConfig())
    out = []
    for _ in range(steps):
        batch = encode_texts(tok, [next(stream).text for _ in range(16)], 32)
        log = trainer.train_step(batch)
        seq = batch["input_ids"].shape[1]
        out.append((log["tokens"] / log["seconds"], flops_per_token(model.config, seq)))
    return out


def test_mfu_of_a_real_model_at_a_known_flop_count_is_in_0_1():
    peak = Peak.of(torch.device("cpu"), "fp32")
    for tps, per_token in train_a_known_model():
        assert 0 < peak.mfu(tps, per_token) <= 1


def test_a_peak_below_the_achieved_rate_is_a_logged_measurement_error_and_replaced(caplog):
    steps = train_a_known_model()
    low = min(tps * per_token for tps, per_token in steps) / 10  # a tenth of what any step achieved
    for peak in (Peak(low, torch.device("cpu"), "fp32"), Peak(low, torch.device("cpu"), "fp32", configured=True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="intellect.metrics"):
            utilizations = [peak.mfu(tps, per_token) for tps, per_token in steps]
        assert all(0 < u <= 1 for u in utilizations), utilizations
        assert peak.flops >= max(tps * per_token for tps, per_token in steps)
        errors = [r.getMessage() for r in caplog.records]
        assert len(errors) == 1 and "measurement error" in errors[0], errors  # said once, not every step
        assert ("compute.peak_tflops is too low" in errors[0]) is peak.configured


# --------------------------------------------------------------------- the log


def query(path: Path | str, sql: str) -> list[tuple]:
    return duckdb.sql(sql.replace("LOG", f"read_json_auto('{path}')")).fetchall()


def test_rows_are_a_duckdb_queryable_time_series(tmp_path):
    storage = RunStorage(str(tmp_path / "run"))
    path = tmp_path / "run" / "metrics" / "smoke.jsonl"
    with MetricsLog(storage, "metrics/smoke.jsonl", LoggingConfig(every=2), flush_every=2) as log:
        for step in range(7):
            written = log.log(step, {"loss": 1.0 / (step + 1), "tokens_per_s": 100 * step, "phase": "pre",
                                     "members": ["a", "b"], "estimates": {"ring": 0.5}, "grad": math.inf})
            assert written == (step % 2 == 0)
        assert log.log(7, {"loss": 0.125}, force=True)
        assert len(path.read_text().splitlines()) == 4  # two flushes of two rows; the last row still buffered
    rows = query(path, "select step, loss, tokens_per_s, phase, members, estimates.ring, grad from LOG order by step")
    assert rows == [(0, 1.0, 0, "pre", ["a", "b"], 0.5, None), (2, 1 / 3, 200, "pre", ["a", "b"], 0.5, None),
                    (4, 0.2, 400, "pre", ["a", "b"], 0.5, None), (6, 1 / 7, 600, "pre", ["a", "b"], 0.5, None),
                    (7, 0.125, None, None, None, None, None)]
    (last_time,), = query(path, "select max(time) from LOG")
    assert abs(last_time - time.time()) < 60
    with pytest.raises(RuntimeError, match="closed"):
        log.log(8, {})


def test_bad_rows_and_names_are_refused(tmp_path):
    storage = RunStorage(str(tmp_path))
    with pytest.raises(ValueError, match=".jsonl"):
        MetricsLog(storage, "metrics/smoke.json")
    with pytest.raises(ValueError, match="escapes"):
        MetricsLog(storage, "../smoke.jsonl")
    with MetricsLog(storage, "m.jsonl") as log:
        with pytest.raises(TypeError, match="item"):
            log.log(0, {"loss": torch.tensor(1.0)})
        with pytest.raises(ValueError, match="differs"):
            log.log(1, {"step": 2})
        with pytest.raises(ValueError, match="time"):
            log.log(1, {"time": 3.0})
        assert log.log(1, {"step": 1, "loss": 2.0})
    assert json.loads((tmp_path / "m.jsonl").read_text())["loss"] == 2.0


def test_a_resumed_run_replaces_the_steps_it_logs_again(tmp_path):
    storage = RunStorage(str(tmp_path))
    with MetricsLog(storage, "metrics/w0.jsonl") as log:
        for step in range(5):
            log.log(step, {"loss": float(step)})
    path = tmp_path / "metrics" / "w0.jsonl"
    with open(path, "ab") as f:
        f.write(b'{"step": 5, "lo')  # a crash cut the last line short
    with MetricsLog(storage, "metrics/w0.jsonl") as log:  # resumed from the checkpoint of step 3
        log.log(3, {"loss": 30.0})
        log.log(4, {"loss": 40.0})
    assert query(path, "select step, loss from LOG order by step") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0),
                                                                       (4, 40.0)]
    assert not list(path.parent.glob(".tmp-*"))


@pytest.mark.skipif(HAS_TENSORBOARD, reason="tensorboard is installed")
def test_tensorboard_without_the_extra_names_it(tmp_path):
    with pytest.raises(ImportError, match=r"intellect\[tensorboard\]") as e:
        MetricsLog(RunStorage(str(tmp_path)), "m.jsonl", LoggingConfig(tensorboard=True))
    assert TENSORBOARD_EXTRA in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="needs the tensorboard extra")
def test_tensorboard_event_files_hold_the_numeric_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415 # pyright: ignore[reportMissingImports]

    with MetricsLog(RunStorage(str(tmp_path)), "metrics/smoke.jsonl", LoggingConfig(tensorboard=True)) as log:
        for step in range(3):
            log.log(step, {"loss": 1.0 + step, "phase": "pre"})
    events = EventAccumulator(str(tmp_path / "tensorboard" / "metrics" / "smoke"))
    events.Reload()
    assert events.Tags()["scalars"] == ["loss"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    with pytest.raises(ValueError, match="tensorboard_dir"):
        MetricsLog(RunStorage("s3://bucket/run"), "m.jsonl", LoggingConfig(tensorboard=True))


def test_the_suite_wide_check_finds_rows_with_mfu_above_one(tmp_path):
    with MetricsLog(RunStorage(str(tmp_path)), "metrics/pretrain.jsonl") as log:
        for step, util in enumerate([0.3, 1.0, 0.99]):
            log.log(step, {"loss": 1.0, "mfu": util})
    assert mfu_above_one(tmp_path) == []
    (tmp_path / "metrics" / "w1.jsonl").write_text('{"step": 1, "mfu": 14.4}\nnot json\n{"step": 2}\n')
    assert mfu_above_one(tmp_path) == [f"{tmp_path / 'metrics' / 'w1.jsonl'}:1 mfu=14.4"]
    (tmp_path / "metrics" / "w1.jsonl").unlink()  # else the session's own check (tests/conftest.py) finds it
