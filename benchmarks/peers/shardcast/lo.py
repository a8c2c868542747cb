"""Runs a shardcast 0.3.2 node on loopback only; used by peer.py, inside benchmarks/peers/shardcast/venv.

    venv/bin/python lo.py origin --data-dir D --port P        # origin, driven over stdin/stdout (below)
    venv/bin/python lo.py shardcast.middle_node ARGS...       # relay: the package's own CLI
    venv/bin/python lo.py shardcast.client_node ARGS...       # client: the package's own CLI

The package's HTTP servers bind 0.0.0.0 (hard-coded in shardcast.server.run_server) and look up the
local IP by connecting a UDP socket towards 10.255.255.255; both are patched here, before any node
starts, so the nodes listen on 127.0.0.1 only and never touch a non-loopback route.

The package's `shardcast-origin` CLI only serves a directory; broadcasting needs the library calls
shardcast.initialize() and shardcast.broadcast() in the serving process. So `origin` initializes,
prints {"ready": true}, then reads one JSON request per stdin line, {"path": ..., "shard_bytes": ...},
broadcasts it and answers {"version": "vN", "broadcast_s": seconds spent in shardcast.broadcast}. It
keeps serving until stdin closes (or it is killed).
"""

import argparse
import importlib
import json
import sys
import time

import shardcast
import shardcast.server


class _LoopbackServer(shardcast.server.ShardcastServer):
    def __init__(self, server_address, *args, **kwargs):
        super().__init__(("127.0.0.1", server_address[1]), *args, **kwargs)


# run_server() resolves both names from the module globals at call time, so rebinding them is enough.
shardcast.server.ShardcastServer = _LoopbackServer
shardcast.server.get_local_ip = lambda: "127.0.0.1"


def origin(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lo.py origin")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-distribution-folders", type=int, default=shardcast.SHARDCAST_MAX_DISTRIBUTION_FOLDERS)
    args = p.parse_args(argv)
    shardcast.initialize(args.data_dir, args.port, args.max_distribution_folders)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t = time.perf_counter()
        version = shardcast.broadcast(req["path"], req["shard_bytes"])
        print(json.dumps({"version": version, "broadcast_s": time.perf_counter() - t}), flush=True)
    shardcast.shutdown()
    return 0


def main() -> int:
    role, argv = sys.argv[1], sys.argv[2:]
    if role == "origin":
        return origin(argv)
    # Any other role is a shardcast module whose main() parses sys.argv itself.
    sys.argv = [role, *argv]
    return importlib.import_module(role).main()


if __name__ == "__main__":
    sys.exit(main())
