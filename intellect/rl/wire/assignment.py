"""Deterministic prompt assignment: a worker answers the prompts it is given, not ones it picks.

The prompts of submission ``k`` of worker ``w`` at step ``n`` follow from

    seed = first 8 bytes, big-endian, of sha256(b"intellect/assignment/v1\\0" + w + b"\\0" + n + k + salt)

with ``w`` the canonical worker id in UTF-8, ``n``, ``k`` as 8-byte big-endian unsigned ints and
``salt`` the worker's salt: 32 random bytes the submission service draws when it admits the key,
records in its registry and tells the worker in its registration answer
(:class:`~intellect.rl.service.registry.Registry`), or :data:`NO_SALT` (empty) for a worker the operator runs
in its own process. Without the salt, assignments would be a public function of the key: a
grinder could make keys offline and register only those whose assignments hold easy prompts.
With it, nothing about a key's assignments is known before the key is committed (registered),
and the salt of an admitted key never changes, so registering again draws nothing new.
From the seed, :func:`assign_prompts` draws ``n_prompts`` distinct task indices by a partial
Fisher-Yates shuffle whose random numbers are sha256 in counter mode, so every process, Python
version and platform computes the same list (Python's ``hash`` and ``random`` promise neither).
The validator recomputes the list and rejects a submission whose prompts differ
(:func:`check_assignment`): a worker cannot re-roll until it draws easy prompts.

Worker ids are case-insensitive (:func:`intellect.ids.canonical_worker` lowercases them), so the case variants of
one Ethereum-style address do not yield extra assignments. A worker holding several admitted keys
can still use the one whose (random) draw of a step it likes best: the service's admission rule
(``ServiceConfig.registration_work_bits``, or an allowlist) bounds how many keys it holds.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from intellect.ids import canonical_worker

if TYPE_CHECKING:
    from intellect.rl.wire.rollout_schema import Rollout

_DOMAIN = b"intellect/assignment/v1\0"
_U64 = 1 << 64
SALT_BYTES = 32
#: The salt of a worker the operator runs in its own process (no submission service, no admission).
NO_SALT = b""


def _u64(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _U64:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {value!r}")
    return value


def check_salt(salt: object) -> bytes:
    """``salt`` if it is a worker salt (:data:`NO_SALT` or :data:`SALT_BYTES` bytes), else ``ValueError``."""
    if not isinstance(salt, bytes) or len(salt) not in (0, SALT_BYTES):
        raise ValueError(f"a worker salt is empty or {SALT_BYTES} bytes, got {salt!r:.80}")
    return salt


def assignment_seed(worker_address: str, step: int, k: int, salt: bytes = NO_SALT) -> int:
    """The 64-bit seed of submission ``k`` of ``worker_address`` at ``step`` (see the module doc).

    >>> assignment_seed("0xABC", 3, 0) == assignment_seed("0xabc", 3, 0) != assignment_seed("0xabc", 3, 1)
    True
    >>> assignment_seed("0xabc", 3, 0) != assignment_seed("0xabc", 3, 0, bytes(32))
    True
    """
    msg = _DOMAIN + canonical_worker(worker_address).encode() + b"\0"
    msg += _u64("step", step).to_bytes(8, "big") + _u64("k", k).to_bytes(8, "big") + check_salt(salt)
    return int.from_bytes(hashlib.sha256(msg).digest()[:8], "big")


def _words(seed: int) -> Iterator[int]:
    """Uniform 64-bit words: sha256(seed || counter), four words per block."""
    prefix = seed.to_bytes(8, "big")
    counter = 0
    while True:
        block = hashlib.sha256(prefix + counter.to_bytes(8, "big")).digest()
        for i in range(0, 32, 8):
            yield int.from_bytes(block[i : i + 8], "big")
        counter += 1


def _below(words: Iterator[int], n: int) -> int:
    # rejection sampling keeps every index equally likely (plain modulo would favour small ones)
    limit = _U64 - _U64 % n
    while True:
        x = next(words)
        if x < limit:
            return x % n


def assign_prompts(n_tasks: int, worker_address: str, step: int, k: int, n_prompts: int,
                   salt: bytes = NO_SALT) -> list[int]:
    """The ``n_prompts`` distinct task indices in ``[0, n_tasks)`` submission ``k`` must answer, in order.

    Group ``j`` of the submission answers task ``assign_prompts(...)[j]``. Costs O(n_prompts),
    whatever ``n_tasks`` is.

    >>> a = assign_prompts(1000, "w1", 7, 0, 4)
    >>> a == assign_prompts(1000, "W1", 7, 0, 4), len(set(a)), a != assign_prompts(1000, "w1", 7, 1, 4)
    (True, 4, True)
    """
    for name, value in (("n_tasks", n_tasks), ("n_prompts", n_prompts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if n_prompts > n_tasks:
        raise ValueError(f"cannot draw {n_prompts} distinct prompts from {n_tasks} tasks")
    words = _words(assignment_seed(worker_address, step, k, salt))
    swapped: dict[int, int] = {}  # the touched part of a virtual list(range(n_tasks))
    out = []
    for i in range(n_prompts):
        j = i + _below(words, n_tasks - i)
        out.append(swapped.get(j, j))
        swapped[j] = swapped.get(i, i)
    return out


def check_assignment(
    rows: Sequence[Rollout],
    task_ids: Sequence[str],
    n_prompts: int,
    *,
    group_size: int | None = None,
    prompt_tokens: Callable[[str], Sequence[int]] | None = None,
    salt: bytes = NO_SALT,
) -> str | None:
    """``None`` if ``rows`` (one submission) answer exactly their assigned prompts, else why not.

    Every row must carry the submission's worker, step and index (the seed's inputs, with the worker's
    ``salt`` from the service's registry); group ``j``
    must answer ``task_ids[assign_prompts(len(task_ids), ...)[j]]`` with one prompt-token list, and
    every group ``0 .. n_prompts - 1`` must be present, with ``group_size`` rows each if given.
    ``prompt_tokens(task_id)``, if given, is the tokenized prompt the task must have been asked with:
    without it a worker could label an easy prompt with its assigned id. The ledger reason of a
    failure is ``"assignment"``.
    """
    if not rows:
        return "no rows"
    first = rows[0]
    if any((r.worker, r.step, r.submission) != (first.worker, first.step, first.submission) for r in rows):
        return "rows disagree on worker, step or submission index"
    try:
        assigned = assign_prompts(len(task_ids), first.worker, first.step, first.submission, n_prompts, salt)
    except ValueError as e:
        return f"cannot recompute the assignment: {e}"
    groups: dict[int, list[Rollout]] = {}
    for r in rows:
        groups.setdefault(r.group_id, []).append(r)
    if sorted(groups) != list(range(n_prompts)):
        return f"groups {sorted(groups)[:8]}... do not match the {n_prompts} assigned groups 0..{n_prompts - 1}"
    for j, members in sorted(groups.items()):
        want = task_ids[assigned[j]]
        if any(r.prompt_id != want for r in members):
            return f"group {j} must answer prompt {want!r}"
        if any(tuple(r.prompt_tokens) != tuple(members[0].prompt_tokens) for r in members):
            return f"group {j} mixes different prompt tokens"
        if group_size is not None and len(members) != group_size:
            return f"group {j} has {len(members)} samples, expected {group_size}"
        if prompt_tokens is not None and tuple(members[0].prompt_tokens) != tuple(prompt_tokens(want)):
            return f"group {j}: prompt tokens differ from task {want!r}"
    return None
