"""How an outside contributor joins a DiLoCo run without the run secret.

The run secret opens the rendezvous as anyone (it derives every peer's key, the coordinator's
included), so it stays with the coordinator. A contributor instead makes an Ed25519 key pair
(``intellect worker keygen``, :mod:`intellect.trust.keys`), the operator lists its public key in
``diloco.contributors``, and the contributor joins (``intellect diloco-join``) by one exchange with
the rendezvous, ``POST /v1/join``:

1. The request is signed with the contributor's key (:func:`intellect.trust.requests.sign_request`,
   audience ``diloco-join/<run>``, so it is good for this run only, once) and carries a fresh
   X25519 public key.
2. The coordinator (:class:`Admission`) refuses a key that is not on the allowlist
   (``not_admitted``) or was banned (``banned``); else the contributor's worker name is its
   key id, never a name it picks (``w0``, ``coordinator`` and the others' ids are out of its
   reach), and the first join records it in ``launched/`` (so the members wait for it at a
   boundary, in admission order).
3. The answer holds that worker's own rendezvous key and the all-reduce root, sealed to the
   request's X25519 key (X25519, HKDF-SHA256, ChaCha20-Poly1305): whoever reads the wire learns
   neither. The whole answer, with the run's config, is signed by the coordinator's identity
   (:func:`coordinator_identity`, derived from the run secret), whose public key the contributor
   pins (``--coordinator-key``), so nobody who takes over the port can hand it a run of their own.

From then on the contributor is a worker like any other: it MACs every rendezvous request under
its own key (:mod:`intellect.diloco.rendezvous`), which speaks as that worker alone and writes
only what ``membership.scope`` allows it; it cannot derive the coordinator's key or anyone else's.
It holds the all-reduce root, as every member does (a member checks the others' messages with
it); the root derives no rendezvous key. A restarted contributor joins again and gets the same
name and keys.

>>> from intellect.trust.keys import SigningKey
>>> coordinator_identity(bytes(32), "run-a").public.hex == coordinator_identity(bytes(32), "run-a").public.hex
True
>>> coordinator_identity(bytes(32), "run-a").public == coordinator_identity(bytes(32), "run-b").public
False
"""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Iterable, Mapping

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from intellect.diloco.protocol import BANNED, LAUNCHED, read_count
from intellect.diloco.rendezvous import MAX_BODY, allreduce_root, peer_key
from intellect.diloco.rendezvous_client import refusal_reason
from intellect.trust.canonical import canonical
from intellect.trust.keys import BadKey, SigningKey, VerifyKey
from intellect.trust.mac import derive_key
from intellect.trust.requests import NONCE_HEADER, SIGNATURE_HEADER, ReplayGuard, RequestVerifier, sign_request

JOIN_PATH = "/v1/join"
_SEAL, _ANSWER = "intellect/diloco/join/seal/v1", "intellect/diloco/join/answer/v1"
MAX_CONTRIBUTORS = 256
_RAW = serialization.Encoding.Raw, serialization.PublicFormat.Raw


class Refusal(PermissionError):
    """A join the coordinator refuses: ``reason`` is ``not_admitted`` or ``banned``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class JoinError(RuntimeError):
    """The join did not give this contributor its credentials (refused, unreachable, or an answer
    that is not the coordinator's); ``reason`` as the server gave it, when it did."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


def audience(run: str) -> str:
    return f"diloco-join/{run}"


def coordinator_identity(secret: bytes, run: str) -> SigningKey:
    """The coordinator's Ed25519 identity for ``run``: it signs join answers; contributors pin its
    public key. Derived from the run secret, so a coordinator restarted with the same secret keeps it."""
    return SigningKey.from_seed(derive_key(secret, "coordinator-identity", run))


def _seal_key(shared: bytes, run: str, worker: str, theirs: bytes, ours: bytes) -> bytes:
    info = canonical(_SEAL, run, worker, theirs, ours)
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def _answer_message(run: str, nonce: str, answer: bytes) -> bytes:
    return canonical(_ANSWER, run, nonce, answer)


class Admission:
    """The coordinator's side of the exchange (``RendezvousServer(admission=...)``): the allowlist
    ``contributors`` (public keys, hex), the keys it hands out (derived from ``secret``) and the
    run's ``config`` (JSON) every admitted contributor gets."""

    def __init__(self, secret: bytes, run: str, contributors: Iterable[str], config: str, window: float = 60.0):
        self.allowed = {k.id: k for k in map(VerifyKey.from_hex, contributors)}
        if len(self.allowed) > MAX_CONTRIBUTORS:
            raise ValueError(f"at most {MAX_CONTRIBUTORS} contributors")
        self._secret, self.run, self.config = secret, run, config
        self.identity = coordinator_identity(secret, run)
        self.verifier = RequestVerifier(audience(run), window, ReplayGuard(window, capacity=1 << 16, per_key=64))

    def admit(self, headers: Mapping[str, str], body: bytes,
              data: Mapping[str, bytes]) -> tuple[bytes, dict[str, str], dict[str, bytes]]:
        """``(answer, its headers, what to write)`` for a join request; :class:`Refusal` or
        ``AuthError`` (unsigned, stale, mis-signed, replayed) when it is refused. ``data``: the
        rendezvous table, read only (what to write goes back to the server, which writes it)."""
        key = self.verifier.verify("POST", JOIN_PATH, body, headers)
        if key.id not in self.allowed or self.allowed[key.id] != key:
            raise Refusal("not_admitted", f"{key.id} is not among the run's contributors")
        worker = key.id
        if BANNED(worker) in data:
            raise Refusal("banned", f"{worker} was banned from the run")
        try:
            request = json.loads(body)
            theirs = bytes.fromhex(request["ephemeral"]) if isinstance(request, dict) else b""
            their_key = X25519PublicKey.from_public_bytes(theirs)
        except (ValueError, KeyError, TypeError) as e:
            raise Refusal("malformed", f"a join request is {{\"ephemeral\": <X25519 key, hex>}}: {e}") from None
        count = read_count(data.get(LAUNCHED.under()), 0, 1 << 16) or 0
        index = next((i for i in range(count) if data.get(LAUNCHED(i)) == worker.encode()), None)
        writes: dict[str, bytes] = {}
        if index is None:  # its first join: admitted after everyone before it
            index = count
            writes = {LAUNCHED(index): worker.encode(), LAUNCHED.under(): str(count + 1).encode()}
        ours = X25519PrivateKey.generate()
        ours_raw = ours.public_key().public_bytes(*_RAW)
        seal = _seal_key(ours.exchange(their_key), self.run, worker, theirs, ours_raw)
        plain = peer_key(self._secret, self.run, worker) + allreduce_root(self._secret, self.run)
        sealed = ChaCha20Poly1305(seal).encrypt(bytes(12), plain, None)  # the key is this exchange's alone
        answer = json.dumps({"worker": worker, "index": index, "ephemeral": ours_raw.hex(), "sealed": sealed.hex(),
                             "config": self.config}, separators=(",", ":")).encode()
        signature = self.identity.sign(_answer_message(self.run, headers[NONCE_HEADER], answer))
        return answer, {SIGNATURE_HEADER: signature.hex()}, writes


@dataclass(frozen=True)
class Joined:
    """What a contributor holds after joining: its name, admission index, own rendezvous key,
    the all-reduce root and the run's config (JSON)."""

    worker: str
    index: int
    key: bytes
    allreduce_root: bytes
    config: str


def join(host: str, port: int, run: str, key: SigningKey, coordinator: VerifyKey, timeout: float = 30.0) -> Joined:
    """Join ``run`` at the rendezvous ``host:port`` as ``key``'s holder, trusting only answers
    signed by ``coordinator``; :class:`JoinError` when that fails."""
    ours = X25519PrivateKey.generate()
    ours_raw = ours.public_key().public_bytes(*_RAW)
    body = json.dumps({"ephemeral": ours_raw.hex()}).encode()
    headers = {"content-type": "application/json", **sign_request(key, "POST", JOIN_PATH, body, audience=audience(run))}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", JOIN_PATH, body, headers)
        resp = conn.getresponse()
        out = resp.read(MAX_BODY + 1)
    except (OSError, http.client.HTTPException) as e:
        raise JoinError(f"cannot reach the rendezvous at {host}:{port}: {e}") from e
    finally:
        conn.close()
    if resp.status != 200:
        raise JoinError(f"the rendezvous refused the join: {out[:300].decode(errors='replace')}", refusal_reason(out))
    try:
        good = coordinator.verify(bytes.fromhex(resp.getheader(SIGNATURE_HEADER) or ""),
                                  _answer_message(run, headers[NONCE_HEADER], out))
    except ValueError:
        good = False
    if not good or len(out) > MAX_BODY:
        raise JoinError("the join answer is not signed by the run's coordinator", "bad_signature")
    try:
        doc = json.loads(out)
        worker, index, config = doc["worker"], doc["index"], doc["config"]
        if worker != key.public.id or type(index) is not int or not isinstance(config, str):
            raise ValueError("the answer names another worker")
        theirs = bytes.fromhex(doc["ephemeral"])
        seal = _seal_key(ours.exchange(X25519PublicKey.from_public_bytes(theirs)), run, worker, ours_raw, theirs)
        plain = ChaCha20Poly1305(seal).decrypt(bytes(12), bytes.fromhex(doc["sealed"]), None)
    except (ValueError, KeyError, TypeError, InvalidTag, BadKey) as e:
        raise JoinError(f"a malformed join answer: {type(e).__name__}: {e}", "malformed") from None
    return Joined(worker, index, plain[:32], plain[32:], config)
