"""The worker's side of the submission service (:mod:`intellect.rl.service.server`): signed HTTP calls.

Every request is signed with the worker's key for the run (``audience``), its body's sha256 named
in ``x-intellect-content-sha256`` (:func:`~intellect.trust.requests.sign_request`) so the service
checks the signature before reading the body, and its Content-Length declared; the worker id is the
key's id, so a client cannot speak for any other worker. Transport errors and the service's "not
now" (``busy``, ``rate_limited``, ``too_slow``, any 503) are retried with a fresh signature (each try
has its own nonce), after pauses that double from ``first_pause`` up to ``max_pause``, each drawn
between half and all of that (jitter: clients refused together do not come back together), at most
``retries`` times and never past ``retry_for`` seconds in all (:func:`pauses`); every call is
idempotent on the service's side (a repeated upload of the same bytes, a repeated done record, a
repeated registration answer what is stored), so a retry after a lost answer is safe. Any other
refusal raises :class:`ServiceError` with the service's reason.

>>> from intellect.trust.keys import SigningKey
>>> ServiceClient("http://127.0.0.1:1", SigningKey.from_seed(bytes(32)), audience="run-a").worker
'kfd0408a034418ede3f97'
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from typing import Callable, Iterator

import httpx
from pydantic import ValidationError

from intellect.rl.wire import work
from intellect.rl.wire.assignment import SALT_BYTES
from intellect.rl.wire.refill import StepStatus
from intellect.rl.service.registry import SubmissionRecord
from intellect.trust.keys import SigningKey
from intellect.trust.requests import sign_request

_ANSWER_CAP = 16 << 20
_RETRIED = frozenset({"busy", "too_slow", "rate_limited"})  # "not now": a congested link or a full service
_RECORD_FIELDS = set(SubmissionRecord.__dataclass_fields__)
_SALT_HEX = re.compile(f"[0-9a-f]{{{2 * SALT_BYTES}}}")


class ServiceError(RuntimeError):
    """A call the service refused (``status`` its HTTP status, ``reason`` its reason), or could not
    be made (``status`` 0: ``unreachable``; ``bad_answer``; ``upload_failed`` for a refused S3 POST)."""

    def __init__(self, status: int, reason: str, detail: str = ""):
        super().__init__(f"{status} {reason}: {detail}" if detail else f"{status} {reason}")
        self.status, self.reason, self.detail = status, reason, detail


def _record(doc: object) -> SubmissionRecord:
    if not isinstance(doc, dict) or set(doc) != _RECORD_FIELDS:
        raise ServiceError(0, "bad_answer", f"not a submission record: {str(doc)[:200]}")
    return SubmissionRecord(**doc)


def pauses(retries: int, retry_for: float, first_pause: float = 0.25, max_pause: float = 8.0,
           rng: random.Random | None = None, sleep: Callable[[float], object] = time.sleep) -> Iterator[int]:
    """The tries of one call: yields the try's number, the first at once, each later one after a
    pause (``sleep``) of ``first_pause * 2**n`` capped at ``max_pause``, drawn in ``[half, all]`` of
    that; it stops after ``retries`` retries, or before a pause that would end past ``retry_for``
    seconds from the first try.

    >>> list(pauses(3, 60.0, first_pause=0.001))
    [0, 1, 2, 3]
    >>> list(pauses(3, 0.0))  # no time for a retry
    [0]
    """
    rng = rng or random.Random()
    start = time.monotonic()
    for n in range(retries + 1):
        if n:
            pause = min(max_pause, first_pause * 2 ** (n - 1))
            pause = rng.uniform(pause / 2, pause)
            if time.monotonic() + pause - start > retry_for:
                return
            sleep(pause)
        yield n


class ServiceClient:
    """Calls of one worker (``key``) to the submission service at ``url`` of run ``audience``: each
    retried as :func:`pauses` says (``retries``, ``retry_for``)."""

    def __init__(self, url: str, key: SigningKey, *, audience: str, timeout: float = 30.0, retries: int = 12,
                 retry_for: float = 180.0):
        if not timeout > 0 or retries < 0 or retry_for < 0:
            raise ValueError("need timeout > 0, retries >= 0 and retry_for >= 0")
        self.url, self.key, self.audience, self.retries = url.rstrip("/"), key, audience, retries
        self.retry_for = retry_for
        self.worker = key.public.id
        self._http = httpx.Client(timeout=timeout)
        self._upload: str | None = None  # "body" or "presigned", from the registration answer
        self.salt: bytes | None = None  # what this key's assignments and seeds derive from, ditto

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- plumbing

    def _call(self, method: str, path: str, body: bytes = b"", *, doc: dict | None = None) -> dict:
        if doc is not None:
            body = json.dumps(doc).encode()
        last = ServiceError(0, "unreachable", "no attempt")
        for _ in pauses(self.retries, self.retry_for):
            headers = sign_request(self.key, method, path, body, audience=self.audience)
            headers["content-type"] = "application/json" if doc is not None else "application/octet-stream"
            try:
                with self._http.stream(method, self.url + path, content=body, headers=headers) as r:
                    data = bytearray()
                    for piece in r.iter_bytes():
                        data += piece
                        if len(data) > _ANSWER_CAP:
                            raise ServiceError(r.status_code, "bad_answer", f"answer over {_ANSWER_CAP} bytes")
                    status = r.status_code
            except httpx.TransportError as e:
                last = ServiceError(0, "unreachable", f"{method} {path}: {type(e).__name__}: {e}")
                continue
            try:
                answer = json.loads(data)
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                last = ServiceError(status, "bad_answer", bytes(data[:200]).decode("utf-8", "replace"))
                if status == 503:  # uvicorn's own answer when the service is at its connection limit
                    continue
                raise last
            if status < 400:
                return answer
            last = ServiceError(status, str(answer.get("reason", "unknown")), str(answer.get("detail", "")))
            if status != 503 and last.reason not in _RETRIED:
                raise last
        raise last

    # ---------------------------------------------------------------- calls

    def register(self) -> str:
        """Admit this worker's key (idempotent), with the proof of work the service asks of a new key
        (:mod:`intellect.rl.wire.work`), and keep its salt (:attr:`salt`); returns the worker id the
        service knows it by."""
        bits = self._call("GET", "/v1/health").get("registration_work_bits", 0)
        if not isinstance(bits, int) or not 0 <= bits <= work.MAX_BITS:
            raise ServiceError(0, "bad_answer", f"registration work of {bits!r:.40} bits")
        doc = {"work": work.solve(self.audience, self.key.public.raw, bits)} if bits else {}
        answer = self._call("POST", "/v1/register", doc=doc)
        salt = answer.get("salt")
        if (answer.get("worker") != self.worker or answer.get("upload") not in ("body", "presigned")
                or not (isinstance(salt, str) and _SALT_HEX.fullmatch(salt))):
            raise ServiceError(0, "bad_answer", f"registration answer {str(answer)[:200]}")
        self._upload, self.salt = answer["upload"], bytes.fromhex(salt)
        return self.worker

    def run_info(self) -> dict:
        """What the run tells its workers (run name, steps, submission config, relays...)."""
        return self._call("GET", "/v1/run")

    def assignment(self, step: int, k: int) -> list[dict]:
        """The tasks of submission ``k`` at ``step`` (:func:`~intellect.data.loaders.task_row` objects:
        ``{id, prompt, answer}`` or ``{id, prompt, tests}``), in group order."""
        tasks = self._call("GET", f"/v1/assignment?step={int(step)}&k={int(k)}").get("tasks")
        if not isinstance(tasks, list) or not all(
                isinstance(t, dict) and all(isinstance(t.get(f), str) for f in ("id", "prompt")) for t in tasks):
            raise ServiceError(0, "bad_answer", f"not a task list: {str(tasks)[:200]}")
        return tasks

    def submit(self, step: int, k: int, data: bytes) -> SubmissionRecord:
        """Store ``data`` (a Parquet submission) as submission ``k`` of ``step``: the body of a signed
        PUT (local storage), or a presigned POST to S3 after declaring its sha256 and size."""
        step, k = int(step), int(k)
        if self._upload is None:
            self.register()
        if self._upload == "body":
            return _record(self._call("PUT", f"/v1/submissions/{step}/{k}", bytes(data)))
        answer = self._call("POST", f"/v1/uploads/{step}/{k}",
                            doc={"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)})
        url, fields, rec = answer.get("url"), answer.get("fields"), _record(answer.get("record"))
        if not isinstance(url, str) or not isinstance(fields, dict):
            raise ServiceError(0, "bad_answer", f"not a presigned POST: {str(answer)[:200]}")
        last, tries = "no attempt", 0
        for tries in pauses(self.retries, self.retry_for):
            try:
                r = self._http.post(url, data=fields, files={"file": ("submission.parquet", bytes(data))})
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if r.status_code < 300:
                return rec
            if r.status_code < 500:
                raise ServiceError(r.status_code, "upload_failed", r.text[:300])
            last = f"{r.status_code}: {r.text[:200]}"
        raise ServiceError(0, "unreachable", f"S3 POST after {tries + 1} tries: {last}")

    def finish(self, step: int, files: list[str], policy_step: int) -> None:
        """This worker's done record of ``step``: ``files`` are all its submissions for it."""
        self._call("POST", f"/v1/done/{int(step)}", doc={"files": list(files), "policy_step": int(policy_step)})

    def status(self, step: int) -> dict:
        """What the service holds of this worker at ``step`` and the online filter's round there: a
        :class:`~intellect.rl.wire.refill.StepStatus` as its JSON (fields at their defaults left out)."""
        answer = self._call("GET", f"/v1/status?step={int(step)}")
        try:
            StepStatus.model_validate(answer)
        except ValidationError:
            raise ServiceError(0, "bad_answer", f"not a status: {str(answer)[:200]}") from None
        return answer
