"""Loopback run of the reference SHARDCAST package (PyPI shardcast 0.3.2), the peer for our SHARDCAST benchmark.

    benchmarks/peers/shardcast/setup.sh
    benchmarks/peers/shardcast/venv/bin/python benchmarks/peers/shardcast/peer.py \
        --size-mib 1024 --workdir /tmp/scpeer --relays 2 --shard-mib 50 --check-interval 2

One origin, --relays relays (the package's middle nodes) pulling from it and one client downloading from
all relays, each a process on 127.0.0.1 (through lo.py) with a fresh port. Prints one JSON line on stdout;
times are seconds:
  broadcast_s      the origin's shardcast.broadcast() call: hash, write the shards, list the version
  relays_listed_s  broadcast request -> every relay lists the version; the client is started then
  relays_synced_s  broadcast request -> every relay holds every shard
  relay_listed_s, relay_synced_s: the same per relay
  client_s         the client process's wall time: download, reassemble, its own BLAKE3 check
  end_to_end_s     broadcast request -> the client exited 0 with its verified file
ok is true when the client exited 0 and its output's SHA-256 (computed here, not timed) equals the
payload's. Relays list a version before they hold it, so the client's early fetches can 404 and be retried
after the package's 2 s / 15 s back-offs; client_failed_fetches counts them (client_shards_from: the shards
it got from each relay). That is the peer's real behaviour, not a harness artefact. Logs of every process stay in the workdir; the shard data and a
generated payload are deleted at exit unless --keep-data.
"""

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

LO = Path(__file__).resolve().parent / "lo.py"
PROBE_BYTES = 1_000_000  # data1.bin: every downloader GETs it from each of its servers at start-up
POLL_S = 0.02
CHUNK = 64 << 20
TAIL_LINES = 30


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self, what: str) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out waiting for {what}")
        return left


class Node:
    """A shardcast process in its own session (so its process group holds its wget children too), under a
    hard coreutils `timeout` in case this harness dies without cleaning up, logging to WORKDIR/NAME.log."""

    def __init__(self, name: str, args: list[str], workdir: Path, timeout_s: float,
                 control: bool = False, env: dict | None = None):
        self.name, self.log = name, workdir / f"{name}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["timeout", "--kill-after=5", str(math.ceil(timeout_s)), sys.executable, str(LO), *args],
                stdin=subprocess.PIPE if control else subprocess.DEVNULL,
                stdout=subprocess.PIPE if control else log,
                stderr=log,
                bufsize=0,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def reap(self) -> None:
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        # The group may outlive its leader (a relay's wget children), so always finish it off.
        self.signal_group(signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            print(f"{self.name} (pid {self.proc.pid}) survived SIGKILL for 5 s", file=sys.stderr)

    def tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        return "\n".join([f"--- {self.name} ({self.log}) ---", *lines])


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_payload(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for off in range(0, size, CHUNK):
            chunk = os.urandom(min(CHUNK, size - off))
            h.update(chunk)
            f.write(chunk)
    return h.hexdigest()


def read_reply(node: Node, deadline: Deadline, what: str) -> dict:
    fd, buf = node.proc.stdout.fileno(), b""
    while not buf.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], min(deadline.left(what), 1.0))
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"{node.name} exited while we waited for {what}")
            buf += chunk
    return json.loads(buf)


def wait_listening(node: Node, port: int, deadline: Deadline) -> None:
    while True:
        node.check_alive()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=min(deadline.left(node.name), 1.0)):
                return
        except OSError:
            time.sleep(POLL_S)


def lists(data_dir: Path, version: str) -> bool:
    # A relay serves this very file, so reading it from disk is what a GET would return, without queueing
    # behind shard transfers on the relay's single-threaded server. It is replaced by rename, never partial.
    try:
        text = (data_dir / "distribution.txt").read_text()
    except FileNotFoundError:
        return False
    return any(line.split(":", 1)[0].strip() == version for line in text.splitlines())


def holds(data_dir: Path, version: str, shards: int) -> bool:
    # Shards are downloaded to shard_NNNNN.tmp and renamed, so a .bin is always complete.
    return all((data_dir / version / f"shard_{i:05d}.bin").exists() for i in range(1, shards + 1))


def client_fetches(log: Path, relay_urls: list[str]) -> tuple[int, list[int]]:
    """Failed shard fetches (404s while relays catch up) and successful ones per relay, from the DEBUG log."""
    text = log.read_text(errors="replace")
    failed = len(re.findall(r"Failed to download v\d+/shard_\d+\.bin from http://", text))
    got = re.findall(r"Downloaded v\d+/shard_\d+\.bin from (http://[\d.]+:\d+) ", text)
    return failed, [got.count(url) for url in relay_urls]


def run(args: argparse.Namespace, result: dict, nodes: list[Node], data: list[Path]) -> None:
    # The package shells out to `which wget` with an empty environment and, if that fails, tries apt-get.
    if subprocess.run(["which", "wget"], env={}, capture_output=True).returncode != 0:
        raise RuntimeError("wget is not on the default PATH; shardcast would try to apt-get install it")
    deadline = Deadline(args.timeout_s)
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    origin_dir, client_dir = work / "origin", work / "client"
    relay_dirs = [work / f"relay{i}" for i in range(1, args.relays + 1)]
    data += [origin_dir, *relay_dirs, client_dir]
    for d in data:  # leftover versions would be re-broadcast as vN+1 and mirrored again
        shutil.rmtree(d, ignore_errors=True)
    for log in [*work.glob("relay*.log"), work / "origin.log", work / "client.log"]:
        log.unlink(missing_ok=True)
    for d in [origin_dir, *relay_dirs]:
        d.mkdir()
        (d / "data1.bin").write_bytes(os.urandom(PROBE_BYTES))

    if args.payload:
        payload = args.payload.resolve()
        digest = sha256_file(payload)
    else:
        payload = work / "payload.bin"
        data.append(payload)
        digest = write_payload(payload, args.size_mib << 20)
    size = payload.stat().st_size
    shard_bytes = int(args.shard_mib * (1 << 20))
    shards = math.ceil(size / shard_bytes)
    result.update(bytes=size, shard_bytes=shard_bytes, shards=shards, relays=args.relays,
                  check_interval_s=args.check_interval)

    origin_port, *relay_ports = free_ports(1 + args.relays)
    relay_urls = [f"http://127.0.0.1:{p}" for p in relay_ports]
    origin = Node("origin", ["origin", "--data-dir", str(origin_dir), "--port", str(origin_port)], work, args.timeout_s,
                  control=True)
    nodes.append(origin)
    read_reply(origin, deadline, "the origin to start")
    relays = []
    for i, (d, port) in enumerate(zip(relay_dirs, relay_ports), 1):
        relay = Node(f"relay{i}", ["shardcast.middle_node", "--upstream", f"http://127.0.0.1:{origin_port}",
                                   "--data-dir", str(d), "--port", str(port), "--check-interval", str(args.check_interval)],
                     work, args.timeout_s)
        nodes.append(relay)
        relays.append(relay)
        # Every downloader probes data1.bin via the fixed path /tmp/dummy.bin, so two starting at once can
        # crash each other; a relay only listens once its probe is done, so wait for that before the next.
        wait_listening(relay, port, deadline)

    t0 = time.monotonic()
    origin.proc.stdin.write((json.dumps({"path": str(payload), "shard_bytes": shard_bytes}) + "\n").encode())
    reply = read_reply(origin, deadline, "the broadcast")
    version = reply["version"]
    result.update(version=version, broadcast_s=round(reply["broadcast_s"], 3))

    output = client_dir / "out.bin"
    # DEBUG logs each shard fetch (for client_fetches). It needs both knobs: --log-level sets the logger's
    # level (INFO by default), the environment its handler's, which the package fixes at import.
    client_args = ["shardcast.client_node", "--servers", ",".join(relay_urls), "--output-dir", str(client_dir),
                   "--version", version, "--output-file", str(output), "--log-level", "DEBUG"]
    client = t_client = t_done = None
    listed: list[float | None] = [None] * args.relays
    synced: list[float | None] = [None] * args.relays
    # One loop watches every relay's listing and holding (each is timed on its own) and the client.
    while t_done is None or None in synced:
        deadline.left("the client and the relays")
        for n in [origin, *relays]:
            n.check_alive()
        now = time.monotonic()
        for i, d in enumerate(relay_dirs):
            if listed[i] is None and lists(d, version):
                listed[i] = round(now - t0, 3)
            if listed[i] is not None and synced[i] is None and holds(d, version, shards):
                synced[i] = round(now - t0, 3)
        if client is None and None not in listed:
            t_client = now
            client = Node("client", client_args, work, args.timeout_s, env={"SHARDCAST_LOG_LEVEL": "DEBUG"})
            nodes.append(client)
        elif client is not None and t_done is None and client.proc.poll() is not None:
            t_done = now
            if client.proc.returncode != 0:
                raise RuntimeError(f"client exited with {client.proc.returncode}")
        time.sleep(POLL_S)
    failed, per_relay = client_fetches(client.log, relay_urls)
    result.update(
        end_to_end_s=round(t_done - t0, 3),
        relays_listed_s=max(listed),
        relay_listed_s=listed,
        relays_synced_s=max(synced),
        relay_synced_s=synced,
        client_s=round(t_done - t_client, 3),
        client_failed_fetches=failed,
        client_shards_from=per_relay,
        ok=sha256_file(output) == digest,
    )
    if not result["ok"]:
        result["error"] = "client output differs from the payload"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=200, help="random payload size (ignored with --payload)")
    p.add_argument("--payload", type=Path, help="broadcast this file instead of a random one")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--relays", type=int, default=2)
    p.add_argument("--shard-mib", type=float, default=50.0)
    p.add_argument("--check-interval", type=int, default=2, help="relays' upstream poll period, s (package: 30)")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="deadline for the whole run, and each process's hard timeout")
    p.add_argument("--keep-data", action="store_true",
                   help="keep the shard folders, the client output and a generated payload")
    args = p.parse_args()
    # Turn SIGTERM into SystemExit so the finally below still stops the nodes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    result: dict = {"peer": f"shardcast {importlib.metadata.version('shardcast')}", "ok": False}
    nodes: list[Node] = []
    data: list[Path] = []
    try:
        run(args, result, nodes, data)
    except Exception as e:  # noqa: BLE001 - any failure goes into the result line the benchmark reads
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        for n in nodes:
            n.signal_group(signal.SIGTERM)
        for n in nodes:
            n.reap()
        if not result["ok"]:
            for n in nodes:
                print(n.tail(), file=sys.stderr)
        if not args.keep_data:
            for d in data:
                if d.is_dir():
                    shutil.rmtree(d, ignore_errors=True)
                else:
                    d.unlink(missing_ok=True)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
