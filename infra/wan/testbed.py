"""WAN testbed: N hosts as Linux network namespaces joined by veth links shaped with ``tc``.

Topologies
  mesh  each pair of hosts has its own veth pair; the direction i->j is shaped on i's end,
        so ``rate_mbit[i][j]`` / ``delay_ms[i][j]`` are per directed link.
  star  each host hangs off one bridge in a switch namespace; host i's uplink is shaped on
        its own end and its downlink on the switch port.

Host i has one address, ``addr(i)`` (10.77.0.<i+1>, on interface ``wan0``), that every
other host reaches over its direct link. Tools that want one address per rank (TCPStore,
gloo with ``GLOO_SOCKET_IFNAME=wan0``) work unchanged. Veth ends are created directly
inside the namespaces, so nothing ever appears in, or is routed through, the host's own
namespace.

Rate uses ``tbf`` and delay uses ``netem``; kernels without sch_netem (``probe()`` says)
can shape rate but not delay.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from infra.procs import alive

PREFIX = "iwan-"
IFNAME = "wan0"
SUBNET = "10.77.0"
PROBE = Path(__file__).with_name("probe.py")
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NAME` bind-mounts NETNS_ETC/NAME/<file> over /etc/<file>
_STALE = re.compile(rf"^{PREFIX}(\d+)-")
_seq = itertools.count()


class Unsupported(RuntimeError):
    """The machine cannot build what was asked (no root, no netns, no netem...)."""


def _cmd(argv: Sequence[str], input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=60)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}\n{input or ''}")
    return r


def _batch(tool: str, ns: str | None, lines: list[str]) -> None:
    # one ip/tc process per namespace instead of one per command: setup stays ~0.1 s
    if lines:
        _cmd([tool, *(["-n", ns] if ns else []), "-batch", "-"], input="\n".join(lines) + "\n")


def _netns_list() -> list[str]:
    return [line.split()[0] for line in _cmd(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def _del_netns(ns: str) -> None:
    # Processes keep a namespace (and its veths) alive after its name is gone.
    for pid in _cmd(["ip", "netns", "pids", ns], check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _cmd(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)  # own_hostname's hosts file, if any


def cleanup_stale() -> list[str]:
    """Delete ``iwan-<pid>-*`` namespaces whose creating process is dead; returns their names."""
    if not shutil.which("ip"):
        return []
    stale = [ns for ns in _netns_list() if (m := _STALE.match(ns)) and not alive(int(m.group(1)))]
    for ns in stale:
        _del_netns(ns)
    return stale


@dataclass(frozen=True)
class Caps:
    """Why each feature is unavailable (None: available)."""

    netns: str | None
    tbf: str | None
    netem: str | None

    def missing(self, rate: bool = True, delay: bool = False) -> str | None:
        return self.netns or (rate and self.tbf) or (delay and self.netem) or None


@functools.cache
def probe() -> Caps:
    """Find out, by trying in a throwaway namespace, what this machine can emulate."""
    if not sys.platform.startswith("linux"):
        return Caps(*["needs Linux network namespaces"] * 3)
    if os.geteuid() != 0:
        return Caps(*["needs root (network namespaces and tc)"] * 3)
    if not (shutil.which("ip") and shutil.which("tc")):
        return Caps(*["needs iproute2 (ip, tc): apt-get install iproute2"] * 3)
    ns = f"{PREFIX}{os.getpid()}-probe{next(_seq)}"

    def attempt(argv: list[str], what: str) -> str | None:
        r = _cmd(argv, check=False)
        return None if r.returncode == 0 else f"{what}: {r.stderr.strip() or r.returncode}"

    try:
        netns = attempt(["ip", "netns", "add", ns], "cannot create network namespaces") or attempt(
            ["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"], "no veth support"
        )
        if netns:
            return Caps(netns, netns, netns)
        tbf = attempt(
            ["tc", "-n", ns, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1mbit", "burst", "16k",
             "limit", "64k"],
            "tc tbf unavailable (rate shaping; CONFIG_NET_SCH_TBF)",
        )
        netem = attempt(
            ["tc", "-n", ns, "qdisc", "add", "dev", "p1", "root", "netem", "delay", "1ms"],
            "tc netem unavailable (delay emulation; kernel lacks sch_netem / CONFIG_NET_SCH_NETEM)",
        )
        return Caps(None, tbf, netem)
    finally:
        _cmd(["ip", "netns", "del", ns], check=False)


def qdisc_lines(dev: str, rate_mbit: float | None, delay_ms: float) -> list[str]:
    """tc batch lines that shape ``dev``'s egress: netem (delay) at the root, tbf (rate) below it."""
    lines = []
    if delay_ms:
        # 100k packets: room for a 1 Gbit/s x 1 s delay line; the default 1000 drops at high BDP
        lines.append(f"qdisc add dev {dev} root handle 1: netem delay {delay_ms}ms limit 100000")
    if rate_mbit:
        bps = rate_mbit * 1e6 / 8
        burst = max(16384, int(bps / 1000))  # >= 1 ms of traffic, or tbf undershoots at high rates
        # ~20 ms of queue: with ~100 ms, a flow sharing a link with reverse traffic (its ACKs
        # queued behind data) ramped up to only ~60% of the rate within a few MB
        limit = burst + int(bps * 0.02)
        where = "parent 1:1 handle 10:" if delay_ms else "root handle 1:"
        lines.append(f"qdisc add dev {dev} {where} tbf rate {int(rate_mbit * 1e6)}bit burst {burst} "
                     f"limit {limit}")
    return lines


def _matrix(v: Any, n: int) -> list[list[Any]]:
    if isinstance(v, (list, tuple)):
        if len(v) != n or any(len(row) != n for row in v):
            raise ValueError(f"expected an {n}x{n} matrix, got {v!r}")
        return [list(row) for row in v]
    return [[v] * n for _ in range(n)]


def _vector(v: Any, n: int) -> list[Any]:
    if isinstance(v, (list, tuple)):
        if len(v) != n:
            raise ValueError(f"expected {n} values, got {v!r}")
        return list(v)
    return [v] * n


def _finish(p: subprocess.Popen, timeout: float) -> str:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise TimeoutError(f"{p.args} timed out after {timeout}s: {err}") from None
    if p.returncode:
        raise RuntimeError(f"{p.args} exited {p.returncode}: {err}")
    return out


_UNSET: Any = object()


class Testbed:
    """Hosts ``0..n_hosts-1`` as namespaces with shaped links; use as a context manager.

    mesh: ``rate_mbit`` / ``delay_ms`` are a scalar or an n x n matrix, [i][j] shaping the
    direction i->j (one-way delay; RTT(i, j) = delay[i][j] + delay[j][i]).
    star: ``rate_mbit`` is each host's uplink (scalar or list), ``downlink_mbit`` its
    downlink (defaults to the uplink), ``delay_ms`` each access link's one-way delay, in
    both directions (one-way i->j = delay[i] + delay[j]).
    ``None`` rate / 0 delay leaves that part unshaped (veth speed, ~tens of Gbit/s).
    ``own_hostname``: inside host i (for what :meth:`run` starts), the machine's host name resolves to
    ``addr(i)``, for tools that find their own address from it (gloo's default device); without it the
    name resolves as ``/etc/hosts`` says, often to a loopback address that no other host can reach.
    """

    def __init__(
        self,
        n_hosts: int,
        *,
        topology: str = "mesh",
        rate_mbit: Any = None,
        delay_ms: Any = 0.0,
        downlink_mbit: Any = _UNSET,
        own_hostname: bool = False,
    ):
        if topology not in ("mesh", "star"):
            raise ValueError(f"topology must be 'mesh' or 'star', not {topology!r}")
        if not 2 <= n_hosts <= 250:
            raise ValueError("n_hosts must be in 2..250")
        if downlink_mbit is not _UNSET and topology != "star":
            raise ValueError("downlink_mbit is for the star topology")
        self.n, self.topology = n_hosts, topology
        self.id = f"{PREFIX}{os.getpid()}-{next(_seq)}"
        self.hosts = [f"{self.id}-h{i}" for i in range(n_hosts)]
        self.switch = f"{self.id}-sw" if topology == "star" else None
        self.namespaces = self.hosts + ([self.switch] if self.switch else [])
        self._procs: list[subprocess.Popen] = []
        self._shaped: set[tuple[str, str]] = set()
        self._closed = False
        atexit.register(self.close)
        try:
            if topology == "mesh":
                self._build_mesh(_matrix(rate_mbit, n_hosts), _matrix(delay_ms, n_hosts))
            else:
                up = _vector(rate_mbit, n_hosts)
                down = up if downlink_mbit is _UNSET else _vector(downlink_mbit, n_hosts)
                self._build_star(up, down, _vector(delay_ms, n_hosts))
            if own_hostname:
                self._write_hosts()
        except BaseException:
            self.close()
            raise

    # -- building -------------------------------------------------------------------
    def addr(self, i: int) -> str:
        """Host i's address; the same from every other host."""
        return f"{SUBNET}.{i + 1}"

    def _build_mesh(self, rate: list[list[Any]], delay: list[list[Any]]) -> None:
        root = [f"netns add {ns}" for ns in self.hosts]
        # link to peer j is named l<j> in every namespace
        for i, j in itertools.combinations(range(self.n), 2):
            root.append(f"link add l{j} netns {self.hosts[i]} type veth "
                        f"peer name l{i} netns {self.hosts[j]}")
        _batch("ip", None, root)
        for i, ns in enumerate(self.hosts):
            # wan0, a port-less bridge, holds the host address (a dummy would, but CONFIG_DUMMY is often off)
            lines = ["link set lo up", f"link add {IFNAME} type bridge",
                     f"addr add {self.addr(i)}/32 dev {IFNAME}", f"link set {IFNAME} up"]
            for j in range(self.n):
                if j != i:
                    lines += [f"link set l{j} up", f"route add {self.addr(j)}/32 dev l{j} src {self.addr(i)}"]
            _batch("ip", ns, lines)
        for i in range(self.n):
            for j in range(self.n):
                if i != j:
                    self._shape(self.hosts[i], f"l{j}", rate[i][j], delay[i][j])

    def _build_star(self, up: list[Any], down: list[Any], delay: list[Any]) -> None:
        switch = self.switch
        assert switch is not None, "a star testbed has a switch namespace"
        root = [f"netns add {ns}" for ns in self.namespaces]
        root += [f"link add {IFNAME} netns {ns} type veth peer name p{i} netns {switch}"
                 for i, ns in enumerate(self.hosts)]
        _batch("ip", None, root)
        sw = ["link set lo up", "link add br0 type bridge", "link set br0 up"]
        sw += [f"link set p{i} master br0 up" for i in range(self.n)]
        _batch("ip", switch, sw)
        for i, ns in enumerate(self.hosts):
            _batch("ip", ns, ["link set lo up", f"addr add {self.addr(i)}/24 dev {IFNAME}",
                              f"link set {IFNAME} up"])
            self._shape(ns, IFNAME, up[i], delay[i])
            self._shape(switch, f"p{i}", down[i], delay[i])

    def _write_hosts(self) -> None:
        # ip netns exec bind-mounts it over /etc/hosts; the first line for a name wins
        name = socket.gethostname()
        try:
            base = Path("/etc/hosts").read_text().splitlines()
        except OSError:
            base = ["127.0.0.1 localhost"]
        rest = [line for line in base if name not in line.split("#")[0].split()[1:]]
        for i, ns in enumerate(self.hosts):
            d = NETNS_ETC / ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("\n".join([f"{self.addr(i)} {name}", *rest]) + "\n")

    def _shape(self, ns: str, dev: str, rate_mbit: float | None, delay_ms: float) -> None:
        if delay_ms and (why := probe().netem):
            raise Unsupported(why)
        shaping = qdisc_lines(dev, rate_mbit, delay_ms)
        # del + add, not replace: replace cannot swap the root between tbf and netem
        lines = ([f"qdisc del dev {dev} root"] if (ns, dev) in self._shaped else []) + shaping
        self._shaped.discard((ns, dev))
        _batch("tc", ns, lines)
        if shaping:
            self._shaped.add((ns, dev))

    # -- runtime --------------------------------------------------------------------
    def set_link(self, i: int, j: int, rate_mbit: float | None = None, delay_ms: float = 0.0,
                 both: bool = True) -> None:
        """Reshape mesh link i->j (and j->i if ``both``). Packets queued on it are dropped."""
        if self.topology != "mesh":
            raise ValueError("set_link is for the mesh topology; use set_uplink/set_downlink")
        self._shape(self.hosts[i], f"l{j}", rate_mbit, delay_ms)
        if both:
            self._shape(self.hosts[j], f"l{i}", rate_mbit, delay_ms)

    def set_uplink(self, i: int, rate_mbit: float | None = None, delay_ms: float = 0.0) -> None:
        """Reshape star host i's uplink (host -> switch)."""
        self._shape(self.hosts[i], IFNAME, rate_mbit, delay_ms)

    def set_downlink(self, i: int, rate_mbit: float | None = None, delay_ms: float = 0.0) -> None:
        """Reshape star host i's downlink (switch -> host)."""
        if self.switch is None:
            raise ValueError("set_downlink is for the star topology; use set_link")
        self._shape(self.switch, f"p{i}", rate_mbit, delay_ms)

    def run(self, i: int, argv: Sequence[Any], **popen_kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside host i; it is killed at close() if still running."""
        p = subprocess.Popen(["ip", "netns", "exec", self.hosts[i], *map(str, argv)], **popen_kwargs)
        self._procs.append(p)
        return p

    def _serve(self, j: int, count: int, timeout: float) -> tuple[subprocess.Popen, int]:
        argv = [sys.executable, PROBE, "serve", self.addr(j), "--count", count, "--timeout", timeout]
        p = self.run(j, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout is not None  # stdout=PIPE
        line = p.stdout.readline()  # bounded: the server exits after `timeout`
        if not line.startswith("ready"):
            raise RuntimeError(f"probe server on host {j} did not start: {_finish(p, timeout)}")
        return p, int(line.split()[1])

    def _probe_pairs(self, pairs: Sequence[tuple[int, int]], args: list[Any], timeout: float) -> list[dict]:
        """Run one probe client per (src, dst) pair concurrently, each with its own server on dst."""
        servers = [self._serve(j, 1, timeout) for _, j in pairs]
        clients = [
            self.run(i, [sys.executable, PROBE, args[0], self.addr(j), port, *args[1:], "--timeout", timeout],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for (i, j), (_, port) in zip(pairs, servers)
        ]
        results = [json.loads(_finish(c, timeout)) for c in clients]
        for s, _ in servers:
            _finish(s, timeout)
        return results

    def throughput_mbit(self, pairs: Sequence[tuple[int, int]], nbytes: int = 2_000_000,
                        timeout: float = 60) -> list[float]:
        """TCP goodput (payload Mbit/s) of concurrent bulk transfers src -> dst, one per pair.

        Goodput is ~95% of a tbf rate: the rate counts Ethernet/IP/TCP headers too.
        """
        results = self._probe_pairs(pairs, ["send", nbytes], timeout)
        return [r["bytes"] * 8 / r["seconds"] / 1e6 for r in results]

    def rtt_ms(self, pairs: Sequence[tuple[int, int]], n: int = 10, timeout: float = 30) -> list[float]:
        """Median TCP ping-pong round trip src <-> dst, one per pair, run concurrently."""
        return [r["rtt_ms"] for r in self._probe_pairs(pairs, ["rtt", "--n", n], timeout)]

    # -- teardown -------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.namespaces:
            _del_netns(ns)

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- CLI ----------------------------------------------------------------------------
def _unit(value: str, units: dict[str, float]) -> float:
    m = re.fullmatch(r"([\d.]+)\s*([a-z]*)", value.strip().lower())
    if not m or m.group(2) not in units:
        raise argparse.ArgumentTypeError(f"cannot parse {value!r} (units: {', '.join(filter(None, units))})")
    return float(m.group(1)) * units[m.group(2)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.wan.testbed", description=(__doc__ or "").split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a testbed and hold it until Ctrl-C / SIGTERM")
    up.add_argument("--hosts", type=int, default=4)
    up.add_argument("--topology", choices=("mesh", "star"), default="mesh")
    mbit = functools.partial(_unit, units={"mbit": 1, "gbit": 1000, "kbit": 1e-3, "": 1})
    ms = functools.partial(_unit, units={"ms": 1, "s": 1000, "us": 1e-3, "": 1})
    up.add_argument("--rate", type=mbit, help="per link (mesh) or per up/downlink (star), e.g. 100mbit")
    up.add_argument("--delay", type=ms, default=0.0, help="one-way delay per link, e.g. 10ms")
    sub.add_parser("down", help="remove testbeds left by dead processes")
    sub.add_parser("check", help="say what this machine can emulate")
    a = p.parse_args(argv)
    if a.cmd == "down":
        print("\n".join(cleanup_stale()) or "nothing to remove")
        return 0
    if a.cmd == "check":
        caps = probe()
        for k in ("netns", "tbf", "netem"):
            print(f"{k:6} {getattr(caps, k) or 'ok'}")
        return 0
    rate, delay = a.rate, a.delay
    if why := probe().missing(rate=rate is not None, delay=bool(delay)):
        print(why, file=sys.stderr)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT too: shells start `&` jobs with it ignored
        signal.signal(sig, lambda *_: sys.exit(0))  # so `with` tears down
    with Testbed(a.hosts, topology=a.topology, rate_mbit=rate, delay_ms=delay) as tb:
        for i, ns in enumerate(tb.hosts):
            print(f"host {i}: {tb.addr(i):12} ip netns exec {ns} <command>")
        shaped = f"rate {f'{rate:g} Mbit/s' if rate else 'unshaped'}, delay {delay:g} ms"
        print(f"{a.topology}, {shaped}; Ctrl-C to tear down", flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
