"""A memory cgroup of its own for each sandboxed candidate, where the host lets the validator make one.

The kernel then bounds the memory of all the candidate's processes together (``memory.max`` on
cgroup v2, ``memory.limit_in_bytes`` on a v1 memory hierarchy, swap included where it is
accounted); tmpfs pages and kernel memory the candidate causes are charged to it too. An
allocation past the bound ends in the kernel's OOM kill inside that cgroup, which
:meth:`MemoryCgroup.oom_kills` reports.

Where the cgroup goes (:func:`cgroup_parent`): a configured cgroup v2 directory (delegated to the
validator, with ``memory`` in its ``cgroup.subtree_control``), else the validator's own memory
cgroup when it may have children that limit memory: on v1 that is any writable one; on v2 only
one that already enables ``memory`` for its children (the validator cannot enable it in its own
cgroup while it lives there). A host without either (a container whose ``/sys/fs/cgroup`` is
read-only, say) gets ``None``, and the sandbox falls back to rlimits alone.

A process is moved into the cgroup before it starts anything: :data:`GATE` holds it in a shell
until the parent has written its pid, so bwrap and everything it forks start inside.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GATE", "CgroupParent", "MemoryCgroup", "cgroup_parent"]

#: Prepended to a command: waits for one line on stdin (the parent writes it once the process is
#: in its cgroup), then becomes the command.
GATE = ["/bin/sh", "-c", 'read -r _ && exec "$0" "$@"']

_names = itertools.count()
_probed: dict[str, CgroupParent | None] = {}
_probe_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class CgroupParent:
    """A cgroup directory under which runs get children that limit memory."""

    path: Path
    version: int  # 1 or 2

    def create(self, limit_bytes: int) -> MemoryCgroup:
        """A new child cgroup limited to ``limit_bytes`` of memory (swap included); ``OSError`` if refused."""
        path = self.path / f"intellect-sandbox-{os.getpid()}-{next(_names)}"
        path.mkdir()
        group = MemoryCgroup(path, self.version)
        try:
            if not (path / "cgroup.procs").exists():  # the kernel makes it in every cgroup
                raise NotADirectoryError(f"{self.path} is not a cgroup")
            if self.version == 2:
                _write(path / "memory.max", limit_bytes)
                if (path / "memory.swap.max").exists():
                    _write(path / "memory.swap.max", 0)
            else:
                _write(path / "memory.limit_in_bytes", limit_bytes)
                if (path / "memory.memsw.limit_in_bytes").exists():  # after the memory limit: it may not be lower
                    _write(path / "memory.memsw.limit_in_bytes", limit_bytes)
        except OSError:
            group.remove()
            raise
        return group


class MemoryCgroup:
    """One run's cgroup (see the module docstring)."""

    def __init__(self, path: Path, version: int) -> None:
        self.path, self.version = path, version

    def add(self, pid: int) -> None:
        _write(self.path / "cgroup.procs", pid)

    def oom_kills(self) -> int:
        """Processes the kernel killed in this cgroup for its memory limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            lines = (self.path / name).read_text().splitlines()
        except OSError:
            return 0
        return sum(int(v) for k, v in (line.split() for line in lines if line.strip()) if k == "oom_kill")

    def remove(self) -> None:
        """Kill whatever is left in the cgroup and remove it (best effort: it may be busy for a moment)."""
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                self._kill_all()
                time.sleep(0.02)

    def _kill_all(self) -> None:
        if self.version == 2 and (self.path / "cgroup.kill").exists():
            _write(self.path / "cgroup.kill", 1, quiet=True)
            return
        try:
            pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def cgroup_parent(configured: str | None = None) -> CgroupParent | None:
    """Where runs' cgroups go on this host (module docstring), probed once; ``None``: rlimits only."""
    key = configured or ""
    with _probe_lock:
        if key not in _probed:
            _probed[key] = _probe(Path(configured)) if configured else _probe_own()
        return _probed[key]


def _probe(path: Path) -> CgroupParent | None:
    version = 2 if (path / "cgroup.controllers").exists() else 1
    if version == 2 and "memory" not in _words(path / "cgroup.subtree_control"):
        return None
    parent = CgroupParent(path, version)
    try:
        parent.create(64 << 20).remove()
    except OSError:
        return None
    return parent


def _probe_own() -> CgroupParent | None:
    mounts = _mounts()
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, own = line.split(":", 2)
        if controllers == "" and "cgroup2" in mounts:  # v2: only where memory is enabled for children
            found = _probe(_under(mounts["cgroup2"], own))
        elif "memory" in controllers.split(",") and "memory" in mounts:
            found = _probe(_under(mounts["memory"], own))
        else:
            continue
        if found is not None:
            return found
    return None


def _mounts() -> dict[str, tuple[Path, str]]:
    """``cgroup2`` and ``memory`` (v1) mount points with the cgroup path each one's root shows."""
    out: dict[str, tuple[Path, str]] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        pre, _, post = line.partition(" - ")
        fields, (fstype, _source, options) = pre.split(), (post.split() + ["", "", ""])[:3]
        if fstype == "cgroup2":
            out.setdefault("cgroup2", (Path(fields[4]), fields[3]))
        elif fstype == "cgroup" and "memory" in options.split(","):
            out.setdefault("memory", (Path(fields[4]), fields[3]))
    return out


def _under(mount: tuple[Path, str], own: str) -> Path:
    point, root = mount
    rel = os.path.relpath(own, root) if own.startswith(root) else own
    return point if rel in (".", "/") else point / rel.lstrip("/")


def _words(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


def _write(path: Path, value: int, *, quiet: bool = False) -> None:
    try:
        path.write_text(f"{value}\n")
    except OSError:
        if not quiet:
            raise
