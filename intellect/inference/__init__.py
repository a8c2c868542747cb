"""Inference engines: seeded, reproducible sampling with final-hidden-state capture for TOPLOC."""

from intellect.inference.config import EngineConfig
from intellect.inference.protocol import Completion, FinishReason, InferenceEngine, Request, Scored
from intellect.inference.sampling import (
    LowProb,
    SamplingParams,
    chosen_logprobs,
    sample,
    sample_token,
    top_p_mask,
    uniforms,
)
from intellect.inference.stats import EngineStats
from intellect.inference.torch_engine import TorchEngine

__all__ = [
    "Completion",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "InferenceEngine",
    "LowProb",
    "Request",
    "SamplingParams",
    "Scored",
    "TorchEngine",
    "chosen_logprobs",
    "sample",
    "sample_token",
    "top_p_mask",
    "uniforms",
]
