"""Tokenize-and-pack throughput and memory of the text loader, against the model's training speed.

Three measurements in one run, on the default text model of ``configs/pretrain-text.toml`` (its
tokenizer, sequence length, batch size and precision):

1. **training tokens/s** of that model on this machine (median over steps after a warm-up): the rate
   the loader has to beat, by 10x, so that data never limits training;
2. **loader tokens/s** of :class:`~intellect.data.text.PackedStream` on a sample of the generated
   corpus, side by side with the baseline most loaders start as: tokenizing one document per call
   and packing in Python (medians of ``--repeats`` runs, and their ratio);
3. **one streaming pass over the whole generated corpus** (``--gb``, JSONL shards) in a child process,
   so that its peak resident memory (``ru_maxrss``) is the loader's alone: the total, and the rise
   over the same process after its imports and the tokenizer load.

    python benchmarks/loader_speed.py --gb 1.0 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from intellect.config import SmokeConfig, load_config
from intellect.data.corpus import stdlib_files
from intellect.data.text import PackedStream, eos_id
from intellect.device import prepare_model, resolve_device
from intellect.model.bpe import ensure_tokenizer
from intellect.model.checkpoint import build_model
from intellect.model.tokenizer import load_tokenizer
from intellect.train import Trainer

CONFIG = "configs/pretrain-text.toml"
SHARD_BYTES = 64 << 20


def rss_mb() -> float:
    """This process's peak resident memory. Linux's VmHWM, because ``ru_maxrss`` survives ``execve``:
    a child started by a large parent would report the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux, bytes on macOS


def load_cfg():
    return load_config(SmokeConfig, CONFIG)


def tokenizer_for(cfg):
    ensure_tokenizer(cfg.model.tokenizer, cfg.data, cfg.model.tokenizer_vocab)
    return load_tokenizer(cfg.model.tokenizer)


def make_corpus(folder: Path, total_bytes: int) -> int:
    """JSONL shards of the standard library's source, each copy of a file made distinct, up to
    ``total_bytes`` of text. Returns the bytes written."""
    sources = []
    for ref in stdlib_files():
        try:
            sources.append(Path(ref.location).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    folder.mkdir(parents=True, exist_ok=True)
    written, shard, copy = 0, 0, 0
    while written < total_bytes:
        with open(folder / f"shard-{shard:05d}.jsonl", "w", encoding="utf-8") as f:
            size = 0
            while size < SHARD_BYTES and written + size < total_bytes:
                for text in sources:
                    line = json.dumps({"text": f"# copy {copy}\n{text}"}) + "\n"
                    f.write(line)
                    size += len(line)
                    if size >= SHARD_BYTES or written + size >= total_bytes:
                        break
                copy += 1
        written += size
        shard += 1
    return written


def text_cfg(cfg, files: list[str]):
    return cfg.data.model_copy(update={"text": cfg.data.text.model_copy(update={"files": files})})


def train_tokens_per_s(cfg, tokenizer, steps: int) -> float:

    model, _ = build_model(cfg.model)
    model = prepare_model(model, cfg.compute, resolve_device(cfg.compute.device))
    trainer = Trainer(model, tokenizer, cfg.train, cfg.compute)
    stream = PackedStream(cfg.data, tokenizer)
    rates = []
    for i in range(steps):
        log = trainer.train_step(stream.next_batch(cfg.train.batch_size))
        if i >= 2:
            rates.append(log["tokens"] / log["seconds"])
    return statistics.median(rates)


def ours_tokens_per_s(cfg, tokenizer, files: list[str], tokens: int) -> float:
    stream = PackedStream(text_cfg(cfg, files), tokenizer)
    n = cfg.train.batch_size
    got, t0 = 0, time.perf_counter()
    while got < tokens:
        got += stream.next_batch(n)["input_ids"].numel()
    return got / (time.perf_counter() - t0)


def baseline_tokens_per_s(cfg, tokenizer, files: list[str], tokens: int) -> float:
    """One ``tokenizer(text)`` call per document, EOS appended, packed into seq_len rows in Python."""
    seq_len, n, eos = cfg.data.text.seq_len, cfg.train.batch_size, eos_id(tokenizer)
    buffer: list[int] = []
    got, t0 = 0, time.perf_counter()
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                buffer.extend(tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"])
                buffer.append(eos)
                while len(buffer) >= n * seq_len:
                    torch.tensor(buffer[: n * seq_len]).view(n, seq_len)
                    del buffer[: n * seq_len]
                    got += n * seq_len
                if got >= tokens:
                    return got / (time.perf_counter() - t0)
    return got / (time.perf_counter() - t0)


def child_pass(folder: str) -> None:
    """Stream the whole corpus once; print one JSON line with tokens, seconds and memory."""
    cfg = load_cfg()
    tokenizer = tokenizer_for(cfg)
    stream = PackedStream(text_cfg(cfg, [folder]), tokenizer, epochs=1)
    start_mb = rss_mb()
    n, got, t0 = cfg.train.batch_size, 0, time.perf_counter()
    try:
        while True:
            got += stream.next_batch(n)["input_ids"].numel()
    except EOFError:
        pass
    seconds = time.perf_counter() - t0
    print(json.dumps({"tokens": got, "seconds": seconds, "peak_mb": rss_mb(), "start_mb": start_mb,
                      "documents": stream.stats.get("documents", 0)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0, help="size of the generated corpus streamed once")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sample-tokens", type=int, default=400_000, help="tokens per throughput run")
    ap.add_argument("--train-steps", type=int, default=12)
    ap.add_argument("--dir", default=None, help="where to write the corpus (default: a temporary folder)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_pass(args.child)

    cfg = load_cfg()
    tokenizer = tokenizer_for(cfg)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp) / "corpus"
        t0 = time.perf_counter()
        written = make_corpus(folder, int(args.gb * 1e9))
        print(f"corpus: {written / 1e9:.2f} GB of JSONL in {len(list(folder.iterdir()))} shards "
              f"({time.perf_counter() - t0:.0f} s to write)")
        first = [str(sorted(folder.iterdir())[0])]

        train = train_tokens_per_s(cfg, tokenizer, args.train_steps)
        print(f"training ({cfg.model.preset}, {cfg.compute.precision}, batch {cfg.train.batch_size} x "
              f"{cfg.data.text.seq_len}): {train:,.0f} tokens/s")
        ours, base = [], []
        for _ in range(args.repeats):
            ours.append(ours_tokens_per_s(cfg, tokenizer, first, args.sample_tokens))
            base.append(baseline_tokens_per_s(cfg, tokenizer, first, args.sample_tokens))
        o, b = statistics.median(ours), statistics.median(base)
        print(f"loader, median of {args.repeats}: PackedStream {o:,.0f} tokens/s, per-document baseline "
              f"{b:,.0f} tokens/s, ratio {o / b:.2f}x; PackedStream / training {o / train:.1f}x")

        out = subprocess.run([sys.executable, __file__, "--child", str(folder)], check=True,
                             capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        rate = r["tokens"] / r["seconds"]
        print(f"one pass over {written / 1e9:.2f} GB: {r['tokens']:,} tokens in {r['seconds']:.0f} s "
              f"({rate:,.0f} tokens/s, {written / r['seconds'] / 1e6:.1f} MB/s, {rate / train:.1f}x training); "
              f"peak RSS {r['peak_mb']:.0f} MB, {r['peak_mb'] - r['start_mb']:.0f} MB over the process "
              f"after imports and tokenizer ({r['start_mb']:.0f} MB)")


if __name__ == "__main__":
    main()
