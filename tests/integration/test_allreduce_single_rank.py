"""A one-rank gloo group (gloo opens its sockets even for one rank): the all-reduce is exact and honours
the finite mask."""

from __future__ import annotations

import torch

from intellect.diloco import transport
from intellect.diloco.allreduce import all_reduce_mean


def test_single_rank_group_is_exact_and_honours_the_mask():
    # public torch API (torch.distributed's docs); its __init__ re-exports it from torch._C without __all__
    store = torch.distributed.HashStore()  # pyright: ignore[reportPrivateImportUsage]
    g = transport.new_group(store, "solo", 0, 1, timeout=5, hostname="127.0.0.1")
    x = torch.randn(10)
    y = x.clone()
    st = all_reduce_mean([y], g)
    assert torch.equal(x, y) and st.contributors == (0,) and st.bytes_sent == 0
    y[0] = float("inf")
    st = all_reduce_mean([y], g)
    assert not y.any() and st.contributors == ()
