"""SHA-256 that stops at a 64-byte boundary and resumes there: one hash pass checks a shard and the whole.

SHA-256 runs over 64-byte blocks, carrying eight 32-bit words (the *chaining value*) from block to
block; the digest is the chaining value after the padded last block. The origin publishes, for
each shard, the chaining value of the whole blob right after that shard (``ShardEntry.chain``).
A receiver then checks shard ``i`` on its own, as soon as it arrives: start from the chaining value
after shard ``i-1`` (SHA-256's initial value for shard 0), hash the shard's bytes, and compare
with shard ``i``'s value. A shard that matches is exactly the bytes the origin hashed (a mismatch
would be a SHA-256 collision), and when every shard matches, the whole blob's SHA-256 is the last
chaining value finished with the padding block: the whole-checkpoint check costs no second pass
over the bytes, which a plain per-shard SHA-256 plus a whole-file SHA-256 would need.

Python's :mod:`hashlib` cannot resume from a chaining value, so :class:`ChainedSha256` calls
OpenSSL's SHA-256 (the ``libcrypto`` :mod:`hashlib` itself uses, with its SHA-NI/AVX code and the
GIL released) on a context it can read and set. Where that library or its ``SHA256_*`` calls are
missing, :data:`AVAILABLE` is False: the origin then publishes no chaining values and receivers
fall back to the per-shard SHA-256 plus a whole-file pass.

>>> data = bytes(range(256)) * 3                       # a blob of two shards: 512 + 256 bytes
>>> h = ChainedSha256(); h.update(data[:512]); c = h.chain()
>>> tail = ChainedSha256(c, 512); tail.update(data[512:])    # shard 1 checked on its own
>>> tail.hexdigest() == hashlib.sha256(data).hexdigest()
True
>>> ChainedSha256().chain() == INITIAL, h.length, tail.length
(True, 512, 768)
"""

from __future__ import annotations

import ctypes
import hashlib

#: SHA-256's initial chaining value (FIPS 180-4, 5.3.3), as :meth:`ChainedSha256.chain` spells it.
INITIAL = "6a09e667bb67ae853c6ef372a54ff53a510e527f9b05688c1f83d9ab5be0cd19"
BLOCK = 64


class _Ctx(ctypes.Structure):
    # OpenSSL's SHA256_CTX (include/openssl/sha.h, unchanged since 0.9.8): state words, bit count
    # (low, high), the partial block, its byte count, digest length
    _fields_ = [("h", ctypes.c_uint32 * 8), ("Nl", ctypes.c_uint32), ("Nh", ctypes.c_uint32),
                ("data", ctypes.c_uint32 * 16), ("num", ctypes.c_uint32), ("md_len", ctypes.c_uint32)]


class _PyBuffer(ctypes.Structure):
    # CPython's Py_buffer: the address of any bytes-like object, read-only ones included, without a copy
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]


def _load():
    for name in ("libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so", "libcrypto.dylib"):
        try:
            lib = ctypes.CDLL(name)  # CDLL (not PyDLL): every call releases the GIL
            init, update, final = lib.SHA256_Init, lib.SHA256_Update, lib.SHA256_Final
        except (OSError, AttributeError):
            continue
        init.argtypes = [ctypes.POINTER(_Ctx)]
        update.argtypes = [ctypes.POINTER(_Ctx), ctypes.c_void_p, ctypes.c_size_t]
        final.argtypes = [ctypes.c_char_p, ctypes.POINTER(_Ctx)]
        return init, update, final
    return None


_LIB = _load()


class ChainedSha256:
    """SHA-256 of a blob from byte ``offset`` on, given the chaining value ``chain`` there (None:
    from the start). ``offset`` must be a multiple of 64; the state is readable again wherever the
    bytes hashed so far end on a 64-byte boundary (:meth:`chain`)."""

    def __init__(self, chain: str | None = None, offset: int = 0):
        if _LIB is None:
            raise RuntimeError("no OpenSSL SHA256_* calls in this process (chain.AVAILABLE is False)")
        if offset % BLOCK or offset < 0 or (chain is None and offset):
            raise ValueError(f"resume needs a chaining value at a 64-byte boundary (offset {offset}, chain {chain})")
        self._lib = _LIB  # checked above: the SHA256_Init, _Update and _Final calls
        self._ctx = _Ctx()
        self._lib[0](ctypes.byref(self._ctx))
        if chain is not None:
            words = bytes.fromhex(chain)
            if len(words) != 32:
                raise ValueError(f"a chaining value is 64 hex digits, got {chain!r}")
            self._ctx.h[:] = [int.from_bytes(words[i:i + 4], "big") for i in range(0, 32, 4)]
            bits = offset * 8
            self._ctx.Nl, self._ctx.Nh = bits & 0xFFFFFFFF, bits >> 32
        self.length = offset

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = _PyBuffer()
        _get_buffer(data, ctypes.byref(view), 0)  # 0: PyBUF_SIMPLE, a contiguous run of bytes
        try:
            if view.len:
                self._lib[1](ctypes.byref(self._ctx), view.buf, view.len)
                self.length += view.len
        finally:
            _release_buffer(ctypes.byref(view))

    def chain(self) -> str | None:
        """The chaining value after the bytes so far, or None where they end mid-block."""
        if self.length % BLOCK:
            return None
        return "".join(f"{w:08x}" for w in self._ctx.h)

    def hexdigest(self) -> str:
        """SHA-256 of the whole blob so far (hashing may go on afterwards)."""
        done = _Ctx.from_buffer_copy(self._ctx)
        out = ctypes.create_string_buffer(32)
        self._lib[2](out, ctypes.byref(done))
        return out.raw.hex()


def _works() -> bool:
    # the struct layout is OpenSSL's private business: prove it on a known blob before trusting it
    if _LIB is None:
        return False
    blob = bytes(range(200)) * 7
    try:
        head = ChainedSha256()
        head.update(blob[:640])
        tail = ChainedSha256(head.chain(), 640)
        tail.update(memoryview(blob)[640:])
        return head.hexdigest() == hashlib.sha256(blob[:640]).hexdigest() and \
            tail.hexdigest() == hashlib.sha256(blob).hexdigest()
    except (OSError, ValueError):
        return False


#: Whether :class:`ChainedSha256` works in this process.
AVAILABLE = _works()


def whole_hasher():
    """A hasher of a whole blob: :class:`ChainedSha256` where available, else hashlib's (no :meth:`chain`)."""
    return ChainedSha256() if AVAILABLE else _Plain()


class _Plain:
    def __init__(self):
        self._h = hashlib.sha256()

    def update(self, data) -> None:
        self._h.update(data)

    def chain(self) -> None:
        return None

    def hexdigest(self) -> str:
        return self._h.hexdigest()
