"""The proof of work an open run asks of a new key: what a registration costs.

Registering a key is the one step of a worker that nothing else prices, and each admitted key is
one more draw of assignments (:mod:`intellect.rl.wire.assignment`): a grinder holding many keys could
use, at each step, the one whose draw it likes best. In ``open`` admission the service therefore
admits a key only with a nonce such that

    sha256(b"intellect/registration-work/v1\\0" + run + b"\\0" + public key (32 bytes) + nonce)

has ``bits`` leading zero bits (``run`` in UTF-8, ``nonce`` an 8-byte big-endian unsigned int).
It binds the run and the key, so one proof admits one key to one run; finding it takes ``2 ** bits``
hashes on average (:func:`solve`), checking it one (:func:`check`). ``bits`` is
``ServiceConfig.registration_work_bits``, sized to about one generation step of a worker; the
service names it in its unsigned health answer so a worker knows it before it registers.

>>> nonce = solve("run", bytes(32), 8)
>>> check("run", bytes(32), nonce, 8), check("other-run", bytes(32), nonce, 8) or check("run", bytes(32), nonce, 40)
(True, False)
"""

from __future__ import annotations

import hashlib

from pydantic import Field

from intellect.config import StrictModel

_DOMAIN = b"intellect/registration-work/v1\0"
MAX_BITS = 48
_U64 = 1 << 64


class RegisterBody(StrictModel):
    """The body of ``POST /v1/register``: ``{}`` (or nothing) where no work is asked, else the nonce."""

    work: int = Field(default=0, ge=0, lt=_U64, description="The nonce of the key's proof of work.")


def _prefix(run: str, public: bytes) -> "hashlib._Hash":
    if len(public) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes, got {len(public)}")
    return hashlib.sha256(_DOMAIN + run.encode() + b"\0" + public)


def check(run: str, public: bytes, nonce: int, bits: int) -> bool:
    """Whether ``nonce`` proves ``bits`` bits of work for ``public`` in ``run`` (one hash)."""
    if not 0 <= nonce < _U64:
        return False
    h = _prefix(run, public)
    h.update(nonce.to_bytes(8, "big"))
    return int.from_bytes(h.digest(), "big") < 1 << (256 - bits)  # `bits` leading zero bits


def solve(run: str, public: bytes, bits: int) -> int:
    """The first nonce proving ``bits`` bits of work for ``public`` in ``run`` (``2 ** bits`` hashes
    on average; 0 for ``bits = 0``)."""
    if not 0 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in [0, {MAX_BITS}], got {bits}")
    base = _prefix(run, public)
    limit = 1 << (256 - bits)  # a digest below this has `bits` leading zero bits
    for nonce in range(_U64):
        h = base.copy()
        h.update(nonce.to_bytes(8, "big"))
        if int.from_bytes(h.digest(), "big") < limit:
            return nonce
    raise RuntimeError("no nonce proves the work")  # 2**64 tries: not reached
