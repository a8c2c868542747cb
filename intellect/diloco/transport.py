"""Process groups on a shared TCPStore and counted point-to-point messages.

Groups are built directly on a store (no ``init_process_group``, no global
state): ``new_group(store, prefix, rank, size)`` wraps ``store`` in a
``PrefixStore(prefix)``, so elastic membership can rebuild a group for each new
membership under a fresh prefix (``"mesh_7/"``) on the same store, and the
ElasticDeviceMesh layout of W workers x M local ranks is M independent groups
on ONE store, ``shard_group(..., local_rank=m)`` = prefix ``".../shard{m}"``:
shard m only ever talks to shard m of the other workers.

Between workers a group is a :class:`~intellect.diloco.tcp_group.TcpGroup`
(``backend="tcp"``, the default: gloo's receiver aborts its process on a
message longer than its receive, which an admitted member could send); a
worker's own ranks use gloo or NCCL. Every wait is bounded: both enforce the
group timeout on each send/recv wait, and a peer whose process exits closes its
sockets, so its neighbours fail at once rather than after the timeout; a peer
that is alive but silent fails them after ``timeout``. Either way the caller
gets ``CommError`` and must drop the group: after a failure, half-finished
messages may still be queued in it.

Sealed channels. A :class:`Channel` given a ``mac_key`` (the worker derives one per outer step
and attempt from the all-reduce root the coordinator gave it: ``derive_key(root, "allreduce",
run, step, attempt)``) prefixes every message
with an HMAC over (sender rank, receiver rank, tag, bytes) and its length; :meth:`Channel.open`
checks it on the receiving side, so a message forged by anyone without the key, altered on the
way, or replayed into another slot (another peer, tag, attempt or step) raises ``CommError``
like a garbled one. The key is shared by the members: it authenticates *a member*, not which.

    >>> shard_prefix("mesh_3", 1)
    'mesh_3/shard1'
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct
from typing import Mapping, Sequence, cast

import torch
import torch.distributed as dist

from intellect.diloco.tcp_group import TcpGroup
from intellect.trust.mac import TAG_BYTES, check, tag

__all__ = ["CommError", "Channel", "SEAL_BYTES", "bind_host", "new_group", "shard_group", "shard_prefix", "group_timeout"]

_SEAL_DOMAIN = "intellect/allreduce/message/v1"
_LEN = struct.Struct("<Q")
SEAL_BYTES = TAG_BYTES + _LEN.size  # what a sealed message adds
_SIOCGIFADDR = 0x8915  # Linux: an interface's address (<linux/sockios.h>)


class CommError(RuntimeError):
    """A send/recv failed or timed out; the process group must be rebuilt before reuse."""


def _td(timeout: float | datetime.timedelta) -> datetime.timedelta:
    return timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=float(timeout))


def gloo_devices(hostname: str | None = None, environ: Mapping[str, str] | None = None) -> list:
    """The gloo devices a group binds to: ``hostname``'s address; else one per interface that
    ``GLOO_SOCKET_IFNAME`` lists (comma-separated), as ``init_process_group`` reads it; else the
    address the host name resolves to. An interface that does not exist raises ``RuntimeError``
    here, before any rendezvous, rather than binding to some other address."""
    dev = dist.ProcessGroupGloo
    if hostname:
        return [dev.create_device(hostname=hostname)]
    if names := _interfaces(environ):
        return [dev.create_device(interface=name) for name in names]
    return [dev.create_default_device()]


def _interfaces(environ: Mapping[str, str] | None) -> list[str]:
    """The interfaces ``GLOO_SOCKET_IFNAME`` names (comma-separated), as ``init_process_group`` reads it."""
    ifnames = (os.environ if environ is None else environ).get("GLOO_SOCKET_IFNAME", "")
    return [n for n in ifnames.split(",") if n] if len(ifnames) > 1 else []  # torch's rule: one character is ignored


def bind_host(hostname: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The address a :class:`~intellect.diloco.tcp_group.TcpGroup` binds to, by gloo's rule
    (:func:`gloo_devices`): ``hostname``; else the IPv4 address of the first interface
    ``GLOO_SOCKET_IFNAME`` names (``RuntimeError`` if it has none); else what the host name resolves to.

    >>> bind_host("127.0.0.1", {"GLOO_SOCKET_IFNAME": "nosuch0"}), bind_host(None, {"GLOO_SOCKET_IFNAME": "lo"})
    ('127.0.0.1', '127.0.0.1')
    """
    if hostname:
        return hostname
    if names := _interfaces(environ):
        name = names[0]
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                req = struct.pack("256s", name.encode()[:15])
                return socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
        except OSError as e:
            raise RuntimeError(f"GLOO_SOCKET_IFNAME: interface {name!r} has no IPv4 address: {e}") from e
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def new_group(
    store: dist.Store,  # pyright: ignore[reportPrivateImportUsage]  # public, re-exported from torch._C
    prefix: str,
    rank: int,
    size: int,
    *,
    timeout: float | datetime.timedelta = 60.0,
    backend: str = "tcp",
    hostname: str | None = None,
) -> dist.ProcessGroup:
    """A process group of ``size`` ranks rendezvousing under ``prefix`` on ``store``.

    ``backend``: ``"tcp"`` (between workers: :class:`~intellect.diloco.tcp_group.TcpGroup`, which a
    hostile peer's message cannot end the process of), ``"gloo"`` or ``"nccl"`` (a worker's own ranks).
    ``hostname``: the address peers reach this rank at (the group binds to it); None: the
    interfaces ``GLOO_SOCKET_IFNAME`` names, else the host name's (:func:`gloo_devices`, :func:`bind_host`).
    Blocks until all ``size`` ranks have joined or the timeout passes.
    """
    if not 0 <= rank < size:
        raise ValueError(f"new_group: rank {rank} outside [0, {size})")
    pstore = dist.PrefixStore(prefix.rstrip("/") + "/", store)  # pyright: ignore[reportPrivateImportUsage]  # public, from torch._C
    if backend == "tcp":
        host = bind_host(hostname)
        try:
            return cast(dist.ProcessGroup, TcpGroup(pstore, rank, size, host, _td(timeout).total_seconds()))
        except (OSError, RuntimeError) as e:  # a peer unreachable or silent, its address malformed or never set
            raise CommError(f"new_group: the rendezvous under {prefix!r} failed: {type(e).__name__}: {e}") from e
    if backend == "gloo":
        # the stubs name it `Options` (without `_devices`); the runtime class that takes devices is `_Options`
        opts = dist.ProcessGroupGloo._Options()  # pyright: ignore[reportAttributeAccessIssue]
        opts._timeout = _td(timeout)
        opts._devices = gloo_devices(hostname)
        try:  # a c10d Backend used directly as the group: it has the ProcessGroup surface used here (rank/size/send/recv)
            return cast(dist.ProcessGroup, dist.ProcessGroupGloo(pstore, rank, size, opts))
        except (ValueError, MemoryError, OverflowError) as e:  # gloo parsing a peer's malformed address list
            raise CommError(f"new_group: gloo's rendezvous under {prefix!r} failed: {type(e).__name__}: {e}") from e
    if backend == "nccl":  # not exercised by the CPU test suite
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise RuntimeError("new_group: this torch build has no NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _td(timeout)
        # a c10d Backend used directly as the group, as for gloo above
        return cast(dist.ProcessGroup, dist.ProcessGroupNCCL(pstore, rank, size, opts))
    raise ValueError(f"new_group: unknown backend {backend!r}")


def shard_prefix(prefix: str, local_rank: int) -> str:
    return f"{prefix.rstrip('/')}/shard{local_rank}"


def shard_group(
    store: dist.Store,  # pyright: ignore[reportPrivateImportUsage]  # public, re-exported from torch._C
    prefix: str, worker_rank: int, num_workers: int, local_rank: int, **kw
) -> dist.ProcessGroup:
    """The group of local rank ``local_rank`` across ``num_workers`` workers (one of M
    independent groups on ``store``); ``kw`` as in ``new_group``."""
    return new_group(store, shard_prefix(prefix, local_rank), worker_rank, num_workers, **kw)


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """The timeout ``group`` was created with (gloo/NCCL backends), else torch's default."""
    for g in (group, _cpu_backend(group)):
        t = getattr(getattr(g, "options", None), "_timeout", None)
        if isinstance(t, datetime.timedelta) and t.total_seconds() > 0:
            return t
    return dist.default_pg_timeout


def _cpu_backend(group):
    try:  # a ProcessGroup from dist.new_group wraps its backend
        return group._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - a private torch API: whatever it raises means "no CPU backend"
        return None


class Channel:
    """Non-blocking tagged send/recv on one group, with byte counts and bounded waits.

    Tensors are moved to ``device`` (CUDA for NCCL); counts are payload bytes
    handed to the transport, by ``kind`` and by destination rank.
    """

    def __init__(self, group: dist.ProcessGroup, timeout: datetime.timedelta, device: torch.device | None = None,
                 mac_key: bytes | None = None):
        self.group = group
        self.timeout = timeout
        self.device = device or torch.device("cpu")
        self.mac_key = mac_key
        self.rank = group.rank()
        self.sent: dict[str, int] = {}
        self.sent_to: dict[int, int] = {}
        self.messages = 0

    def _seal(self, key: bytes, t: torch.Tensor, dst: int, tag_: int) -> torch.Tensor:
        body = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        mac = tag(key, _SEAL_DOMAIN, self.rank, dst, tag_, body)
        return torch.frombuffer(bytearray(mac + _LEN.pack(len(body)) + body), dtype=torch.uint8)

    def open(self, buf: torch.Tensor, src: int, tag_: int) -> torch.Tensor:
        """The message in receive buffer ``buf`` from ``src`` under ``tag_``: ``buf`` itself on an
        unsealed channel; on a sealed one the bytes after the seal, once their MAC checks out."""
        if self.mac_key is None:
            return buf
        raw = buf.cpu()
        if raw.numel() < SEAL_BYTES:
            raise CommError(f"message from rank {src} (tag {tag_}) is shorter than its seal")
        head = raw[:SEAL_BYTES].numpy().tobytes()
        (n,) = _LEN.unpack_from(head, TAG_BYTES)
        if n > raw.numel() - SEAL_BYTES:
            raise CommError(f"message from rank {src} (tag {tag_}) claims {n} bytes, more than its buffer")
        body = raw[SEAL_BYTES:SEAL_BYTES + n]
        if not check(self.mac_key, head[:TAG_BYTES], _SEAL_DOMAIN, src, self.rank, tag_, body.numpy().tobytes()):
            raise CommError(f"message from rank {src} (tag {tag_}) fails its MAC (forged, altered or misdirected)")
        return body.to(buf.device)

    def isend(self, t: torch.Tensor, dst: int, tag: int, kind: str) -> dist.Work:
        if self.mac_key is not None:
            t = self._seal(self.mac_key, t, dst, tag)
        t = t.to(self.device).contiguous()
        try:
            work = self.group.send([t], dst, tag)
        except RuntimeError as e:
            raise CommError(f"send to rank {dst} (tag {tag}) failed: {e}") from e
        n = t.numel() * t.element_size()
        self.sent[kind] = self.sent.get(kind, 0) + n
        self.sent_to[dst] = self.sent_to.get(dst, 0) + n
        self.messages += 1
        return work

    def empty(self, nbytes: int) -> torch.Tensor:
        """A receive buffer for a message of up to ``nbytes`` (and its seal, on a sealed channel)."""
        extra = SEAL_BYTES if self.mac_key is not None else 0
        return torch.empty(nbytes + extra, dtype=torch.uint8, device=self.device)

    def irecv(self, t: torch.Tensor, src: int, tag: int) -> dist.Work:
        try:
            return self.group.recv([t], src, tag)
        except RuntimeError as e:
            raise CommError(f"recv from rank {src} (tag {tag}) failed: {e}") from e

    def wait(self, works: Sequence[dist.Work], what: str) -> None:
        for w in works:
            try:
                w.wait(self.timeout)
            except RuntimeError as e:  # gloo: timeout or a peer's closed socket
                raise CommError(f"{what}: {e}") from e
