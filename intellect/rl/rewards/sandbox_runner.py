"""Trusted code of a sandboxed run: the candidate's server and the judge (standard library only).

:mod:`intellect.rl.rewards.sandbox` runs this file's source twice, each time in its own sandbox,
with the system interpreter (``python3 -I -S -c SOURCE ROLE ...``):

* ``candidate SOCKET STATUS LIMITS`` reads the candidate's code on stdin, sets the rlimits, writes
  ``S`` on STATUS, runs the code, then answers the judge's requests on SOCKET: look up a name,
  call, get an attribute or item, take a length, iterate, ``str``/``repr``/``bool``.
* ``judge SOCKET VERDICT LIMITS`` reads the tests on stdin and runs each in its own process, where
  every name the tests do not define resolves to the candidate's through SOCKET. It writes one
  JSON line per test on VERDICT, a descriptor only it holds.

Values cross SOCKET as tagged JSON: plain data (None, bool, int, float, complex, str, bytes and
lists, tuples, dicts, sets of them, exactly those types) by value, anything else as a reference
the judge can only pass back. The candidate's process therefore decides nothing but the values it
answers with: the judge compares them with its own objects, so no frame, memory or descriptor the
candidate can reach holds the verdict, and an object with a rigged ``__eq__`` compares as itself.
"""

import builtins
import json
import os
import resource
import sys
import traceback

MAX_MESSAGE = 16 << 20
MAX_DEPTH = 64
FAILED_EXIT = 101
MEMORY_EXIT = 102  # the candidate's code ran out of memory (MemoryError at its address-space limit)
_TAGS = ("t", "d", "s", "fs", "b", "c", "i", "h")
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


class ProtocolError(Exception):
    """The other side sent something off-protocol, or is gone."""


# ------------------------------------------------------------------ messages


def send(fd, obj):
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ProtocolError("message of %d bytes, at most %d" % (len(data), MAX_MESSAGE))
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd, n):
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def recv(fd):
    """The next message, or None when the other side has closed the channel."""
    head = _read_exactly(fd, 4)
    if head is None:
        return None
    n = int.from_bytes(head, "big")
    if n > MAX_MESSAGE:
        raise ProtocolError("message of %d bytes, at most %d" % (n, MAX_MESSAGE))
    body = _read_exactly(fd, n)
    if body is None:
        return None
    try:
        return json.loads(body)
    except ValueError as exc:
        raise ProtocolError("malformed message: %s" % exc) from None


def encode(x, ref, depth=0):
    """``x`` as tagged JSON; ``ref(obj)`` names anything that is not plain data.

    >>> encode([1, (2.5, b"x"), {"k": None}], ref=lambda obj: 7)
    [1, {'t': [2.5, {'b': '78'}]}, {'d': [['k', None]]}]
    >>> encode(2 ** 70, ref=None), encode(object(), ref=lambda obj: 7)
    ({'i': '400000000000000000'}, {'h': 7})
    """
    t = type(x)
    if depth > MAX_DEPTH:
        return {"h": ref(x)}
    if t is int and not -(1 << 62) < x < 1 << 62:
        return {"i": format(x, "x")}  # hex: decimal strings this long are refused by int()
    if x is None or t in (bool, int, float, str):
        return x
    if t is bytes:
        return {"b": x.hex()}
    if t is complex:
        return {"c": [x.real, x.imag]}
    if t is list:
        return [encode(v, ref, depth + 1) for v in x]
    if t is tuple:
        return {"t": [encode(v, ref, depth + 1) for v in x]}
    if t in (set, frozenset):
        return {"s" if t is set else "fs": [encode(v, ref, depth + 1) for v in x]}
    if t is dict:
        return {"d": [[encode(k, ref, depth + 1), encode(v, ref, depth + 1)] for k, v in x.items()]}
    return {"h": ref(x)}


def decode(x, deref):
    """The inverse of :func:`encode`; ``deref(n)`` turns reference ``n`` back into an object.

    >>> decode([1, {"t": [2.5, {"b": "78"}]}, {"d": [["k", None]]}, {"i": "-ff"}], deref=None)
    [1, (2.5, b'x'), {'k': None}, -255]
    """
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    if t is list:
        return [decode(v, deref) for v in x]
    if t is not dict or len(x) != 1:
        raise ProtocolError("malformed value")
    (tag, v), = x.items()
    if tag == "h" and type(v) is int:
        return deref(v)
    if tag == "i" and type(v) is str and len(v) <= MAX_MESSAGE:
        return int(v, 16)
    if tag == "b" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "c" and type(v) is list and len(v) == 2:
        return complex(*(float(p) for p in v))
    if tag in ("t", "s", "fs") and type(v) is list:
        items = [decode(i, deref) for i in v]
        return {"t": tuple, "s": set, "fs": frozenset}[tag](items)
    if tag == "d" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
        return {decode(k, deref): decode(val, deref) for k, val in v}
    raise ProtocolError("malformed value")


def _apply_limits(spec):
    for name, (soft, hard) in json.loads(spec).items():
        kind = resource.getrlimit(getattr(resource, name))[1]
        if kind != resource.RLIM_INFINITY:
            soft, hard = min(soft, kind), min(hard, kind)
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _read_stdin():
    data = sys.stdin.buffer.read()
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return data


def _one_line(exc):
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[:500]


# ------------------------------------------------------------------ the candidate's side


def candidate(sock, status, limits):
    code = _read_stdin().decode("utf-8", "replace")
    _apply_limits(limits)
    os.write(status, b"S")
    os.close(status)
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<solution>", "exec"), scope)
    except BaseException as exc:  # noqa: BLE001 - the candidate's code may raise anything, SystemExit included
        status = MEMORY_EXIT if isinstance(exc, MemoryError) else FAILED_EXIT
        scope.clear()  # what the code allocated goes, so that reporting it does not run out of memory too
        exc = exc.with_traceback(None)
        try:
            line = "FAILED <solution>: %s" % _one_line(exc)
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            send(sock, {"error": line})
        finally:
            os._exit(status)
    sys.stdout.flush()
    refs, ids = {}, {}

    def ref(obj):
        key = id(obj)
        if key not in ids:
            ids[key] = len(refs)
            refs[len(refs)] = obj
        return ids[key]

    def deref(n):
        return refs[n]

    def name(n):
        if n not in scope:
            raise NameError(n)
        return scope[n]

    ops = {
        "name": name,
        "call": lambda f, args, kwargs: f(*args, **kwargs),
        "getattr": getattr,
        "getitem": lambda obj, key: obj[key],
        "contains": lambda obj, item: item in obj,
        "len": len,
        "iter": iter,
        "next": next,
        "str": str,
        "repr": repr,
        "bool": bool,
    }
    send(sock, {"ready": True})
    while True:
        req = recv(sock)
        if req is None:
            sys.stdout.flush()
            os._exit(0)
        try:
            result = {"ok": encode(ops[req["op"]](*decode(req["args"], deref)), ref)}
        except BaseException as exc:  # noqa: BLE001 - whatever an operation raises goes back to the caller
            result = {"raise": [type(exc).__name__, _message(exc)]}
        try:
            send(sock, result)
        except ProtocolError as exc:
            send(sock, {"raise": ["MemoryError", str(exc)]})


def _message(exc):
    try:
        return str(exc)[:500]
    except BaseException:  # noqa: BLE001 - str() of a hostile exception may raise anything
        return "<unprintable>"


# ------------------------------------------------------------------ the judge's side


class RemoteError(Exception):
    """An exception the candidate raised whose type the judge does not share."""


class _Channel:
    def __init__(self, sock):
        self.sock, self.gone, self.ended, self.proxies = sock, None, False, {}

    def call(self, op, *args):
        if self.gone:
            raise ProtocolError(self.gone)
        request = {"op": op, "args": encode(list(args), self._ref_of)}
        try:
            send(self.sock, request)  # a request over the size bound raises before a byte is sent
            reply = self._reply()
        except OSError as exc:
            reply, self.gone = None, "the candidate's channel failed: %s" % exc
        if reply is None:
            self.gone, self.ended = self.gone or "the candidate's process ended", True
            raise ProtocolError(self.gone)
        if type(reply) is dict and len(reply) == 1 and "ok" in reply:
            return decode(reply["ok"], self._proxy)
        if type(reply) is dict and len(reply) == 1 and type(reply.get("raise")) is list and len(reply["raise"]) == 2:
            name, message = (str(p)[:200] for p in reply["raise"])
            cls = getattr(builtins, name, None)
            if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == "builtins":
                raise cls(message)
            raise RemoteError("%s: %s" % (name, message))
        self.gone = "the candidate broke the protocol"
        raise ProtocolError(self.gone)

    def _reply(self):
        try:
            return recv(self.sock)
        except ProtocolError as exc:
            self.gone = "the candidate broke the protocol: %s" % exc
            raise ProtocolError(self.gone) from None

    def _ref_of(self, obj):
        if type(obj) is Remote and object.__getattribute__(obj, "_channel") is self:
            return object.__getattribute__(obj, "_ref")
        raise TypeError("only plain data and the candidate's own objects can be passed to it, not %s"
                        % type(obj).__name__)

    def _proxy(self, n):
        if n not in self.proxies:
            self.proxies[n] = Remote(self, n)
        return self.proxies[n]


class Remote:
    """One of the candidate's objects, seen from the judge; it compares and hashes as itself."""

    __slots__ = ("_channel", "_ref")

    def __init__(self, channel, ref):
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_ref", ref)

    def _do(self, op, *args):
        return object.__getattribute__(self, "_channel").call(op, self, *args)

    def __call__(self, *args, **kwargs):
        return self._do("call", list(args), kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._do("getattr", name)

    def __getitem__(self, key):
        return self._do("getitem", key)

    def __contains__(self, item):
        return _typed(self._do("contains", item), bool, "in")

    def __len__(self):
        return _typed(self._do("len"), int, "len()")

    def __bool__(self):
        return _typed(self._do("bool"), bool, "bool()")

    def __iter__(self):
        it = self._do("iter")
        while True:
            try:
                yield it._do("next")
            except StopIteration:
                return

    def __str__(self):
        return _typed(self._do("str"), str, "str()")

    def __repr__(self):
        return _typed(self._do("repr"), str, "repr()")


def _typed(value, t, what):
    if type(value) is not t:
        raise TypeError("%s of a candidate object gave %s, not %s" % (what, type(value).__name__, t.__name__))
    return value


class _Names(dict):
    """The tests' builtins: the real ones first, then the candidate's names, looked up at each use."""

    def __init__(self, channel):
        super().__init__(vars(builtins))
        self.channel = channel

    def __missing__(self, name):
        try:
            return self.channel.call("name", name)
        except NameError:
            raise KeyError(name) from None


def judge(sock, verdict, limits):
    tests = json.loads(_read_stdin())
    _apply_limits(limits)
    out = os.fdopen(verdict, "w", buffering=1)
    os.dup2(2, 1)  # what the tests print goes to stderr, never into the verdict

    def emit(**kw):
        out.write(json.dumps(kw) + "\n")

    emit(started=True)
    channel = _Channel(sock)
    try:
        first = recv(sock)
    except ProtocolError as exc:
        first = {"error": "the candidate broke the protocol: %s" % exc}
    if first != {"ready": True}:
        if type(first) is dict and type(first.get("error")) is str:
            channel.gone, channel.ended = first["error"][:600], True  # its process exits after saying so
        else:
            channel.gone = "the candidate's process ended before its code finished"
            channel.ended = first is None
    scope = {"__name__": "__main__", "__builtins__": _Names(channel)}
    for i, src in enumerate(tests, 1):
        name = "<test %d>" % i
        if channel.gone:
            emit(test=i, ok=False, why="FAILED %s: %s" % (name, channel.gone))
            continue
        try:
            exec(compile(src, name, "exec"), scope)
        except BaseException as exc:  # noqa: BLE001 - a test may raise anything, SystemExit included
            emit(test=i, ok=False, why="FAILED %s: %s" % (name, _one_line(exc)))
        else:
            emit(test=i, ok=True)
    emit(done=True, ended=channel.ended)
    out.close()
    os._exit(0)


if __name__ == "__main__":
    role, fd, other, spec = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    (candidate if role == "candidate" else judge)(fd, other, spec)
