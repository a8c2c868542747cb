"""benchmarks/wan_utilization.py's plumbing: real DiLoCo runs with every worker on a WAN testbed host.

Skipped where the machine cannot build the testbed (not root, no namespaces, no tc tbf; see wan_fixtures).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from infra.wan.testbed import NETNS_ETC  # repo root is on sys.path via the wan_fixtures plugin

ROOT = Path(__file__).resolve().parents[2]


def test_own_hostname_resolves_to_each_hosts_address_and_goes_with_the_testbed(wan_testbed):
    tb = wan_testbed(2, rate_mbit=100, own_hostname=True)
    name = socket.gethostname()
    for i in range(2):
        out = subprocess.run(["ip", "netns", "exec", tb.hosts[i], "getent", "hosts", name],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        assert out.split()[0] == tb.addr(i)
    etc = [NETNS_ETC / ns for ns in tb.hosts]
    assert all((d / "hosts").exists() for d in etc)
    tb.close()
    assert not any(d.exists() for d in etc)


@pytest.mark.slow
def test_the_benchmark_runs_blocking_and_overlapped_arms_on_wan_hosts(wan_testbed, tmp_path):
    wan_testbed(2, rate_mbit=100)  # skips (with the reason) where no testbed can be built; the benchmark builds its own
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "wan_utilization.py"), "--workers", "2", "--outer-steps", "3",
           "--inner-steps", "2", "--hidden", "32", "--layers", "1", "--arms", "none/int8", "eager/topk",
           "--timeout", "240", "--workdir", str(tmp_path), "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = {x["arm"]: x for x in json.loads(out.read_text())["results"]}
    assert set(results) == {"none/int8", "eager/topk"}, r.stdout
    for arm, x in results.items():
        # every worker committed every step with both contributing: gloo ran between the hosts
        assert x["complete"], (arm, x, r.stdout[-3000:])
        assert 0 < x["util"] <= 1 and x["s_step"] > 0, (arm, x)
    assert 0 < results["eager/topk"]["mb_step"] < results["none/int8"]["mb_step"], results
