"""The HTTP face of an origin or relay: an ASGI app over a :class:`VersionStore`, served by uvicorn.

Routes (all GET; anything else is 404/405, and a path can only name a version and a shard by
integer, so no request reaches a file outside the store)::

    /health                       {"ok": true}
    /versions                     {"versions": [{"version": 3, "complete": true, "shards": 4}, ...]}
    /v/{version}/manifest         the manifest as this server holds it (only shards it can send)
    /v/{version}/shard/{index}    the shard's bytes, streamed from disk in 1 MiB chunks

Many requests are served at once (one asyncio loop, file reads on worker threads).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from intellect.shardcast.store import MANIFEST, VersionStore

log = logging.getLogger("intellect.shardcast.server")


class _ShardResponse(FileResponse):
    # Starlette reads 64 KiB at a time, each read a thread hop; 1 MiB moves a shard with 16x fewer.
    chunk_size = 1 << 20


def create_app(store: VersionStore) -> Starlette:
    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def versions(request: Request) -> Response:
        out = []
        for v in store.versions():
            m = store.manifest(v)
            if m is not None:  # deleted between listing and reading
                out.append({"version": v, "complete": m.complete, "shards": len(m.shards)})
        return JSONResponse({"versions": out})

    async def manifest(request: Request) -> Response:
        try:
            path = store.version_dir(request.path_params["version"]) / MANIFEST
            return Response(path.read_bytes(), media_type="application/json")
        except (ValueError, FileNotFoundError):
            return JSONResponse({"error": "no such version"}, status_code=404)

    async def shard(request: Request) -> Response:
        try:
            path = store.shard_path(request.path_params["version"], request.path_params["index"])
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=404)
        if not path.is_file():
            return JSONResponse({"error": "shard not held"}, status_code=404)
        return _ShardResponse(path, media_type="application/octet-stream")

    return Starlette(routes=[
        Route("/health", health),
        Route("/versions", versions),
        Route("/v/{version:int}/manifest", manifest),
        Route("/v/{version:int}/shard/{index:int}", shard),
    ])


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one), bound before uvicorn starts so the port is known."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def write_port_file(path: str | os.PathLike, host: str, port: int) -> None:
    p = Path(path)
    tmp = p.with_name(f".tmp-{p.name}")
    tmp.write_text(f"http://{host}:{port}\n")
    os.replace(tmp, p)


class Server:
    """uvicorn serving ``store`` on ``sock``, in this thread (:meth:`run`) or a daemon thread (:meth:`start`)."""

    def __init__(self, store: VersionStore, sock: socket.socket):
        self.sock = sock
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(create_app(store), log_level="warning", access_log=False,
                                timeout_keep_alive=30, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        self._server.run(sockets=[self.sock])

    def start(self) -> "Server":
        self._thread = threading.Thread(target=self.run, daemon=True, name=f"shardcast-{self.url}")
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.sock.close()
