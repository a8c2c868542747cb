"""Training and greedy-generation speed of the default tiny model on this machine.

Generation is measured side by side with transformers' own ``model.generate``
(greedy, KV cache, same prompts and lengths) as the baseline. Prints the
median of ``--repeats`` runs and the ratio.

    python benchmarks/model_speed.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from intellect.config import DataConfig, ModelConfig, TrainConfig
from intellect.data.arithmetic import heldout_problems, train_stream
from intellect.model.checkpoint import build_model, parameter_count
from intellect.model.generate import generate
from intellect.model.generate import left_pad
from intellect.train import Trainer


def train_tokens_per_s(steps: int, batch: int) -> float:
    model, tok = build_model(ModelConfig())
    trainer = Trainer(model, tok, TrainConfig(batch_size=batch))
    stream = train_stream(DataConfig())
    batches = iter(lambda: [next(stream).text for _ in range(batch)], None)
    trainer.train_steps(3, batches)  # warm-up: allocator, kernels
    t0 = time.perf_counter()
    logs = trainer.train_steps(steps, batches)
    return sum(log["tokens"] for log in logs) / (time.perf_counter() - t0)


def generation_tokens_per_s(prompts: int, new_tokens: int) -> tuple[float, float]:
    """(ours, transformers.generate) generated tokens/s, greedy, no early stop."""
    model, tok = build_model(ModelConfig())
    pad_id = tok.pad_token_id
    assert isinstance(pad_id, int), "the tiny model's tokenizer has a pad token"
    ids = tok([p.prompt for p in heldout_problems(DataConfig(), prompts)])["input_ids"]
    # EOS is made unreachable so both sides generate exactly new_tokens per prompt
    never = -1
    generate(model, ids[:4], max_new_tokens=2, eos_id=never, pad_id=pad_id)
    t0 = time.perf_counter()
    generate(model, ids, max_new_tokens=new_tokens, eos_id=never, pad_id=pad_id)
    ours = prompts * new_tokens / (time.perf_counter() - t0)

    padded, mask = left_pad(ids, pad_id)
    # The ignores: transformers 5 types generate's self as GenerativePreTrainedModel, a Protocol that
    # decoder-only models (no `encoder`) do not match; LlamaForCausalLM.generate is GenerationMixin's.
    with torch.no_grad():
        model.generate(  # pyright: ignore[reportAttributeAccessIssue, reportCallIssue]  # wrong self type in transformers
            input_ids=padded[:4], attention_mask=mask[:4], max_new_tokens=2, do_sample=False,
        )
        t0 = time.perf_counter()
        out = model.generate(  # pyright: ignore[reportAttributeAccessIssue, reportCallIssue]  # wrong self type in transformers
            input_ids=padded, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=pad_id,
        )
        hf = prompts * new_tokens / (time.perf_counter() - t0)
    assert out.shape[1] == padded.shape[1] + new_tokens
    return ours, hf


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    model, _ = build_model(ModelConfig())
    print(f"default model: {parameter_count(model):,} parameters; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    train, ours, hf = [], [], []
    for _ in range(args.repeats):
        train.append(train_tokens_per_s(args.train_steps, args.batch))
        o, h = generation_tokens_per_s(args.prompts, args.new_tokens)
        ours.append(o)
        hf.append(h)
    med = statistics.median
    print(f"training (batch {args.batch}, AdamW, fp32): median {med(train):,.0f} tokens/s "
          f"(runs: {', '.join(f'{x:,.0f}' for x in train)})")
    print(f"greedy generation, {args.prompts} prompts x {args.new_tokens} tokens:")
    print(f"  intellect generate      median {med(ours):,.0f} tokens/s")
    print(f"  transformers .generate  median {med(hf):,.0f} tokens/s")
    print(f"  ratio ours/transformers {med(ours) / med(hf):.2f}x")


if __name__ == "__main__":
    main()
