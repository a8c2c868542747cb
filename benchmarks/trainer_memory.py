"""Peak memory of the GRPO trainer's log-prob + loss + backward on a long completion: the full-logits
path (the trainer before packing: ``model(...).logits``, float32 ``[tokens x vocab]``, then
``token_logprobs`` and ``grpo_loss``) against the packed, chunked one (``GRPOTrainer._accumulate``).

The model is Qwen2.5-0.5B-shaped (``Qwen2Config``: vocab 151,936, hidden 896, 24 layers, 14 heads,
2 KV heads, MLP 4,864, tied embeddings), randomly initialized, float32 on the CPU. One sample: a
``--prompt``-token prompt and a ``--completion``-token completion (default 32 + 2,048), advantage 1,
the trainer's default loss (constant normalization, no KL, no entropy bonus) at temperature 1.

Two parts, each old vs new:

- ``head``: the log-prob and loss computation proper: from the final hidden states (a leaf tensor
  ``[tokens, 896]``) through the LM head to the loss, and its backward to the hidden states and the
  head's weight. This is what the two paths do differently.
- ``pipeline``: the whole micro-batch, from token ids through the transformer and back to every
  parameter's gradient, with activation checkpointing in both arms (``--no-checkpointing``: without),
  so that the transformer's own activations (the same in both) do not drown the logits.

How memory is measured: every measurement runs in a fresh subprocess, which builds the model and the
inputs, then resets the kernel's resident-set high-water mark (``/proc/self/clear_refs``, ``5``) and
reads ``VmRSS``; after the computation (gradients still held) it reads ``VmHWM``. The figure is
``VmHWM - VmRSS before``: the peak resident memory the computation added on top of the loaded model
and inputs, gradients included (the head's weight gradient in ``head``, every parameter's in
``pipeline``). Large CPU tensors are their own ``mmap`` allocations, returned to the kernel when
freed, so the high-water mark follows the tensors alive at once. Linux only.

Also checks that the packed path gives the padded full-logits loss and gradients on this model:
``--check-samples`` short samples, every normalization, rows of several samples.

    .venv/bin/python benchmarks/trainer_memory.py                # 24 layers: several minutes on 2 cores
    .venv/bin/python benchmarks/trainer_memory.py --layers 2     # quick

Writes ``benchmarks/results/trainer_memory.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.proc_memory import reset_peak, status_kb  # noqa: E402
from intellect.rl.trainer.logprobs import DEFAULT_CHUNK_TOKENS, chunked_token_logprobs, split_causal_lm  # noqa: E402
from intellect.rl.trainer.loss import GRPOLossConfig, grpo_loss, token_logprobs  # noqa: E402
from intellect.rl.trainer.packing import output_mask, pack, unpack  # noqa: E402
from intellect.rl.trainer.grpo import GRPOTrainer, RLTrainerConfig, Sample  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
VOCAB, HIDDEN = 151_936, 896


def qwen_half_b(layers: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True,
                         max_position_embeddings=32768)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float().train()


def _sample(prompt: int, completion: int, seed: int = 0) -> Sample:
    g = torch.Generator().manual_seed(seed)
    return Sample(torch.randint(0, VOCAB, (prompt,), generator=g).tolist(),
                  torch.randint(0, VOCAB, (completion,), generator=g).tolist(), 1.0)


def _old_loss(logits: torch.Tensor, ids: torch.Tensor, s: Sample, cfg: GRPOLossConfig, temperature: float):
    """The trainer's loss before packing: ``[1, L - 1]`` full logits, then token_logprobs and grpo_loss."""
    mask = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    mask[0, len(s.prompt_tokens) - 1:] = True
    logp, entropy = token_logprobs(logits, ids[:, 1:], temperature, entropy_grad=cfg.entropy_coef > 0)
    loss, _ = grpo_loss(logp, logp.detach(), torch.ones(1, dtype=logp.dtype), mask, cfg, entropy=entropy,
                        max_len=len(s.output_tokens))
    return loss


def measure(args) -> dict:
    """One measurement (this process is a fresh subprocess)."""
    torch.set_num_threads(args.threads)
    model = qwen_half_b(args.layers)
    s = _sample(args.prompt, args.completion)
    cfg = GRPOLossConfig()
    ids = torch.tensor([list(s.prompt_tokens) + list(s.output_tokens)])
    head = split_causal_lm(model)[1]
    if args.part == "pipeline" and args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer = mini = hidden = None
    if args.part == "pipeline" and args.measure == "new":
        trainer = GRPOTrainer(model, None, RLTrainerConfig(micro_batch_tokens=args.prompt + args.completion,
                                                             logit_chunk_tokens=args.chunk_tokens, loss=cfg))
        mini = trainer._micro_batches([s])
    if args.part == "head":
        g = torch.Generator().manual_seed(1)
        hidden = torch.randn(ids.shape[1], HIDDEN, generator=g).requires_grad_()  # RMSNorm-scaled states
    before_kb = reset_peak()
    t0 = time.perf_counter()
    if args.part == "pipeline" and args.measure == "old":
        loss = _old_loss(model(input_ids=ids).logits[:, :-1], ids, s, cfg, 1.0)
        loss.backward()
        value = loss.item()
    elif args.part == "pipeline":
        assert trainer is not None and mini is not None
        value = trainer._accumulate(mini)["loss"]
    elif args.measure == "old":
        assert hidden is not None
        loss = _old_loss(head(hidden[None, :-1]), ids, s, cfg, 1.0)
        loss.backward()
        value = loss.item()
    else:
        assert hidden is not None
        row = pack([s], len(ids[0]))[0]
        logp, _ = chunked_token_logprobs(head, hidden[row.predict], row.targets, 1.0, chunk_tokens=args.chunk_tokens)
        loss, _ = grpo_loss(unpack(logp, row), unpack(logp.detach(), row), torch.ones(1), output_mask(row), cfg,
                            max_len=len(s.output_tokens))
        loss.backward()
        value = loss.item()
    seconds = time.perf_counter() - t0
    peak_kb = status_kb("VmHWM")
    return {"part": args.part, "measure": args.measure, "peak_mb": (peak_kb - before_kb) / 1024,
            "seconds": seconds, "loss": value}


def check_equality(args) -> dict:
    """Loss and gradients of the packed trainer vs the padded full-logits batch, every normalization."""
    torch.set_num_threads(args.threads)
    base = qwen_half_b(args.layers)
    samples = [_sample(8, 16 + 8 * i, seed=10 + i) for i in range(args.check_samples)]
    samples = [Sample(s.prompt_tokens, s.output_tokens, 1.0 - 0.6 * i) for i, s in enumerate(samples)]
    out = {}
    for norm in ("constant", "token", "sequence"):
        cfg = GRPOLossConfig(normalization=norm, entropy_coef=0.01)
        ref = copy.deepcopy(base)
        seqs = [list(s.prompt_tokens) + list(s.output_tokens) for s in samples]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width - 1, dtype=torch.bool)
        for i, (s, q) in enumerate(zip(samples, seqs)):
            ids[i, : len(q)] = torch.tensor(q)
            mask[i, len(s.prompt_tokens) - 1 : len(q) - 1] = True
        logp, ent = token_logprobs(ref(input_ids=ids).logits[:, :-1], ids[:, 1:], entropy_grad=True)
        adv = torch.tensor([s.advantage for s in samples])
        loss, _ = grpo_loss(logp, logp.detach(), adv, mask, cfg, entropy=ent,
                            max_len=max(len(s.output_tokens) for s in samples), token_count=int(mask.sum()))
        loss.backward()
        # rows of about two samples each, so packing is exercised; small chunks, so chunking is too
        budget = 2 * max(map(len, seqs))
        t = GRPOTrainer(copy.deepcopy(base), None, RLTrainerConfig(micro_batch_tokens=budget, logit_chunk_tokens=16,
                                                                     loss=cfg))
        mini = t._micro_batches(samples)
        t._prepare([mini])
        got = t._accumulate(mini)["loss"]
        grad_diff = grad_max = 0.0
        for p, q in zip(t.model.parameters(), ref.parameters()):
            assert p.grad is not None and q.grad is not None
            grad_diff = max(grad_diff, (p.grad - q.grad).abs().max().item())
            grad_max = max(grad_max, q.grad.abs().max().item())
        out[norm] = {"loss_padded": loss.item(), "loss_packed": got, "loss_diff": abs(got - loss.item()),
                     "max_grad_diff": grad_diff, "max_grad": grad_max, "rows": len(mini)}
    return out


def _run(args, **kw) -> dict:
    cmd = [sys.executable, __file__, "--layers", str(args.layers), "--prompt", str(args.prompt),
           "--completion", str(args.completion), "--chunk-tokens", str(args.chunk_tokens),
           "--threads", str(args.threads), "--check-samples", str(args.check_samples)]
    if not args.checkpointing:
        cmd.append("--no-checkpointing")
    for k, v in kw.items():
        cmd += [f"--{k}", v]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--completion", type=int, default=2048)
    ap.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, help="logit_chunk_tokens of the new path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                    help="pipeline part without activation checkpointing")
    ap.add_argument("--check-samples", type=int, default=4)
    ap.add_argument("--parts", default="head,pipeline")
    ap.add_argument("--measure", choices=["old", "new", "equality"], help=argparse.SUPPRESS)
    ap.add_argument("--part", choices=["head", "pipeline"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure == "equality":
        print(json.dumps(check_equality(args)))
        return
    if args.measure:
        print(json.dumps(measure(args)))
        return

    rows = []
    for part in args.parts.split(","):
        old, new = (_run(args, measure=m, part=part) for m in ("old", "new"))
        rows.append({"part": part, "old": old, "new": new, "ratio": new["peak_mb"] / old["peak_mb"]})
    print(f"Qwen2.5-0.5B-shaped, {args.layers} layers, fp32 CPU, prompt {args.prompt} + completion "
          f"{args.completion}, chunk {args.chunk_tokens}, checkpointing {args.checkpointing}")
    print("| part | old: full logits (MB) | new: packed, chunked (MB) | new / old | old s | new s | |loss diff| |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['part']} | {r['old']['peak_mb']:.0f} | {r['new']['peak_mb']:.0f} | {r['ratio']:.3f} | "
              f"{r['old']['seconds']:.1f} | {r['new']['seconds']:.1f} | {abs(r['old']['loss'] - r['new']['loss']):.2e} |")
    eq = _run(args, measure="equality")
    print("\nPacked vs padded on this model "
          f"({args.check_samples} samples, prompts 8, completions 16 + 8i, entropy_coef 0.01):")
    print("| normalization | rows | loss padded | loss packed | |loss diff| | max |grad diff| | max |grad| |")
    print("|---|---|---|---|---|---|---|")
    for norm, e in eq.items():
        print(f"| {norm} | {e['rows']} | {e['loss_padded']:.8f} | {e['loss_packed']:.8f} | {e['loss_diff']:.2e} | "
              f"{e['max_grad_diff']:.2e} | {e['max_grad']:.2e} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "trainer_memory.json").write_text(json.dumps({"args": vars(args), "memory": rows, "equality": eq},
                                                            indent=1))


if __name__ == "__main__":
    main()
