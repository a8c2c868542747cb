"""Identifiers shared by the ledger, the verdicts and the RL submission path.

A leaf module (standard library only), so every layer can canonicalize a worker id without importing
the RL package.
"""

from __future__ import annotations

import re

_WORKER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def canonical_worker(worker: str) -> str:
    """The canonical (lowercase) form of a worker id; ``ValueError`` if it is not a valid id.

    A worker id is 1-128 characters of ``A-Z a-z 0-9 . _ -`` starting with a letter or digit, so it
    is also a safe file-name component. Ids are case-insensitive, so the case variants of one
    Ethereum-style address are one worker (one ledger row, one prompt assignment).

    >>> canonical_worker("0xAbC123")
    '0xabc123'
    """
    if not isinstance(worker, str) or not _WORKER_RE.fullmatch(worker):
        raise ValueError(f"invalid worker id {worker!r}: use 1-128 of A-Z a-z 0-9 . _ -, starting alphanumeric")
    return worker.lower()
