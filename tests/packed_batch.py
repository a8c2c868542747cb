"""A batch shaped like ``PackedStream.next_batch`` with document masking, shared by
tests/unit/test_train_precision.py and tests/integration/test_compile.py."""

from __future__ import annotations

import torch


def packed(n: int = 4, length: int = 24, vocab: int = 40, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch shaped like ``PackedStream.next_batch`` with document masking: two documents per row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (n, length), generator=g)
    cut = length // 3
    mask = torch.ones(n, 1, length, length, dtype=torch.bool).tril()
    mask[:, :, cut:, :cut] = False
    pos = torch.cat([torch.arange(cut), torch.arange(length - cut)]).repeat(n, 1)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos, "attention_mask": mask}
