"""The devices of one worker host and which flow run holds which: the pool worker's device lease.

A GPU pool's flow run asks for a number of devices (its ``devices`` job variable, default 1); the
pool worker (``infra/pool_worker.py``) hands it that many of its host's devices that no other live
run of this worker holds, as the run's ``CUDA_VISIBLE_DEVICES``, and takes them back when the run's
process ends. The host's devices are the worker's ``--devices`` (indices or UUIDs, comma-separated),
else its own ``CUDA_VISIBLE_DEVICES``, else the GPUs ``nvidia-smi`` lists, else none (a CPU host).
Nothing here imports torch: CUDA's initialisation would cost every worker start seconds, and the
worker never computes on a device itself.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from typing import Hashable

# what CUDA_VISIBLE_DEVICES takes per entry: an index, a UUID (GPU-...) or a MIG id (MIG-...)
_DEVICE = re.compile(r"^[A-Za-z0-9-]{1,128}$")
MAX_DEVICES = 64  # the most a flow run may ask for (the pools' ``devices`` variable bound)
SMI_TIMEOUT = 30.0  # seconds nvidia-smi gets to list the GPUs of a host


def parse_devices(text: str) -> tuple[str, ...]:
    """The device ids of a comma-separated list (``--devices`` or ``CUDA_VISIBLE_DEVICES``); blank
    entries and surrounding spaces are dropped; a duplicate or an id with other characters is refused.

    >>> parse_devices("0,1, 2"), parse_devices(""), parse_devices("GPU-8a3f,MIG-1c2d")
    (('0', '1', '2'), (), ('GPU-8a3f', 'MIG-1c2d'))
    >>> parse_devices("0,0")
    Traceback (most recent call last):
    ...
    ValueError: device '0' is listed twice in '0,0'
    """
    out: list[str] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        if not _DEVICE.match(entry):
            raise ValueError(f"not a device id (an index or a UUID): {entry!r}")
        if entry in out:
            raise ValueError(f"device {entry!r} is listed twice in {text!r}")
        out.append(entry)
    return tuple(out)


def smi_indices(listing: str) -> tuple[str, ...]:
    """The GPU indices of ``nvidia-smi --query-gpu=index --format=csv,noheader``'s output.

    >>> smi_indices("0\\n1\\n\\n"), smi_indices("")
    (('0', '1'), ())
    """
    return parse_devices(",".join(listing.split()))


def host_devices(option: str | None, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The devices a pool worker hands out: ``option`` (``--devices``; ``""`` for none) if given, else
    the worker's own ``CUDA_VISIBLE_DEVICES`` if set (what the operator already narrowed it to), else
    every GPU ``nvidia-smi`` lists, else none.

    >>> host_devices("0,1,2,3"), host_devices(None, {"CUDA_VISIBLE_DEVICES": "2,3"}), host_devices("")
    (('0', '1', '2', '3'), ('2', '3'), ())
    """
    if option is not None:
        return parse_devices(option)
    if "CUDA_VISIBLE_DEVICES" in environ:
        return parse_devices(environ["CUDA_VISIBLE_DEVICES"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        listing = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=SMI_TIMEOUT, check=True).stdout
    except (OSError, subprocess.SubprocessError):  # a driver that does not answer: no GPU to hand out
        return ()
    return smi_indices(listing)


class DeviceLease:
    """Which holder (a flow run's id) holds which of a host's devices; no device is held by two.

    ``take`` hands out the first free devices in the host's order, or None when fewer are free (the
    caller waits); a request for more than the host has, or a negative one, is refused with the
    reason, since waiting would never end. The same holder asking again gets what it holds.

    >>> lease = DeviceLease(("0", "1", "2", "3"))
    >>> lease.take("a", 2), lease.take("b", 2), lease.take("c", 1), lease.free()
    (('0', '1'), ('2', '3'), None, ())
    >>> lease.release("a"); lease.take("c", 1), lease.free(), lease.take("d", 0)
    (('0',), ('1',), ())
    >>> lease.take("e", 5)
    Traceback (most recent call last):
    ...
    ValueError: asks for 5 devices; this worker has 4 (0,1,2,3)
    """

    def __init__(self, devices: Sequence[str]):
        self.devices = parse_devices(",".join(devices))
        self._held: dict[Hashable, tuple[str, ...]] = {}

    def free(self) -> tuple[str, ...]:
        taken = {d for grant in self._held.values() for d in grant}
        return tuple(d for d in self.devices if d not in taken)

    def held(self, holder: Hashable) -> tuple[str, ...] | None:
        return self._held.get(holder)

    def holders(self) -> Iterable[Hashable]:
        return tuple(self._held)

    def refusal(self, count: int) -> str | None:
        """Why a request for ``count`` devices can never be granted here, or None if it can."""
        if count < 0:
            return f"asks for {count} devices"
        if count > len(self.devices):
            return f"asks for {count} devices; this worker has {len(self.devices)} ({','.join(self.devices)})"
        return None

    def take(self, holder: Hashable, count: int) -> tuple[str, ...] | None:
        if (reason := self.refusal(count)) is not None:
            raise ValueError(reason)
        if holder in self._held:
            return self._held[holder]
        free = self.free()
        if len(free) < count:
            return None
        self._held[holder] = grant = free[:count]
        return grant

    def release(self, holder: Hashable) -> None:
        """Give back ``holder``'s devices (nothing if it holds none: every exit path may call it)."""
        self._held.pop(holder, None)
