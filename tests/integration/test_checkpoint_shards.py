"""Sharded worker checkpoints reshard, and the consolidated HF export loads in ``transformers``
(:mod:`intellect.diloco.checkpoint_shards`), over real gloo groups of spawned processes on 127.0.0.1.

One module-scoped run: a worker of 2 ranks (FSDP2, the odd-sized llama of ``test_fsdp_worker``, so
every shard pair is uneven) trains two AdamW steps, takes an outer step (momentum set, theta_sync
apart from the weights), saves its state and the HF export, then takes one more AdamW step. The
folder is loaded by 1 process (unsharded, no process group, in the parent) and by 4 spawned ranks,
each into a model of another seed, and each takes the same next step. Every process saves what it
ends with; the tests compare.
"""

from __future__ import annotations

import datetime
import math
import shutil
import socket
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LlamaConfig

from intellect.diloco.checkpoint_shards import ShardsRefused, export_hf, load_worker, publish_consolidated, save_worker
from intellect.checkpoints import STABLE, fetch
from intellect.config import ComputeConfig
from intellect.diloco.mesh import WorkerMesh
from intellect.diloco.outer import OuterState
from intellect.diloco.outer_shard import ShardedOuterState, local_part
from intellect.model.arch import new_model
from intellect.model.tokenizer import build_tokenizer
from intellect.parallel import parallelize
from intellect.storage import RunStorage

pytestmark = pytest.mark.slow

LR, OUTER_LR, MOMENTUM = 1e-2, 0.7, 0.9
ROWS, SEQ = 4, 12  # the batch splits evenly over 1, 2 or 4 ranks
REL = "worker_state/w0/step_1"
TORN = "worker_state/torn/step_1"  # REL with a truncated data file, which the 4 ranks try first
EXTRA = {"data": {"cursor": [3, 7]}, "members": ["w0", "w1"]}
CONFIG = LlamaConfig(vocab_size=51, hidden_size=45, num_attention_heads=5, num_key_value_heads=5, head_dim=8,
                     intermediate_size=75, num_hidden_layers=2, tie_word_embeddings=True, max_position_embeddings=64)
ADAM = ("exp_avg", "exp_avg_sq", "step")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(i: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(100 + i))


def _train_step(model, opt, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()  # equal tokens per row: the mean of rank means
    opt.step()
    opt.zero_grad()


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(model, opt, outer) -> dict:
    """Everything a worker checkpoint holds, as full tensors (collective when sharded)."""
    gather = outer.gather if isinstance(outer, ShardedOuterState) else lambda ts=None: [
        t.clone() for t in (outer.params if ts is None else ts)]
    return {"weights": [_whole(p) for p in model.parameters()], "theta": gather(),
            "momentum": gather(outer.momentum_buffers()),
            "adam": [{k: _whole(opt.state[p][k]) for k in ADAM} for p in model.parameters()]}


def _feedback(shapes) -> list[torch.Tensor]:
    """A full error-feedback residual, laid out as the parameters (every element its own value)."""
    return [torch.arange(math.prod(s), dtype=torch.float32).view(s) + 1000 * i for i, s in enumerate(shapes)]


def _rank_main(phase: str, local: int, ranks: int, port: int, root: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    res: dict = {}
    mesh = None
    try:
        # public torch API (torch.distributed's docs); its __init__ re-exports it from torch._C without __all__
        store = dist.TCPStore("127.0.0.1", port, ranks, local == 0, timeout=datetime.timedelta(seconds=60))  # pyright: ignore[reportPrivateImportUsage]
        mesh = WorkerMesh.create(torch.device("cpu"), local, ranks, store=store, timeout=60)
        # another seed than the saved run's: a load that changed nothing fails the comparison
        model = parallelize(new_model(CONFIG, seed=0 if phase == "save" else 1).train(), mesh.fsdp_mesh,
                            ComputeConfig(precision="fp32"))
        outer = ShardedOuterState(model, lr=OUTER_LR, momentum=MOMENTUM)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        rows = slice(local * ROWS // ranks, (local + 1) * ROWS // ranks)
        storage = RunStorage(root)
        if phase == "save":
            for i in range(2):
                _train_step(model, opt, _batch(i)[rows])
            outer.step(outer.pseudo_gradient(model))
            save_worker(storage, REL, model, opt, outer, EXTRA, mesh.intra,
                        {"feedback": local_part(outer, _feedback(outer.full_shapes))})
            export_hf(model, build_tokenizer(), f"{out_dir}/hf", mesh.intra)
            publish_consolidated(model, build_tokenizer(), storage, 1, mesh.intra, outer=outer)
        else:
            try:  # refused on every rank, whichever ranks need the damaged file; nothing changed
                load_worker(storage, TORN, model, opt, outer, mesh.intra)
            except ShardsRefused as e:
                res["torn"] = str(e)
            res["torn_fresh"] = not opt.state and not outer.has_momentum()
            parts = [torch.zeros_like(p) for p in outer.params]
            res["extra"] = load_worker(storage, REL, model, opt, outer, mesh.intra, {"feedback": parts})
            res["feedback"] = outer.gather(parts)
        res["local_numel"] = [p.numel() for p in outer.params]
        res.update(_snapshot(model, opt, outer))
        if phase == "save":
            with torch.no_grad():  # FSDP forward of the whole batch on every rank
                res["logits"] = model(input_ids=_batch(9)).logits
        _train_step(model, opt, _batch(5)[rows])
        res["next"] = [_whole(p) for p in model.parameters()]
    except BaseException:  # noqa: BLE001 - any crash goes back to the parent, which fails the test
        res["crash"] = traceback.format_exc()
    finally:
        if mesh is not None:
            mesh.close()
    torch.save(res, f"{out_dir}/{phase}_{local}.pt")


def _spawn(phase: str, ranks: int, root: str, out: Path, deadline: float = 120.0) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(phase, m, ranks, port, root, str(out))) for m in range(ranks)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline
    for p in procs:
        p.join(max(0.1, end - time.monotonic()))
    hung = [m for m, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"{phase}: ranks {hung} still running after {deadline}s"
    res = [torch.load(out / f"{phase}_{m}.pt") for m in range(ranks)]
    for r in res:
        assert "crash" not in r, r["crash"]
    return res


def _fresh():
    """An unsharded model of another seed than the saved one's, its OuterState and AdamW."""
    model = new_model(CONFIG, seed=1).train()
    return model, OuterState(model, lr=OUTER_LR, momentum=MOMENTUM), torch.optim.AdamW(model.parameters(), lr=LR)


def _load_one(storage: RunStorage) -> dict:
    """The 1-process load: an unsharded model and OuterState, no process group."""
    model, outer, opt = _fresh()
    parts = [torch.zeros_like(p) for p in outer.params]
    res = {"extra": load_worker(storage, REL, model, opt, outer, extras={"feedback": parts}), "feedback": parts}
    res.update(_snapshot(model, opt, outer))
    _train_step(model, opt, _batch(5))
    res["next"] = [p.detach().clone() for p in model.parameters()]
    return res


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("shards")
    root = str(out / "run")
    saved = _spawn("save", 2, root, out)
    _torn(root, TORN, _truncate)
    return {"root": root, "out": out, "saved": saved, "one": _load_one(RunStorage(root)),
            "four": _spawn("load", 4, root, out)}


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [t.shape for t in a] == [t.shape for t in b]
    num = sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b))
    return math.sqrt(num / sum(float(y.double().pow(2).sum()) for y in b))


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def test_layout(run):
    """One data file per saving rank, DCP's index, the JSON, STABLE last: no per-rank torch.save."""
    folder = Path(run["root"]) / REL
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "STABLE", "__0_0.distcp", "__1_0.distcp",
                                                       "shards.json"]
    sizes = [run["saved"][m]["local_numel"] for m in range(2)]
    assert sum(sizes[0]) > sum(sizes[1]), "the shards are uneven"


@pytest.mark.parametrize("target", ["one", "four"])
def test_resharded_load_is_exact(run, target):
    """Loaded on 1 process (unsharded) and on 4 ranks, the full weights, theta_sync, the outer
    momentum and AdamW's moments and step counts are the saved ones bit for bit, and the next AdamW
    step on the same batch gives the 2-rank run's next weights."""
    saved = run["saved"][0]
    assert _rel(saved["weights"], saved["theta"]) > 1e-4, "the weights and theta_sync must differ to tell them apart"
    assert any(float(m.abs().max()) > 0 for m in saved["momentum"])
    loaded = [run["one"]] if target == "one" else run["four"]
    for res in loaded:
        assert res["extra"] == {**EXTRA, "feedback": True}
        # the error-feedback residual (compression topk) reshards as theta_sync does
        assert _equal(res["feedback"], _feedback([t.shape for t in saved["theta"]]))
        for key in ("weights", "theta", "momentum"):
            assert _equal(res[key], saved[key]), key
        for got, want in zip(res["adam"], saved["adam"]):
            for k in ADAM:
                assert torch.equal(got[k], want[k]), k
        assert float(saved["adam"][0]["step"]) == 2.0
        assert _rel(res["next"], saved["next"]) < 1e-6
    assert _rel(saved["next"], saved["weights"]) > 1e-4, "the next step moved the weights"


def test_hf_export_matches_sharded_logits(run):
    """The consolidated export loads in transformers as it is, its weights are the model's, and its
    logits equal the FSDP forward's."""
    saved = run["saved"][0]
    hf = AutoModelForCausalLM.from_pretrained(run["out"] / "hf", local_files_only=True).eval()
    assert [p.dtype for p in hf.parameters()] == [torch.float32] * len(saved["weights"])
    assert _equal([p.detach() for p in hf.parameters()], saved["weights"])
    with torch.no_grad():
        logits = hf(input_ids=_batch(9)).logits
    assert (logits - saved["logits"]).abs().max() <= 1e-5 * saved["logits"].abs().max()
    assert (run["out"] / "hf" / "tokenizer.json").is_file()


def _torn(root: str, rel: str, damage) -> RunStorage:
    shutil.copytree(Path(root) / REL, Path(root) / rel)
    damage(Path(root) / rel)
    return RunStorage(root)


def _truncate(folder: Path) -> None:
    data = folder / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])


@pytest.mark.parametrize("damage,match", [(lambda d: (d / STABLE).unlink(), "no STABLE"), (_truncate, "truncated")])
def test_torn_folder_is_refused(run, damage, match):
    """A folder without STABLE, or with a truncated shard file, is refused with a clear error, and
    nothing it was to be loaded into changed (a fresh AdamW stays fresh)."""
    rel = f"worker_state/torn_{match.split()[-1].lower()}/step_1"
    storage = _torn(run["root"], rel, damage)
    model, outer, opt = _fresh()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ShardsRefused, match=match):
        load_worker(storage, rel, model, opt, outer)
    assert _equal([p.detach() for p in model.parameters()], before)
    assert not opt.state and not outer.has_momentum()


def test_published_checkpoint_is_theta_sync(run):
    """The consolidated outer checkpoint (theta_sync gathered from the shards) is published as
    checkpoints/step_1, an HF folder holding theta_sync, not the trained weights."""
    model, _ = fetch(RunStorage(run["root"]), 1)
    assert _equal([p.detach() for p in model.parameters()], run["saved"][0]["theta"])


def _same_state(a: dict, b: dict) -> None:
    for key in ("weights", "theta", "momentum"):
        assert _equal(a[key], b[key]), key
    for got, want in zip(a["adam"], b["adam"]):
        assert all(torch.equal(got[k], want[k]) for k in ADAM)


def test_s3_round_trip(run, s3_storage):
    """On S3 (moto on 127.0.0.1): the 2-rank folder loads on one process, and that process's own
    save reads back the same state."""
    src = Path(run["root"]) / REL
    s3_storage.write_step(1, "worker_state/w0", {p.name: p for p in src.iterdir() if p.name != STABLE})
    model, outer, opt = _fresh()
    assert load_worker(s3_storage, REL, model, opt, outer) == EXTRA
    _same_state(_snapshot(model, opt, outer), run["saved"][0])
    save_worker(s3_storage, "worker_state/w1/step_2", model, opt, outer, {"n": 2})
    assert s3_storage.listdir("worker_state/w1/step_2") == [".metadata", "STABLE", "__0_0.distcp", "shards.json"]
    again, outer2, opt2 = _fresh()
    assert load_worker(s3_storage, "worker_state/w1/step_2", again, opt2, outer2) == {"n": 2}
    _same_state(_snapshot(again, opt2, outer2), run["saved"][0])


def test_torn_folder_is_refused_on_every_rank(run):
    """On 4 ranks, the ranks that need the truncated file refuse it and the others learn so: every
    rank raises (none waits in a collective), and each rank's fresh AdamW stayed fresh."""
    errors = [res.get("torn") for res in run["four"]]
    # ranks 0 and 1 read the damaged __0_0, ranks 2 and 3 only __1_0: they refuse because the others did
    assert all(errors) and any("truncated" in e for e in errors) and any("of the group failed" in e for e in errors), \
        errors
    assert all("truncated" in e or "of the group failed" in e for e in errors), errors
    assert all(res["torn_fresh"] for res in run["four"])
