"""Cost of bounded rollout parsing: honest parse time, and the memory a bomb takes before rejection.

Honest: a demo-sized submission (32 prompts x 8 samples, 64 prompt and 8 output tokens, one
258-byte TOPLOC chunk each), parsed ``--repeats`` times; the median is quoted. Bombs: 16 rows of
2 Mi zero tokens (a few KiB on disk, 128 MiB decoded), 16 rows pointing at one 32 MiB
dictionary entry, and 512 DELTA_BYTE_ARRAY proofs that each repeat a 1 MiB prefix (512 MiB
decoded), each parsed in a fresh interpreter that reports its peak RSS (VmHWM) growth.
``--module FILE`` measures another version of ``intellect/rl/wire/rollouts.py`` (e.g. the one before
these bounds: ``git show REV:intellect/rl/wire/rollouts.py > /tmp/old_rollouts.py``).

    .venv/bin/python benchmarks/rollout_parse.py
    .venv/bin/python benchmarks/rollout_parse.py --module /tmp/old_rollouts.py
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from intellect.rl.wire.rollouts import Rollout, RolloutLimits, encode_submission, rows_to_table  # noqa: E402

LIMITS = RolloutLimits(vocab_size=50257)

CHILD = r"""
import importlib.util, json, sys
sys.path.insert(0, sys.argv[1])
spec = importlib.util.spec_from_file_location("rollouts_under_test", sys.argv[2])
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
limits = mod.RolloutLimits.model_validate_json(sys.argv[3])
honest = open(sys.argv[4], "rb").read()
mod.read_submission(honest, limits)
if sys.argv[5] == "time":
    import time
    times = []
    for _ in range(int(sys.argv[6])):
        t = time.perf_counter()
        mod.read_submission(honest, limits)
        times.append(time.perf_counter() - t)
    print(json.dumps({"times": times}))
else:
    data = open(sys.argv[5], "rb").read()
    before = hwm()
    try:
        mod.read_submission(data, limits)
        reason = "accepted"
    except mod.RolloutRejected as e:
        reason = e.reason
    print(json.dumps({"reason": reason, "growth": hwm() - before}))
"""


def demo_rows() -> list[Rollout]:
    rng = np.random.default_rng(0)
    return [
        Rollout(run="demo", step=3, policy_step=3, worker="w0", submission=0, seed=i, prompt_id=f"p{i // 8}",
                group_id=i // 8, prompt_tokens=tuple(int(t) for t in rng.integers(0, 50257, 64)),
                output_tokens=tuple(int(t) for t in rng.integers(0, 50257, 8)), finish_reason="length",
                reward=float(i % 2), task_reward=float(i % 2), length_penalty=0.0, advantage=0.5 - (i % 2),
                target_length=None, proof=rng.bytes(258))
        for i in range(256)
    ]


def _to_bytes(table: pa.Table, **kw) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", **kw)
    return buf.getvalue()


def bombs(rows: list[Rollout]) -> dict[str, bytes]:
    table = rows_to_table(rows[:16])
    i = table.schema.get_field_index("output_tokens")
    n = 2 << 20
    tokens = pa.ListArray.from_arrays(pa.array(np.arange(17, dtype=np.int32) * n, type=pa.int32()),
                                      pa.array(np.zeros(16 * n, "i4")))
    lists = _to_bytes(table.set_column(i, table.schema.field(i), tokens), use_dictionary=False)
    j = table.schema.get_field_index("proof")
    size = 32 << 20
    # ndarray.data: the array's own memory as a memoryview (numpy's stubs give ndarray __buffer__ on 3.12+ only)
    proof = pa.Array.from_buffers(pa.binary(), 16, [None, pa.py_buffer((np.arange(17, dtype=np.int32) * size).data),
                                                     pa.py_buffer(np.zeros(16 * size, np.uint8).data)])
    dictionary = _to_bytes(table.set_column(j, table.schema.field(j), proof))
    many = rows_to_table(rows * 2)  # 512 rows, each proof a 1 MiB prefix of the one before
    proof = pa.Array.from_buffers(pa.binary(), 512, [None, pa.py_buffer((np.arange(513, dtype=np.int32) << 20).data),
                                                      pa.py_buffer(np.zeros(512 << 20, np.uint8).data)])
    delta = _to_bytes(many.set_column(j, many.schema.field(j), proof), use_dictionary=False,
                      column_encoding={"proof": "DELTA_BYTE_ARRAY"})
    return {"long-lists": lists, "dictionary-page": dictionary, "delta-prefixes": delta}


def child(module: str, args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, REPO, module, LIMITS.model_dump_json(), *args],
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--module", default=os.path.join(REPO, "intellect", "rl", "rollouts.py"))
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    rows = demo_rows()
    with tempfile.TemporaryDirectory() as tmp:
        honest = os.path.join(tmp, "honest.parquet")
        data = encode_submission(rows)
        with open(honest, "wb") as f:
            f.write(data)
        got = child(args.module, [honest, "time", str(args.repeats)])
        if "times" in got:
            med = statistics.median(got["times"]) * 1e3
            print(f"honest demo file ({len(data)} bytes, {len(rows)} rows): median parse {med:.2f} ms "
                  f"over {args.repeats} (min {min(got['times']) * 1e3:.2f} ms)")
        else:
            print(f"honest demo file: {got}")
        for name, bomb in bombs(rows).items():
            path = os.path.join(tmp, f"{name}.parquet")
            with open(path, "wb") as f:
                f.write(bomb)
            t = time.perf_counter()
            got = child(args.module, [honest, path])
            wall = time.perf_counter() - t
            if "growth" in got:
                print(f"bomb {name} ({len(bomb)} bytes): {got['reason']}, peak RSS +{got['growth'] / 2**20:.1f} MiB "
                      f"(child wall {wall:.1f} s)")
            else:
                print(f"bomb {name} ({len(bomb)} bytes): {got}")


if __name__ == "__main__":
    main()
