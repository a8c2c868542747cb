"""Canonical byte strings: what is signed or MAC'd is never a re-serialized JSON document.

A message is a domain string (which protocol and version it belongs to, so a signature made for one
purpose never verifies for another) followed by its fields, each a one-byte type tag, an 8-byte
big-endian length and the field's bytes. No field can run into its neighbour, so two different
field lists never encode to the same bytes.

>>> canonical("demo/v1", "ab", 1).hex()
'64656d6f2f76310073000000000000000261626900000000000000080000000000000001'
>>> canonical("demo/v1", "a", "b") != canonical("demo/v1", "ab", "")
True
"""

from __future__ import annotations

import struct
from typing import Union

Field = Union[bytes, str, int, bool, None]

_TAGS = {bytes: b"b", str: b"s", int: b"i", bool: b"t", type(None): b"n"}


def _encode(value: Field) -> bytes:
    kind = type(value)  # exact types: a bool is not an int here, and no subclass is encoded
    if type(value) is bool:
        body = b"\1" if value else b"\0"
    elif type(value) is int:
        if not -(1 << 63) <= value < (1 << 63):
            raise ValueError(f"integer field out of int64 range: {value}")
        body = struct.pack(">q", value)
    elif type(value) is str:
        body = value.encode("utf-8")
    elif type(value) is bytes:
        body = value
    elif value is None:
        body = b""
    else:
        raise TypeError(f"cannot encode a {kind.__name__} field canonically")
    return _TAGS[kind] + struct.pack(">Q", len(body)) + body


def canonical(domain: str, *fields: Field) -> bytes:
    """The bytes of ``fields`` under ``domain`` (see the module docstring)."""
    if "\0" in domain:
        raise ValueError("a domain cannot contain NUL")
    return domain.encode("utf-8") + b"\0" + b"".join(_encode(f) for f in fields)
