"""Ed25519 identities: signing keys, verify keys, key files and the ids derived from keys.

An identity is a key pair, never a chosen name: a participant's id is :func:`key_id` of its public
key, so nobody can pick an id that collides with another's (finding a second key with the same
80-bit id costs about 2**80 tries). Ids can still be ground for a prefix (a few leading zeros cost a
few thousand tries), so nothing may depend on how ids *sort*: order participants by when they were
admitted, never by id.

>>> key = SigningKey.from_seed(bytes(32))
>>> key.public.id
'kfd0408a034418ede3f97'
>>> key.public.verify(key.sign(b"hello"), b"hello"), key.public.verify(key.sign(b"hello"), b"hullo")
(True, False)

A key file is JSON ``{"kind": "intellect-ed25519-v1", "private": <hex seed>, "public": <hex>}``
written with mode 0600; :meth:`SigningKey.load` refuses one that others can read, as ssh does.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KEY_FILE_KIND = "intellect-ed25519-v1"
PUBLIC_BYTES = 32
SIGNATURE_BYTES = 64
_ID_DOMAIN = b"intellect/key-id/v1\0"
ID_HEX = 20  # 80 bits


class BadKey(ValueError):
    """A key or key file that cannot be used (malformed, wrong kind, readable by others)."""


def key_id(public: bytes) -> str:
    """The id of a public key: ``"k"`` and the first 80 bits of a domain-separated sha256, in hex."""
    if len(public) != PUBLIC_BYTES:
        raise BadKey(f"an Ed25519 public key has {PUBLIC_BYTES} bytes, not {len(public)}")
    return "k" + hashlib.sha256(_ID_DOMAIN + public).hexdigest()[:ID_HEX]


def is_key_id(text: str) -> bool:
    """Whether ``text`` has the shape of a :func:`key_id` (``k`` + 20 lowercase hex digits)."""
    return (len(text) == ID_HEX + 1 and text[0] == "k"
            and all(c in "0123456789abcdef" for c in text[1:]))


class VerifyKey:
    """An Ed25519 public key; :meth:`verify` never raises on hostile input."""

    __slots__ = ("_key", "raw")

    def __init__(self, raw: bytes):
        if not isinstance(raw, bytes) or len(raw) != PUBLIC_BYTES:
            raise BadKey(f"an Ed25519 public key has {PUBLIC_BYTES} bytes")
        self.raw = raw
        self._key = Ed25519PublicKey.from_public_bytes(raw)

    @classmethod
    def from_hex(cls, text: str) -> VerifyKey:
        """The key whose 64 hex digits are ``text``; :class:`BadKey` for anything else."""
        if not isinstance(text, str) or len(text) != 2 * PUBLIC_BYTES:
            raise BadKey("a public key is 64 hex digits")
        try:
            return cls(bytes.fromhex(text))
        except ValueError as e:
            raise BadKey(f"not a public key: {e}") from None

    @property
    def hex(self) -> str:
        return self.raw.hex()

    @property
    def id(self) -> str:
        return key_id(self.raw)

    def verify(self, signature: bytes, message: bytes) -> bool:
        """Whether ``signature`` is this key's signature of ``message``."""
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            return False
        try:
            self._key.verify(signature, message)
        except InvalidSignature:
            return False
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VerifyKey) and other.raw == self.raw

    def __hash__(self) -> int:
        return hash(self.raw)

    def __repr__(self) -> str:
        return f"VerifyKey({self.id})"


class SigningKey:
    """An Ed25519 private key and its :attr:`public` half."""

    __slots__ = ("_key", "public")

    def __init__(self, key: Ed25519PrivateKey):
        self._key = key
        self.public = VerifyKey(key.public_key().public_bytes(serialization.Encoding.Raw,
                                                              serialization.PublicFormat.Raw))

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> SigningKey:
        """The key of a 32-byte seed (tests and key files; a real key comes from :meth:`generate`)."""
        if len(seed) != 32:
            raise BadKey("an Ed25519 seed has 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def seed(self) -> bytes:
        return self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                       serialization.NoEncryption())

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the key file at ``path`` with mode 0600 (created that way, never chmod-ed after)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"kind": KEY_FILE_KIND, "private": self.seed().hex(), "public": self.public.hex},
                          indent=1).encode()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if the path exists: a key is never overwritten by accident
            finally:
                os.unlink(tmp)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> SigningKey:
        """The key in the file at ``path``; :class:`BadKey` when it is malformed or others can read it."""
        path = Path(path)
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise BadKey(f"{path}: key file is accessible by others (mode {stat.S_IMODE(mode):o}); "
                            "chmod 600 it")
        if path.stat().st_size > 4096:
            raise BadKey(f"{path}: not a key file (too large)")
        try:
            doc = json.loads(path.read_text())
            if doc.get("kind") != KEY_FILE_KIND:
                raise BadKey(f"{path}: not an {KEY_FILE_KIND} key file")
            key = cls.from_seed(bytes.fromhex(doc["private"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BadKey(f"{path}: malformed key file: {e}") from None
        if doc.get("public") not in (None, key.public.hex):
            raise BadKey(f"{path}: its public key does not match its private key")
        return key

    def __repr__(self) -> str:
        return f"SigningKey({self.public.id})"
