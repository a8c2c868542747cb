"""Exact resume of single-machine pretraining: a phase SIGKILLed mid-way and run again ends with the
weights of a phase that was never killed (fp32, CPU), and its saved data position gives the batches an
uninterrupted stream gives next.

Every run is its own process (the one that is killed kills itself from its step callback, at a step
the test chooses, so the kill lands mid-phase without a race), each with one intra-op thread.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from intellect import pretrain as P
from intellect.checkpoints import CHECKPOINTS, DATA_STATE, PHASE, fetch, publish
from intellect.config import SmokeConfig
from intellect.data.stream import open_stream
from intellect.storage import RunStorage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS, EVERY, BATCH = 12, 4, 4

RUN = """
import json, os, signal, sys
from intellect import pretrain as P
from intellect.config import SmokeConfig
from intellect.storage import RunStorage
cfg = SmokeConfig.model_validate_json(open(sys.argv[1]).read())
kill_at = int(sys.argv[2])
storage = RunStorage.from_config(cfg.storage, cfg.run_name)
start = P.init_checkpoint(cfg, storage)
def on_step(n, row):
    if n == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
out = P.pretrain(cfg, storage, start, on_step)
print(json.dumps({"step": out.step, "tokens": out.tokens, "first_loss": out.first_loss}))
"""


def stdlib_json_corpus() -> list[str]:
    """A real corpus every machine has: the standard library's json package, a few source files."""
    return sorted(str(p) for p in Path(json.__file__).parent.glob("*.py"))


def make_cfg(tmp_path: Path, name: str, kind: str, tokenizer: Path) -> SmokeConfig:
    data: dict = {"kind": kind, "seed": 5}
    model: dict = {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 64,
                   "max_position_embeddings": 64}
    if kind == "text":
        data |= {"heldout_percent": 20, "text": {"files": stdlib_json_corpus(), "seq_len": 32, "eval_sequences": 4}}
        model |= {"tokenizer": str(tokenizer), "tokenizer_vocab": 300}
    return SmokeConfig.model_validate({
        "run_name": name, "storage": {"url": f"file://{tmp_path}/runs"}, "model": model, "data": data,
        "train": {"steps": STEPS, "batch_size": BATCH, "lr": 5e-3, "warmup_steps": 2, "threads": 1},
        "compute": {"device": "cpu"}, "checkpoint_every": EVERY,
    })


def run(cfg: SmokeConfig, tmp_path: Path, kill_at: int = 0) -> subprocess.CompletedProcess:
    path = tmp_path / f"{cfg.run_name}.json"
    path.write_text(cfg.model_dump_json())
    return subprocess.run([sys.executable, "-c", RUN, str(path), str(kill_at)], capture_output=True, text=True,
                          timeout=240)


def weights(storage: RunStorage, step: int) -> dict[str, torch.Tensor]:
    model, _ = fetch(storage, step)
    return model.state_dict()


@pytest.mark.parametrize("kind", ["arithmetic", "text"])
def test_killed_phase_resumes_to_the_weights_and_batches_of_an_unkilled_one(tmp_path, kind):
    tokenizer = tmp_path / "tokenizer"  # trained on the corpus by the first run, shared by both
    ref_cfg, cfg = (make_cfg(tmp_path, name, kind, tokenizer) for name in ("reference", "killed"))
    ref = run(ref_cfg, tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)

    killed = run(cfg, tmp_path, kill_at=2 * EVERY + 1)  # after the mid-phase checkpoint at step 8
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert storage.complete_steps(CHECKPOINTS) == [0, 2 * EVERY]  # only the newest mid-phase one is kept
    mid = storage.step_path(2 * EVERY, CHECKPOINTS)
    progress = P.PhaseProgress.model_validate_json(storage.read_bytes(f"{mid}/{PHASE}"))
    assert (progress.from_step, progress.done, progress.steps) == (0, 2 * EVERY, STEPS)

    # the saved position gives the batches that an unkilled stream gives after 8 batches
    _, tok = fetch(storage, 0)
    fresh, loaded = open_stream(cfg.data, tok), open_stream(cfg.data, tok)
    for _ in range(2 * EVERY):
        fresh.next_batch(BATCH)
    loaded.load_state_dict(json.loads(storage.read_text(f"{mid}/{DATA_STATE}")))
    for _ in range(3):
        a, b = fresh.next_batch(BATCH), loaded.next_batch(BATCH)
        if kind == "text":
            assert torch.equal(a["input_ids"], b["input_ids"])
        else:
            assert a == b

    resumed = run(cfg, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.splitlines()[-1]) == json.loads(ref.stdout.splitlines()[-1])
    want, got = weights(RunStorage.from_config(ref_cfg.storage, ref_cfg.run_name), STEPS), weights(storage, STEPS)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]
    assert storage.complete_steps(CHECKPOINTS) == [0, STEPS]  # the mid-phase checkpoint is gone once done

    # the metrics series holds every step once, the ones logged before the kill and again after it included
    steps = [json.loads(line)["step"] for line in storage.read_text(P.METRICS_SERIES).splitlines()]
    assert steps == list(range(1, STEPS + 1))


def test_a_foreign_checkpoint_inside_the_phase_is_a_one_line_error(tmp_path):
    cfg = make_cfg(tmp_path, "foreign", "arithmetic", tmp_path / "unused")
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    P.init_checkpoint(cfg, storage)
    model, tok = fetch(storage, 0)
    publish(model, tok, storage, 5)  # a checkpoint at a step inside the phase, without phase progress
    with pytest.raises(ValueError, match=r"checkpoint .*step_5 lies inside the phase 0\.\.12 but is no mid-phase"):
        P.pretrain(cfg, storage, 0)
    other = cfg.model_copy(update={"train": cfg.train.model_copy(update={"lr": 1e-3})})
    storage2 = RunStorage.from_config(cfg.storage, "foreign2")
    P.init_checkpoint(cfg, storage2)
    r = run(cfg.model_copy(update={"run_name": "foreign2"}), tmp_path, kill_at=EVERY + 1)
    assert r.returncode == -9, r.stderr[-3000:]
    with pytest.raises(ValueError, match="written with other train, data or precision settings"):
        P.pretrain(other, storage2, 0)


def test_a_next_phase_reads_on_where_the_previous_one_stopped(tmp_path):
    cfg = make_cfg(tmp_path, "phases", "arithmetic", tmp_path / "unused")
    cfg = cfg.model_copy(update={"checkpoint_every": 0, "train": cfg.train.model_copy(update={"steps": 3})})
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    P.init_checkpoint(cfg, storage)
    P.pretrain(cfg, storage, 0)
    P.pretrain(cfg, storage, 3)  # a second phase from the first one's checkpoint
    _, tok = fetch(storage, 0)
    unbroken = open_stream(cfg.data, tok)
    for _ in range(6):
        unbroken.next_batch(BATCH)
    assert json.loads(storage.read_text(f"{storage.step_path(6, CHECKPOINTS)}/{DATA_STATE}")) == unbroken.state_dict()

    # a phase on other data (another seed) reads its own from the start
    other = cfg.model_copy(update={"data": cfg.data.model_copy(update={"seed": 6})})
    P.pretrain(other, storage, 6)
    fresh = open_stream(other.data, tok)
    for _ in range(3):
        fresh.next_batch(BATCH)
    assert json.loads(storage.read_text(f"{storage.step_path(9, CHECKPOINTS)}/{DATA_STATE}")) == fresh.state_dict()
