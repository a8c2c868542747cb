"""compute.precision = "auto": the decision table for every capability a device can report, the probe
that asks the device, and the log lines that say what was chosen (intellect/device.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from intellect import device as device_mod
from intellect.config import ComputeConfig, ModelConfig
from intellect.device import Bf16Support, decide_precision
from intellect.model.checkpoint import build_model

CPU = torch.device("cpu")
SETTINGS = ("auto", "fp32", "bf16-mixed", "bf16")


def cuda(major: int, minor: int) -> Bf16Support:
    return Bf16Support("cuda:0", (major, minor) >= (8, 0), f"GPU, compute capability {major}.{minor}")


def cpu(bf16: float, fp32: float) -> Bf16Support:
    return Bf16Support("cpu", bf16 >= device_mod.BF16_MIN_SPEEDUP * fp32, f"bf16 {bf16}, fp32 {fp32}",
                       fp32 / bf16 if bf16 < fp32 else None)


# (what the device reports, the precision each setting of SETTINGS computes in, whether it warns)
TABLE = [
    ("H100 (9.0)", cuda(9, 0), ("bf16-mixed", "fp32", "bf16-mixed", "bf16"), False),
    ("A100 (8.0)", cuda(8, 0), ("bf16-mixed", "fp32", "bf16-mixed", "bf16"), False),
    ("V100 (7.0)", cuda(7, 0), ("fp32", "fp32", "bf16-mixed", "bf16"), True),
    ("T4 (7.5)", cuda(7, 5), ("fp32", "fp32", "bf16-mixed", "bf16"), True),
    ("CPU with AMX", cpu(1100e9, 160e9), ("bf16-mixed", "fp32", "bf16-mixed", "bf16"), False),
    ("CPU at the threshold", cpu(150e9, 100e9), ("bf16-mixed", "fp32", "bf16-mixed", "bf16"), False),
    ("CPU, AVX-512 emulating bf16", cpu(90e9, 160e9), ("fp32", "fp32", "bf16-mixed", "bf16"), True),
    ("CPU, bf16 a bit faster", cpu(120e9, 100e9), ("fp32", "fp32", "bf16-mixed", "bf16"), True),
    ("CPU, AVX2 only", cpu(2.4e9, 256e9), ("fp32", "fp32", "bf16-mixed", "bf16"), True),
]


@pytest.mark.parametrize("name, support, chosen, warns", TABLE, ids=[row[0] for row in TABLE])
def test_the_decision_table(name, support, chosen, warns):
    for setting, expected in zip(SETTINGS, chosen):
        precision, why = decide_precision(setting, support)
        assert precision == expected, (name, setting)
        if setting == "auto":
            assert why.startswith(f"auto on {support.device}: bf16 is {'fast' if support.fast else 'slow'}")
        elif setting == "fp32" or not warns:
            assert why == ""  # nothing to say: nothing is logged
        else:
            assert why.endswith("'auto' would choose fp32") and support.detail in why


def test_an_explicit_bf16_on_a_cpu_that_emulates_it_says_the_measured_slowdown():
    _, why = decide_precision("bf16-mixed", cpu(2.4e9, 256e9))
    assert "107x slower than fp32" in why


def test_a_gpu_is_judged_by_its_compute_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla V100-SXM2-16GB")
    for capability, fast in (((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True), ((12, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=capability: c)
        support = device_mod.bf16_support.__wrapped__(torch.device("cuda", 0))
        assert support.fast is fast and support.device == "cuda:0"
        assert f"compute capability {capability[0]}.{capability[1]}" in support.detail


@pytest.mark.parametrize("bf16, fp32, fast", [(1100e9, 160e9, True), (2.4e9, 256e9, False), (90e9, 160e9, False)])
def test_the_cpu_probe_compares_measured_bf16_and_fp32_matmuls(monkeypatch, bf16, fp32, fast):
    rates = {torch.bfloat16: bf16, torch.float32: fp32}
    seen = []

    def measure(_device, dtype, size, _seconds):
        seen.append((dtype, size))
        return rates[dtype]

    measure.__wrapped__ = measure  # the uncached measurement the probe takes a second look with
    monkeypatch.setattr(device_mod, "measure_matmul_flops", measure)
    support = device_mod.bf16_support.__wrapped__(CPU)
    assert support.fast is fast and f"{bf16 / 1e9:,.1f} GFLOP/s" in support.detail
    assert torch.backends.cpu.get_cpu_capability() in support.detail
    # fp32 looked at twice; bf16 twice unless far slower (emulated: slow to measure, and no close call)
    looks = {dtype: seen.count((dtype, device_mod.PROBE_SIZE)) for dtype in rates}
    assert looks == {torch.float32: 2, torch.bfloat16: 1 if bf16 * 4 <= fp32 else 2} and len(seen) == sum(looks.values())
    assert (support.slowdown is None) == (bf16 >= fp32)


def test_the_real_probe_of_this_cpu_is_short_and_consistent():
    support = device_mod.bf16_support(CPU)
    assert support is device_mod.bf16_support(CPU)  # asked once per process
    precision = device_mod.resolve_precision("auto", CPU)
    assert precision == ("bf16-mixed" if support.fast else "fp32")
    assert device_mod.resolve_precision("fp32", CPU) == "fp32" and device_mod.resolve_precision("bf16", CPU) == "bf16"


def test_resolution_says_what_auto_chose_and_warns_once_about_a_slow_explicit_bf16(monkeypatch, caplog):
    slow = cpu(2.4e9, 256e9)
    monkeypatch.setattr(device_mod, "bf16_support", lambda device: slow)
    resolve = device_mod.resolve_precision.__wrapped__
    with caplog.at_level(logging.INFO, logger="intellect.device"):
        assert resolve("auto", CPU) == "fp32"
        assert resolve("bf16-mixed", CPU) == "bf16-mixed"
        assert resolve("fp32", CPU) == "fp32"
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert infos == [f"precision auto -> fp32 on cpu: bf16 is slow here ({slow.detail})"]
    assert len(warnings) == 1 and "bf16-mixed on cpu computes matmuls 107x slower" in warnings[0]
    with pytest.raises(ValueError, match="unknown precision"):
        resolve("fp16", CPU)


def test_auto_trains_fp32_weights_and_autocasts_as_decided(monkeypatch):
    for fast, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(device_mod, "resolve_precision", lambda s, d, fast=fast: ("bf16-mixed" if fast else "fp32")
                            if s == "auto" else s)
        model, _ = build_model(ModelConfig(num_layers=1, hidden_size=32, intermediate_size=64))
        device_mod.prepare_model(model, ComputeConfig(device="cpu", precision="auto"), CPU)
        assert {p.dtype for p in model.parameters()} == {torch.float32}  # auto never trains bf16 weights
        with device_mod.autocast(CPU, "auto"):
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtype
