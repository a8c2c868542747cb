"""``GLOO_SOCKET_IFNAME`` decides where a DiLoCo group binds when no address is given, as it does for
``init_process_group``: a worker on a host of several interfaces can name the one its peers reach."""

from __future__ import annotations

import threading

import pytest
import torch

from intellect.diloco import transport
from intellect.diloco.allreduce import all_reduce_mean


def test_a_group_binds_to_the_interface_gloo_socket_ifname_names(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = torch.distributed.HashStore()  # pyright: ignore[reportPrivateImportUsage]
    out: dict[int, torch.Tensor | BaseException] = {}

    def rank(r: int) -> None:
        try:
            g = transport.new_group(store, "ifname", r, 2, timeout=20)
            x = torch.full((4,), float(r))
            all_reduce_mean([x], g)
            out[r] = x
        except BaseException as e:  # noqa: BLE001 - reported below
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(out.get(r), torch.Tensor) for r in (0, 1)), out
    for r in (0, 1):
        torch.testing.assert_close(out[r], torch.full((4,), 0.5), rtol=0, atol=0.01)  # int8 on the wire


def test_an_interface_that_does_not_exist_fails_before_the_rendezvous(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    store = torch.distributed.HashStore()  # pyright: ignore[reportPrivateImportUsage]
    with pytest.raises(RuntimeError, match="nosuch0"):
        transport.new_group(store, "ifname", 0, 2, timeout=20)  # no peer: would wait out the timeout
    # an explicit address wins over the variable
    assert transport.gloo_devices("127.0.0.1", {"GLOO_SOCKET_IFNAME": "nosuch0"})
