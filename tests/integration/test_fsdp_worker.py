"""FSDP2 inside a DiLoCo worker over real gloo groups (spawned processes on 127.0.0.1): the mesh
(:mod:`intellect.diloco.mesh`), :func:`intellect.parallel.parallelize` and the outer state per shard
(:mod:`intellect.diloco.outer_shard`), each checked against the unsharded code on the same numbers.

One run of 2 workers x 2 ranks (spawned once for the module: process start-up is most of its time)
trains a llama of hidden size 45, MLP width 75 and vocabulary 51 in fp32: no dimension divides by 2,
so every shard pair is uneven. The single-process reference runs in the parent, from the same seed
and batches. A rank saves what it ends with; the parent compares.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from transformers import LlamaConfig

from intellect.config import ComputeConfig
from intellect.diloco.allreduce import all_reduce_mean
from intellect.diloco.mesh import WorkerMesh
from intellect.diloco.outer import OuterState
from intellect.diloco.outer_shard import ShardedOuterState
from intellect.model.arch import new_model
from intellect.parallel import parallelize, shard_bounds

pytestmark = pytest.mark.slow

LR, OUTER_LR, MOMENTUM = 1e-2, 0.7, 0.9
ROWS, SEQ = 6, 12  # global batch: ROWS sequences, split evenly over 1, 2 or 3 ranks
INNER, OUTER = 2, 2  # AdamW steps per outer step, outer steps
WORKERS, RANKS = 2, 2
# hidden 45 (odd: 5 heads of their own head_dim 8, as rotary embeddings need an even one), MLP 75, vocabulary 51
CONFIG = LlamaConfig(vocab_size=51, hidden_size=45, num_attention_heads=5, num_key_value_heads=5, head_dim=8,
                     intermediate_size=75, num_hidden_layers=2, tie_word_embeddings=True, max_position_embeddings=64)


def build_model():
    return new_model(CONFIG, seed=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(worker: int, outer: int, inner: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * worker + 10 * outer + inner)
    return torch.randint(0, vocab, (ROWS, SEQ), generator=g)


def _inner_phase(model, opt, worker, outer, vocab, rows=slice(None)) -> None:
    for i in range(INNER):
        ids = _batch(worker, outer, i, vocab)[rows]
        model(input_ids=ids, labels=ids).loss.backward()  # equal tokens per row: the mean of rank means
        opt.step()
        opt.zero_grad()


def _full(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in model.parameters()]


def _rank_main(worker, local, workers, ranks, port, worker_port, out_dir):
    torch.set_num_threads(1)
    res: dict = {}
    mesh = None
    try:
        # public torch API (torch.distributed's docs); its __init__ re-exports it from torch._C without __all__
        store = dist.TCPStore("127.0.0.1", port, workers * ranks, worker == 0 and local == 0,  # pyright: ignore[reportPrivateImportUsage]
                              timeout=datetime.timedelta(seconds=60))
        if worker == 0:  # ranks and store given explicitly
            mesh = WorkerMesh.create(torch.device("cpu"), local, ranks,
                                     store=dist.PrefixStore("worker0/", store), timeout=60)  # pyright: ignore[reportPrivateImportUsage]
        else:  # as torchrun launches a worker: its ranks and its own rendezvous in the environment
            os.environ.update(LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(worker_port))
            mesh = WorkerMesh.create(torch.device("cpu"), timeout=60)
        cross = mesh.join(store, "mesh_0", worker, workers, timeout=60, hostname="127.0.0.1") if workers > 1 else None
        model = build_model()
        model = parallelize(model.train(), mesh.fsdp_mesh, ComputeConfig(precision="fp32"))
        outer = ShardedOuterState(model, lr=OUTER_LR, momentum=MOMENTUM)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        per = ROWS // ranks
        res["local_numel"] = [p.numel() for p in outer.params]
        res["steps"] = []
        for n in range(OUTER):
            _inner_phase(model, opt, worker, n, CONFIG.vocab_size, slice(local * per, (local + 1) * per))
            before = outer.gather()  # theta_sync before the step, full, for the unsharded replay
            trained = _full(model)
            grads = outer.pseudo_gradient(model)
            if cross is not None:  # this shard with the same shard of the other workers
                all_reduce_mean(grads, cross, compression="fp32")
            avg_full = outer.gather(grads)
            outer.step(grads)
            outer.load_into(model)
            res["steps"].append({"before": before, "trained": trained, "average": avg_full,
                                 "after": outer.gather(), "model": _full(model), "digest": outer.full_digest(),
                                 "momentum": outer.gather(outer.momentum_buffers())})
        res["mixed"] = _mixed_precision_grads(mesh, slice(local * per, (local + 1) * per))
    except BaseException:  # noqa: BLE001 - any crash goes back to the parent, which fails the test
        res["crash"] = traceback.format_exc()
    finally:
        if mesh is not None:
            mesh.close()
    torch.save(res, f"{out_dir}/{worker}_{local}.pt")


def _mixed_precision_grads(mesh: WorkerMesh, rows: slice) -> dict:
    """One backward of a fresh model under bf16-mixed with activation checkpointing: the dtypes FSDP
    keeps and the full gradients."""
    model = parallelize(build_model().train(), mesh.fsdp_mesh,
                        ComputeConfig(precision="bf16-mixed", activation_checkpointing=True))
    ids = _batch(7, 0, 0, CONFIG.vocab_size)[rows]
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters()]
    return {"params": sorted({str(p.dtype) for p in model.parameters()}),
            "grads": sorted({str(g.dtype) for g in grads if g is not None}),
            "full": [g.full_tensor() for g in grads if isinstance(g, DTensor)]}


def _spawn(tmp_path, workers, ranks, deadline=150.0) -> dict:
    ctx = mp.get_context("spawn")
    port, worker_port = _free_port(), _free_port()
    procs = {(w, m): ctx.Process(target=_rank_main, args=(w, m, workers, ranks, port, worker_port, str(tmp_path)))
             for w in range(workers) for m in range(ranks)}
    for p in procs.values():
        p.start()
    end = time.monotonic() + deadline
    for p in procs.values():
        p.join(max(0.1, end - time.monotonic()))
    hung = [k for k, p in procs.items() if p.is_alive()]
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still running after {deadline}s"
    out = {}
    for w, m in procs:
        out[w, m] = torch.load(tmp_path / f"{w}_{m}.pt")
        assert "crash" not in out[w, m], out[w, m]["crash"]
    return out


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [t.shape for t in a] == [t.shape for t in b]
    num = sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b))
    return math.sqrt(num / sum(float(y.double().pow(2).sum()) for y in b))


def _reference(workers) -> list[dict]:
    """The unsharded DiLoCo of ``workers`` single-process replicas on the same batches: per outer
    step, each worker's weights after the inner phase and theta_sync after the outer step."""
    base = build_model()
    models = [copy.deepcopy(base).train() for _ in range(workers)]
    outers = [OuterState(m, lr=OUTER_LR, momentum=MOMENTUM) for m in models]
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    steps = []
    for n in range(OUTER):
        for w in range(workers):
            _inner_phase(models[w], opts[w], w, n, CONFIG.vocab_size)
        trained = [[p.detach().clone() for p in m.parameters()] for m in models]
        grads = [o.pseudo_gradient(m) for o, m in zip(outers, models)]
        avg = [sum(gs[i] for gs in grads) / workers for i in range(len(grads[0]))]  # type: ignore[arg-type]
        for o, m in zip(outers, models):
            o.step(avg)
            o.load_into(m)
        steps.append({"trained": trained, "after": [p.clone() for p in outers[0].params],
                      "digest": outers[0].digest()})
    return steps


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, list[dict]]:
    """What every rank of the 2 x 2 run saved, and the unsharded two-replica reference."""
    return _spawn(tmp_path_factory.mktemp("fsdp"), WORKERS, RANKS), _reference(WORKERS)


def _digest_of(tensors: list[torch.Tensor]) -> str:
    model = torch.nn.Module()
    model.ps = torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in tensors])
    return OuterState(model).digest()


def test_fsdp_training_equals_one_process(run):
    """(a) AdamW on FSDP2 shards over a worker's 2 ranks equals the single-process training of the
    same batches: after the first inner phase (2 steps), and after the second."""
    results, ref = run
    for w in range(WORKERS):
        for m in range(RANKS):
            assert _rel(results[w, m]["steps"][0]["trained"], ref[0]["trained"][w]) < 1e-5, (w, m)
            assert _rel(results[w, m]["steps"][1]["trained"], ref[1]["trained"][w]) < 1e-5, (w, m)
    # the two workers trained on different batches: the check above tells them apart
    assert _rel(ref[0]["trained"][0], ref[0]["trained"][1]) > 1e-3


def test_sharded_outer_step_equals_outer_state(run):
    """(b) Rank i averages its shard with rank i of the other worker only; the sharded step is
    OuterState.step on the full tensors (replayed from the same numbers), the result is loaded into
    the sharded model, the gathered digest is the unsharded digest, and the run follows the
    unsharded two-replica DiLoCo."""
    results, ref = run
    full = build_model()
    for (w, m), res in results.items():
        momentum = None
        for n, step in enumerate(res["steps"]):
            replay = OuterState(full, lr=OUTER_LR, momentum=MOMENTUM)
            replay.set_state(step["before"], momentum)
            replay.step(step["average"])
            momentum = replay.momentum_buffers()
            assert _rel(step["after"], replay.params) <= 1e-6, (n, w, m)
            assert _rel(step["momentum"], momentum) <= 1e-6, (n, w, m)
            assert _rel(step["model"], step["after"]) == 0.0
            assert step["digest"] == _digest_of(step["after"]) == _digest_of(replay.params)
            assert _rel(step["after"], ref[n]["after"]) < 1e-5, (n, w, m)
    assert len({res["steps"][-1]["digest"] for res in results.values()}) == 1, "replicas disagree on theta_sync"
    assert ref[-1]["digest"] != _digest_of(list(full.parameters())), "the outer steps changed nothing"


def test_bf16_mixed_keeps_fp32_masters(run):
    """bf16-mixed with activation checkpointing: parameters and gradients stay fp32 (FSDP casts the
    gathered copy only), and the gradients are the fp32 ones up to bf16's rounding (not equal to them)."""
    results, _ = run
    model = build_model().train()
    ids = _batch(7, 0, 0, CONFIG.vocab_size)
    model(input_ids=ids, labels=ids).loss.backward()
    ref = [p.grad for p in model.parameters() if p.grad is not None]
    for res in results.values():
        assert res["mixed"]["params"] == res["mixed"]["grads"] == ["torch.float32"]
        assert 1e-5 < _rel(res["mixed"]["full"], ref) < 0.05


def test_uneven_shards(run):
    """(c) Each rank's fp32 copy is sized from its own shard: hidden 45, MLP 75 and vocabulary 51
    split as 23 + 22, 38 + 37, 26 + 25 rows."""
    results, _ = run
    full = [p.shape for p in build_model().parameters()]
    for m in range(RANKS):
        numel = results[0, m]["local_numel"]
        expect = [(e - s) * shape[1:].numel() for shape in full for s, e in [shard_bounds(shape[0], RANKS)[m]]]
        assert numel == expect
    sizes = [sum(results[0, m]["local_numel"]) for m in range(RANKS)]
    assert sizes[0] > sizes[1] and sum(sizes) == sum(s.numel() for s in full)
