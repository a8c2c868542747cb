"""Runs TRL's own GRPOTrainer._compute_loss on saved inputs; saves the loss and its gradients.

Runs inside benchmarks/peers/trl/venv (see setup.sh) so the project venv never
imports TRL. Usage: venv/bin/python trl_loss.py IN.pt OUT.pt

IN.pt holds shared tensors and a list of cases. Each case names TRL GRPOConfig
overrides and a ``level``:

- ``logits``: end to end. A real GRPOTrainer is built around a 1-layer Llama whose
  backbone's forward is swapped for one returning the given "hidden states" and whose
  LM head is the identity, so hidden states == logits. TRL's fused LM head
  (temperature, log-softmax, entropy, its hand-written backward) and then
  ``_compute_loss`` run unchanged; the gradient is taken w.r.t. the logits.
- ``logps``: the loss core alone, in float64. ``_get_per_token_logps_and_entropies``
  is replaced to return the given log-probs, so everything from the ratio on is
  TRL's code; the gradient is taken w.r.t. the log-probs.

Also saves TRL's group advantage scaling of ``rewards`` for comparison.
"""

import os
import sys
import tempfile
import types
import warnings

import torch

warnings.filterwarnings("ignore")  # TRL's and transformers' warnings too, from their import on
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # before transformers is imported

import trl  # noqa: E402 - after the filter above
from datasets import Dataset  # noqa: E402 - after the filter above
from tokenizers import Tokenizer  # noqa: E402 - after the filter above
from tokenizers.models import WordLevel  # noqa: E402 - after the filter above
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402 - after the filter above
from trl import GRPOConfig, GRPOTrainer  # noqa: E402 - after the filter above
from trl.trainer.utils import nanstd  # noqa: E402 - after the filter above


def tiny_trainer(vocab: int, overrides: dict, tmp: str):
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")),
        pad_token="t0", eos_token="t1",
    )
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=vocab, intermediate_size=2 * vocab, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.eye(vocab))
    # Saved and passed by path: with beta != 0 TRL loads its reference model from the policy's path.
    path = f"{tmp}/tiny"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    args = GRPOConfig(
        output_dir=tmp, report_to="none", use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=overrides.pop("batch"), num_generations=2,
        gradient_accumulation_steps=1, logging_steps=1, save_strategy="no",
        model_init_kwargs={"dtype": torch.float32}, **overrides,
    )
    trainer = GRPOTrainer(
        model=path, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": ["t2 t3"] * 8}), processing_class=tok,
    )
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop, which we do not run
    trainer.model.train()
    return trainer


def run_case(data: dict, case: dict, tmp: str) -> dict:
    overrides = dict(case["trl"])
    level = case["level"]
    trainer = tiny_trainer(data["logits"].shape[-1], {**overrides, "batch": len(data["mask"])}, tmp)
    inputs = {
        "prompt_ids": data["prompt_ids"], "prompt_mask": torch.ones_like(data["prompt_ids"]),
        "completion_ids": data["completion_ids"], "completion_mask": data["mask"].long(),
        "advantages": data["advantages"],
        "num_items_in_batch": torch.tensor(float(case.get("num_items_in_batch", data["mask"].sum()))),
    }
    if level == "logits":
        leaf = data["logits"].float().clone().requires_grad_()
        # The backbone object stays (get_output_embeddings looks through it); only its forward is replaced.
        trainer.model.model.forward = lambda *a, **k: types.SimpleNamespace(last_hidden_state=leaf)
        inputs["old_per_token_logps"] = data["old_logp"].float()
        inputs["ref_per_token_logps"] = data["ref_logp"].float()
    else:
        leaf = data["logp_new"].double().clone().requires_grad_()
        entropy = data["entropy"].double().clone().requires_grad_()
        trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, entropy, None)
        inputs["old_per_token_logps"] = data["logp_old"].double()
        inputs["ref_per_token_logps"] = data["ref_logp_core"].double()
        inputs["advantages"] = inputs["advantages"].double()
    loss = trainer._compute_loss(trainer.model, inputs)
    (grad,) = torch.autograd.grad(loss, leaf)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    return {"loss": loss.detach(), "grad": grad, "metrics": metrics}


def main() -> None:
    data = torch.load(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_case(data, case, tmp) for case in data["cases"]]
    # GRPOTrainer._generate_and_score_completions inlines its group scaling (scale_rewards="group");
    # these are its expressions, with its own nanstd.
    r = data["rewards"]
    advantages = (r - torch.nanmean(r, dim=1, keepdim=True)) / (nanstd(r, dim=1, keepdim=True) + 1e-4)
    torch.save({"trl_version": trl.__version__, "results": results, "advantages": advantages}, sys.argv[2])


if __name__ == "__main__":
    main()
