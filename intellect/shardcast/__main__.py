"""``python -m intellect.shardcast origin|relay|client`` (also ``intellect shardcast ...``).

    # the trainer's machine: serve ./sc/origin, optionally publishing a checkpoint folder first
    python -m intellect.shardcast origin --data-dir sc/origin --port 18000 [--publish ckpt/ --version 3 --key-file trainer.key]
    # the trainer, each time a checkpoint is saved (the running origin serves it as shards appear)
    python -m intellect.shardcast publish --data-dir sc/origin --version 4 --src ckpt/step_4 --key-file trainer.key
    # relays, anywhere the origin is reachable, pinning the trainer's public key
    python -m intellect.shardcast relay --data-dir sc/r1 --port 18001 --upstream http://10.0.0.1:18000 --trainer-key <hex>
    # a worker: download version 3 (or the newest complete one) into a folder
    python -m intellect.shardcast client --relay http://10.0.0.2:18001 --relay ... --trainer-key <hex> --version 3 --dest ckpt/step_3

Every version is signed with the trainer's key file (``intellect.trust.keys``, mode 0600); relays
and clients verify each header and shard against the public key they pin before they use it.

Servers listen on 127.0.0.1 unless ``--host`` says otherwise; ``--port 0`` picks a free port and
``--port-file`` receives the base URL once the server listens. SIGTERM or SIGINT stops them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from intellect.shardcast.config import LOOPBACK, ClientConfig, RelayConfig
from intellect.shardcast.store import VersionStore
from intellect.shardcast.writer import publish_folder
from intellect.trust.keys import SigningKey

if TYPE_CHECKING:
    from intellect.shardcast.relay import Relay

# Each role imports only what it runs: ``publish`` is on the critical path of every broadcast (the
# trainer starts it per checkpoint), and the HTTP client stack is dear to import.
MIB = 1 << 20
_COPY_HELP = ("Copy the files into the origin's folder. By default they are hard-linked where the file system "
              "allows (no second copy on disk), and must then not be rewritten in place afterwards.")


def _serve(args, store: VersionStore, relay: Relay | None = None) -> int:
    from intellect.http_server import bind  # noqa: PLC0415 - each role imports only what it runs
    from intellect.shardcast.server import Server, write_port_file  # noqa: PLC0415 - each role imports only what it runs

    server = Server(store, bind(args.host, args.port))
    stop = threading.Event()
    # uvicorn only installs its own signal handlers on the main thread; it runs on a side thread
    # here, so the main thread owns SIGTERM/SIGINT and stops both the server and the relay loop.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.parent:
        threading.Thread(target=_watch_parent, args=(args.parent, stop), daemon=True, name="parent-watch").start()
    server.start()
    sync = None
    if relay is not None:
        sync = threading.Thread(target=relay.run, args=(stop,), daemon=True, name="relay-sync")
        sync.start()
    if args.port_file:
        write_port_file(args.port_file, *server.sock.getsockname()[:2])
    logging.getLogger("intellect.shardcast").info("serving %s on %s", store.root, server.url)
    stop.wait()
    if relay is not None and sync is not None:  # started together above
        sync.join(timeout=10)
        relay.close()
    server.stop()
    return 0


def _watch_parent(parent: int, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        if os.getppid() != parent:  # orphaned: the run that started us is gone
            stop.set()


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", required=True, help="Folder of the versions this server serves.")
    p.add_argument("--host", default=LOOPBACK, help="Listen address (default 127.0.0.1).")
    p.add_argument("--port", type=int, default=0, help="Listen port (0: a free one).")
    p.add_argument("--port-file", help="Write the server's base URL here once it listens.")
    p.add_argument("--keep", type=int, default=5, help="Newest versions kept (default 5).")
    p.add_argument("--parent", type=int, help="Stop when this process (the one that started us) is gone.")


def _key_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--key-file", required=required, help="The trainer's signing key file (mode 0600).")


def _trainer_key_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trainer-key", required=True, help="The trainer's public key (64 hex digits): only versions "
                   "it signed are trusted.")


def main(argv: list[str] | None = None, prog: str = "python -m intellect.shardcast") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="role", required=True)
    o = sub.add_parser("origin", help="serve the versions the trainer publishes")
    _server_args(o)
    o.add_argument("--publish", help="A checkpoint folder (or one file) to publish before serving.")
    o.add_argument("--version", type=int, help="Version number of --publish.")
    o.add_argument("--shard-mib", type=float, default=16, help="Shard size in MiB (default 16).")
    o.add_argument("--copy", action="store_true", help=_COPY_HELP)
    _key_args(o, required=False)
    pub = sub.add_parser("publish", help="write a checkpoint into an origin's folder as a new version")
    pub.add_argument("--data-dir", required=True, help="The origin's folder.")
    pub.add_argument("--version", type=int, required=True)
    pub.add_argument("--src", required=True, help="A checkpoint folder or one file.")
    pub.add_argument("--shard-mib", type=float, default=16, help="Shard size in MiB (default 16).")
    pub.add_argument("--keep", type=int, default=5, help="Newest versions kept (default 5).")
    pub.add_argument("--copy", action="store_true", help=_COPY_HELP)
    _key_args(pub, required=True)
    r = sub.add_parser("relay", help="mirror upstream versions and serve them")
    _server_args(r)
    r.add_argument("--upstream", action="append", required=True, help="Origin or relay base URL (repeatable).")
    _trainer_key_arg(r)
    r.add_argument("--parallel", type=int, default=RelayConfig.model_fields["parallel"].default,
                   help="Shards fetched at once (default %(default)s).")
    r.add_argument("--poll", type=float, default=0.05, help="Seconds between looks upstream (default 0.05).")
    r.add_argument("--min-rate", type=float, default=RelayConfig.model_fields["min_rate"].default,
                   help="Bytes/s under which a shard's download is abandoned and fetched again (default %(default)s).")
    c = sub.add_parser("client", help="download a version from relays")
    c.add_argument("--relay", action="append", required=True, help="Relay base URL (repeatable).")
    _trainer_key_arg(c)
    c.add_argument("--version", type=int, help="Version to fetch (default: the newest complete one).")
    c.add_argument("--dest", required=True, help="Folder to create (atomically, STABLE last).")
    c.add_argument("--parallel", type=int, default=ClientConfig.model_fields["parallel"].default,
                   help="Shards downloaded at once (default %(default)s).")
    c.add_argument("--deadline", type=float, default=600.0, help="Seconds for the whole download.")
    c.add_argument("--list", action="store_true", help="Only print the versions the relays hold.")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per manifest request otherwise

    if args.role == "origin":
        store = VersionStore(args.data_dir)
        store.clean_temp()
        if args.publish:
            if args.version is None or args.key_file is None:
                ap.error("--publish needs --version and --key-file")
            publish_folder(store, args.version, args.publish, int(args.shard_mib * MIB), args.keep,
                           key=SigningKey.load(args.key_file), link=not args.copy)
        return _serve(args, store)
    if args.role == "publish":
        m = publish_folder(VersionStore(args.data_dir), args.version, args.src, int(args.shard_mib * MIB), args.keep,
                           key=SigningKey.load(args.key_file), link=not args.copy)
        print(json.dumps({"version": m.version, "bytes": m.total_size, "shards": len(m.shards), "sha256": m.sha256}))
        return 0
    if args.role == "relay":
        from intellect.shardcast.relay import Relay  # noqa: PLC0415 - each role imports only what it runs

        store = VersionStore(args.data_dir)
        try:
            cfg = RelayConfig(upstreams=args.upstream, trainer_key=args.trainer_key, keep=args.keep,
                              parallel=args.parallel, poll_interval=args.poll, min_rate=args.min_rate)
        except ValueError as e:
            ap.error(f"invalid relay settings: {e}")
        return _serve(args, store, Relay(store, cfg))
    from intellect.shardcast.client import ShardcastClient, ShardcastError  # noqa: PLC0415 - each role imports only what it runs

    try:
        client_cfg = ClientConfig(parallel=args.parallel, deadline=args.deadline, trainer_key=args.trainer_key)
    except ValueError:
        ap.error("--trainer-key: 64 hex digits")
    with ShardcastClient(args.relay, client_cfg) as client:
        if args.list:
            print(json.dumps(client.versions()))
            return 0
        try:
            version = args.version
            if version is None:
                complete = client.complete_versions()
                if not complete:
                    raise ShardcastError(f"no relay of {args.relay} holds a complete version")
                version = complete[-1]
            started = time.time()
            stats = client.fetch(version, args.dest)
        except ShardcastError as e:
            print(f"shardcast client: {e}", file=sys.stderr)
            return 1
        print(json.dumps({**stats.__dict__, "started": started, "finished": time.time()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
