"""The int8 all-reduce over an NCCL group (``transport.new_group(..., backend="nccl")``): the path a
group takes when its messages travel between CUDA devices, which no CPU test runs. Two spawned ranks,
one GPU each, host fp32 tensors as DiLoCo's pseudo-gradients are; plain and sealed (``mac_key``).
NCCL refuses two ranks of one group on one device, so on a machine with one GPU this skips and says so."""

from __future__ import annotations

import datetime
import math
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from intellect.diloco import transport
from intellect.diloco.allreduce import all_reduce_mean

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

WORLD = 2
SHAPES = [(1000, 37), (5,), (2, 3, 4)]
CASES = {"plain": None, "sealed": b"k" * 32}


def inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    res: dict = {}
    try:
        torch.cuda.set_device(rank)
        # public torch API (torch.distributed's docs); its __init__ re-exports it from torch._C without __all__
        store = torch.distributed.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            "127.0.0.1", port, WORLD, rank == 0, timeout=datetime.timedelta(seconds=60))
        group = transport.new_group(store, "nccl-test", rank, WORLD, timeout=60.0, backend="nccl")
        for name, key in CASES.items():
            ts = inputs(rank)
            stats = all_reduce_mean(ts, group, mac_key=key)
            res[name] = {"out": ts, "contributors": stats.contributors, "payload": stats.payload_bytes}
    except BaseException:  # noqa: BLE001 - any crash goes back to the parent, which fails the test
        res["crash"] = traceback.format_exc()
    torch.save(res, f"{out_dir}/{rank}.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_int8_all_reduce_over_nccl_is_identical_on_both_ranks_and_near_the_mean(tmp_path):
    count = torch.cuda.device_count()
    if count < WORLD:
        pytest.skip(f"NCCL refuses two ranks of one group on one GPU (duplicate device): needs {WORLD} GPUs, "
                    f"this machine has {count}")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    end = time.monotonic() + 150
    for p in procs:
        p.join(max(0.1, end - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still running after 150 s"
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(WORLD)]
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r}:\n{res['crash']}"
    exact = [torch.stack([inputs(r)[i].double() for r in range(WORLD)]).mean(0) for i in range(len(SHAPES))]
    for name in CASES:
        outs = [res[name]["out"] for res in results]
        assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1])), f"{name}: ranks differ"
        assert all(res[name]["contributors"] == (0, 1) and res[name]["payload"] > 0 for res in results)
        err = math.sqrt(sum(float((o.double() - e).pow(2).sum()) for o, e in zip(outs[0], exact))
                        / sum(float(e.pow(2).sum()) for e in exact))
        assert err < 0.03, f"{name}: relative error {err:.4f} against the exact mean"
