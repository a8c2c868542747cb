"""The SHARDCAST server on a real socket: shards served exactly under plain h11, and TCP_NODELAY set."""

from __future__ import annotations

import hashlib
import random
import socket

import httpx
import pytest

from intellect.http_server import bind
from intellect.shardcast.server import Server
from intellect.shardcast.store import VersionStore
from intellect.shardcast.writer import publish_folder
from intellect.trust.keys import SigningKey

KEY = SigningKey.from_seed(b"\1" * 32)  # the trainer's


@pytest.mark.parametrize("link", [True, False])
def test_shards_are_served_exactly_without_the_zero_copy_extension(tmp_path, link):
    """Under plain uvicorn h11, which does not offer sendfile, a shard goes out in pieces read on
    worker threads: of its file, or of the linked files it spans."""
    src = tmp_path / "ckpt"
    src.mkdir()
    rnd = random.Random(0)
    files = {"a.json": b"{}", "b.bin": rnd.randbytes(3 << 20), "c.bin": rnd.randbytes(5)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    st = VersionStore(tmp_path / "origin")
    m = publish_folder(st, 1, src, shard_size=(1 << 20) + 3, keep=5, key=KEY, link=link)
    assert (st.version_dir(1) / "files").is_dir() == link
    blob = b"".join(files[f.name] for f in m.files)
    server = Server(st, bind("127.0.0.1", 0), zero_copy=False).start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            got = b""
            for s in m.shards:
                r = http.get(f"/v/1/shard/{s.index}")
                assert r.status_code == 200 and int(r.headers["content-length"]) == s.size
                got += r.content
            assert got == blob and hashlib.sha256(got).hexdigest() == m.sha256
            assert http.get(f"/v/1/shard/{len(m.shards)}").status_code == 404
    finally:
        server.stop()


def test_server_sockets_send_small_answers_at_once():
    """Without TCP_NODELAY each answer sent in two writes (h11: head, then body) waited for the
    client's delayed ACK on a kept-alive connection."""
    listener = bind("127.0.0.1", 0)
    client = socket.create_connection(listener.getsockname()[:2], timeout=5)
    try:
        conn, _ = listener.accept()
        with conn:
            for sock in (listener, conn):  # asyncio sets it only where proto says TCP; Linux inherits it
                assert sock.proto == socket.IPPROTO_TCP and sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        client.close()
        listener.close()
