"""Tiny TCP tools that the testbed runs inside its namespaces (stdlib only, run as a script).

serve ADDR  - accept up to --count connections; the first byte picks echo (E) or sink (S)
send ADDR PORT NBYTES - push NBYTES to a sink; prints the receiver's {"bytes", "seconds"}
rtt ADDR PORT - ping-pong one byte --n times; prints {"rtt_ms": median, "min_ms"}

Every socket has a timeout and the server stops after --count connections or --timeout
seconds, so a broken link fails a test instead of hanging it.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time


def _handle(conn: socket.socket) -> None:
    with conn:
        mode = conn.recv(1)
        if mode == b"E":
            while data := conn.recv(65536):
                conn.sendall(data)
        elif mode == b"S":
            # Time from the first chunk to EOF and leave that chunk out: it may be the
            # token-bucket burst, which arrives at line rate.
            first = conn.recv(1 << 20)
            t0, n = time.monotonic(), 0
            while data := conn.recv(1 << 20):
                n += len(data)
            dt = time.monotonic() - t0
            conn.sendall(json.dumps({"bytes": n, "seconds": dt, "total": n + len(first)}).encode())


def serve(addr: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    srv = socket.create_server((addr, 0))
    print("ready", srv.getsockname()[1], flush=True)
    threads = []
    for _ in range(count):
        srv.settimeout(max(0.1, deadline - time.monotonic()))
        conn, _ = srv.accept()
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        threads.append(threading.Thread(target=_handle, args=(conn,), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def _recv_all(s: socket.socket) -> bytes:
    chunks = []
    while data := s.recv(65536):
        chunks.append(data)
    return b"".join(chunks)


def send(addr: str, port: int, nbytes: int, timeout: float) -> None:
    with socket.create_connection((addr, port), timeout=timeout) as s:
        s.sendall(b"S")
        block = memoryview(bytes(1 << 20))
        left = nbytes
        while left > 0:
            s.sendall(block[: min(left, len(block))])
            left -= len(block)
        s.shutdown(socket.SHUT_WR)
        print(_recv_all(s).decode(), flush=True)


def rtt(addr: str, port: int, n: int, timeout: float) -> None:
    with socket.create_connection((addr, port), timeout=timeout) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"E")
        samples = []
        for _ in range(n):
            t0 = time.monotonic()
            s.sendall(b"x")
            if s.recv(1) != b"x":
                raise RuntimeError("echo server closed the connection")
            samples.append((time.monotonic() - t0) * 1000)
    print(json.dumps({"rtt_ms": statistics.median(samples), "min_ms": min(samples)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("addr")
    s.add_argument("--count", type=int, default=1)
    for name in ("send", "rtt"):
        c = sub.add_parser(name)
        c.add_argument("addr")
        c.add_argument("port", type=int)
        if name == "send":
            c.add_argument("nbytes", type=int)
        else:
            c.add_argument("--n", type=int, default=10)
    for c in sub.choices.values():
        c.add_argument("--timeout", type=float, default=30.0)
    a = p.parse_args()
    if a.cmd == "serve":
        serve(a.addr, a.count, a.timeout)
    elif a.cmd == "send":
        send(a.addr, a.port, a.nbytes, a.timeout)
    else:
        rtt(a.addr, a.port, a.n, a.timeout)


if __name__ == "__main__":
    main()
