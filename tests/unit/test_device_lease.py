"""The pool worker's device lease (``infra/devices.py``) and the GPU pools' ``devices`` job variable."""

from __future__ import annotations

import doctest
import random

import pytest

from infra import cluster, pool_worker
from infra import devices as devices_mod
from infra.cluster import POOLS
from infra.devices import DeviceLease, host_devices, parse_devices, smi_indices
from infra.pool_worker import check_job_variables, pool_template, requested_devices

GPU_POOLS = ("gpu-rollout", "gpu-train", "gpu-diloco")


def test_doctests():
    assert doctest.testmod(devices_mod).failed == 0
    assert doctest.testmod(pool_worker).failed == 0
    assert doctest.testmod(cluster).failed == 0  # a GPU pool's limit follows the host's devices


def test_device_lists_parse_and_refuse_what_cuda_would_not_take():
    assert parse_devices(" 0 ,1,,GPU-5e6f-77 ") == ("0", "1", "GPU-5e6f-77")
    for bad in ("0;touch x", "0 1", "$(x)", "a" * 129):
        with pytest.raises(ValueError, match="not a device id"):
            parse_devices(bad)
    with pytest.raises(ValueError, match="listed twice"):
        DeviceLease(("1", "2", "1"))
    assert smi_indices("0\n1\n2\n3\n") == ("0", "1", "2", "3")


def test_host_devices_prefer_the_option_then_the_workers_own_visible_devices():
    env = {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert host_devices("0,1", env) == ("0", "1")
    assert host_devices("", env) == ()  # '' is "none", not "detect"
    assert host_devices(None, env) == ("4", "5")
    assert host_devices(None, {"CUDA_VISIBLE_DEVICES": ""}) == ()


def test_the_lease_hands_out_disjoint_devices_and_takes_them_back():
    lease = DeviceLease(("0", "1", "2", "3"))
    a, b = lease.take("a", 2), lease.take("b", 2)
    assert a == ("0", "1") and b == ("2", "3")
    assert lease.take("c", 2) is None and lease.held("c") is None  # waits, holding nothing
    assert lease.take("a", 2) == a  # asking again: what it holds, nothing more
    lease.release("b")
    lease.release("b")  # every exit path may release
    assert lease.take("c", 2) == ("2", "3")
    assert lease.take("d", 0) == () and lease.free() == ()
    lease.release("a")
    assert lease.take("e", 1) == ("0",)
    with pytest.raises(ValueError, match="asks for 5 devices; this worker has 4"):
        lease.take("f", 5)
    with pytest.raises(ValueError, match="asks for -1"):
        lease.take("f", -1)
    assert lease.held("f") is None


def test_no_device_is_ever_held_twice_over_random_takes_and_releases():
    rng = random.Random(0)
    lease = DeviceLease(tuple(str(i) for i in range(8)))
    live: dict[int, tuple[str, ...]] = {}
    for holder in range(2000):
        if live and rng.random() < 0.45:
            gone = rng.choice(sorted(live))
            lease.release(gone)
            del live[gone]
        want = rng.randint(0, 8)
        grant = lease.take(holder, want)
        taken = [d for g in live.values() for d in g]
        if grant is None:
            assert 8 - len(taken) < want  # refused only when too few are free
        else:
            assert len(grant) == want and not set(grant) & set(taken)
            live[holder] = grant
        assert sorted(lease.free() + tuple(d for g in live.values() for d in g), key=int) == list(lease.devices)


def test_gpu_pools_ask_one_device_by_default_and_take_no_visible_devices_from_the_poster():
    for pool in POOLS:
        template = pool_template(pool)
        asked = requested_devices(template, None, None)
        assert asked == (1 if pool in GPU_POOLS else None), pool
        # the lease alone sets CUDA_VISIBLE_DEVICES: a poster's value is refused on every pool
        for variables in ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, {"env.CUDA_VISIBLE_DEVICES": "0"}):
            with pytest.raises(ValueError, match="refused by this worker's pool template"):
                check_job_variables(template, variables, "flow run")
    gpu = pool_template("gpu-diloco")
    assert requested_devices(gpu, {"devices": 8}, {"devices": 2}) == 2  # the flow run's own wins
    assert requested_devices(gpu, {"devices": 0}, None) == 0
    for bad in (-1, 65, "2", 1.5):
        with pytest.raises(ValueError, match="refused"):
            requested_devices(gpu, None, {"devices": bad})
    with pytest.raises(ValueError, match="refused"):
        requested_devices(pool_template("cpu"), None, {"devices": 1})
