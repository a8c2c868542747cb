"""The one place an inference engine is built: :func:`make_engine` of a kind and a checkpoint folder.

Every process that generates (an RL worker, the trainer's own workers, held-out evaluation, the
difficulty filter) and the validator's prefill engines get their engine here, from a checkpoint
folder the caller has verified (a SHARDCAST version signed by the trainer, a run checkpoint checked
against the ledger's digest). An engine that must follow the policy keeps running and takes each new
checkpoint with ``update_weights(folder)``, which :class:`EngineStats` counts and times.

``kind`` (:data:`~intellect.inference.config.EngineKind`) picks the implementation: ``torch`` is
:class:`~intellect.inference.torch_engine.TorchEngine`; ``vllm`` is
:class:`~intellect.inference.vllm_engine.VllmEngine`, imported only when asked for, because vLLM
lives in its own environment (``make venv-vllm``) and the project's does not hold it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, Sequence, overload

from transformers import AutoTokenizer, GenerationConfig

from intellect.config import ComputeConfig
from intellect.inference.config import EngineConfig, EngineKind
from intellect.inference.protocol import stop_ids
from intellect.inference.torch_engine import TorchEngine
from intellect.model.arch import BUILD_LOCK

if TYPE_CHECKING:
    from intellect.inference.protocol import Completion, Request
    from intellect.inference.sampling import SamplingParams
    from intellect.inference.stats import EngineStats

#: what a user runs to get vLLM (the worker's own environment)
VLLM_HINT = "build the vLLM environment with `make venv-vllm` and run the worker from .venv-vllm/bin/python"


class EngineUnavailable(RuntimeError):
    """The engine a config asks for cannot run in this environment (vLLM not installed)."""


class Engine(Protocol):
    """What every engine :func:`make_engine` builds offers: the
    :class:`~intellect.inference.protocol.InferenceEngine` protocol, in-place weight updates, and
    what it ran."""

    @property
    def stats(self) -> EngineStats: ...

    def generate(self, requests: Sequence[Request],
                 sampling: SamplingParams | Sequence[SamplingParams]) -> list[Completion]: ...

    def update_weights(self, folder: Path) -> None: ...


@overload
def make_engine(kind: Literal["torch"], folder: str | Path, compute: ComputeConfig | None,
                cfg: EngineConfig | None = None, *, capture_hidden: bool = False) -> TorchEngine: ...


@overload
def make_engine(kind: EngineKind, folder: str | Path, compute: ComputeConfig | None,
                cfg: EngineConfig | None = None, *, capture_hidden: bool = False) -> Engine: ...


def make_engine(kind: EngineKind, folder: str | Path, compute: ComputeConfig | None,
                cfg: EngineConfig | None = None, *, capture_hidden: bool = False) -> Engine:
    """An engine of ``kind`` holding the HF checkpoint ``folder``, on ``compute``'s device and in its
    precision (None: the torch engine holds them in float32 on the CPU), batching as ``cfg``
    says (None: the defaults), capturing the final hidden states TOPLOC commits to when
    ``capture_hidden``. The folder is read before this returns. ``cfg.kind`` is not consulted: a caller
    that must run torch (the validator) says so whatever the run's workers use.

    ``EngineUnavailable`` when ``kind`` is ``vllm`` and this environment has no vLLM.
    """
    folder = Path(folder)
    if kind == "torch":
        return TorchEngine.from_folder(folder, compute, cfg, capture_hidden=capture_hidden)
    if kind == "vllm":
        return _vllm_engine_class().from_folder(folder, compute or ComputeConfig(), cfg or EngineConfig(kind="vllm"),
                                                capture_hidden=capture_hidden)
    raise ValueError(f"no engine of kind {kind!r}: torch or vllm")


VLLM_PYTHON_ENV = "INTELLECT_VLLM_PYTHON"  # the interpreter of vLLM workers, where .venv-vllm is not the one
VLLM_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"  # what `make venv-vllm` builds, beside the code


def worker_python(kind: EngineKind, environ: Mapping[str, str] = os.environ) -> str:
    """The interpreter an inference worker of ``kind`` runs under: this one for ``torch``; for ``vllm``,
    ``$INTELLECT_VLLM_PYTHON`` when set, else ``.venv-vllm/bin/python`` beside the code when it was built,
    else this one when it has vLLM. ``EngineUnavailable`` (with the way to get one) otherwise.

    >>> worker_python("torch") == sys.executable, worker_python("vllm", {VLLM_PYTHON_ENV: "/opt/v/bin/python"})
    (True, '/opt/v/bin/python')
    """
    if kind == "torch":
        return sys.executable
    if environ.get(VLLM_PYTHON_ENV):
        return environ[VLLM_PYTHON_ENV]
    if (VLLM_VENV / "bin" / "python").exists():
        return str(VLLM_VENV / "bin" / "python")
    if vllm_installed():
        return sys.executable
    raise EngineUnavailable(f"workers.engine.kind = 'vllm': no vLLM environment ({VLLM_VENV} does not exist, "
                            f"{VLLM_PYTHON_ENV} is not set, this Python has no vLLM); {VLLM_HINT}")


def vllm_installed() -> bool:
    """Whether this Python has vLLM: a package with code, not a bare folder named ``vllm`` on the path
    (a namespace package, such as a test folder)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def check_available(kind: EngineKind) -> None:
    """``EngineUnavailable`` unless this Python can build engines of ``kind``: what a worker checks before it
    waits for any work, so a run that asks for vLLM where there is none learns it at once."""
    if kind == "vllm" and not vllm_installed():
        raise EngineUnavailable(f"engine kind 'vllm' needs vLLM, which this Python ({sys.executable}) lacks; "
                                f"{VLLM_HINT}")


def _vllm_engine_class():
    check_available("vllm")
    from intellect.inference.vllm_engine import VllmEngine  # noqa: PLC0415  (imports vLLM)

    return VllmEngine


def load_tokenizer(folder: str | Path):
    """The tokenizer of an HF checkpoint folder (what the engine's token ids mean)."""
    with BUILD_LOCK:
        return AutoTokenizer.from_pretrained(Path(folder), local_files_only=True)


def folder_stop_ids(folder: str | Path) -> list[int]:
    """:func:`~intellect.inference.protocol.stop_ids` of an HF checkpoint folder: its tokenizer's EOS and
    its generation config's (what an engine built from the folder stops at, and the validator checks)."""
    with BUILD_LOCK:
        tok = AutoTokenizer.from_pretrained(Path(folder), local_files_only=True)
        try:
            extra = GenerationConfig.from_pretrained(Path(folder), local_files_only=True).eos_token_id
        except OSError:  # no generation_config.json
            extra = None
    return stop_ids(tok.eos_token_id, extra)
