"""Run storage: one run's files on local disk or S3, written so readers never see half of anything.

A run lives at a URL: ``file://PATH`` (or a bare path; relative paths are resolved against the
working directory once, at construction) or ``s3://BUCKET/PREFIX`` through s3fs. Inside it,
step-indexed artifacts sit in ``<kind>/step_<n>/`` folders, e.g. ``checkpoints/step_3/``.

The contract:

* **Every file write is atomic.** On local disk the bytes go to a ``.tmp-*`` file in the target
  folder, are fsynced, then ``os.replace``-d over the final name (and the folder is fsynced, so the
  rename survives a power cut in order). On S3 every file is one object (a single PUT, or a
  multipart upload that only becomes visible when completed), which S3 publishes all at once. A
  reader sees the old content, the new content, or nothing, never a prefix. ``.tmp-*`` names are
  reserved and hidden from every listing.
* **A step is complete once its ``STABLE`` marker exists, and ``STABLE`` is written last**, after
  every other file of the step. Readers must only trust steps listed by :meth:`complete_steps`;
  a writer that crashes mid-step leaves no ``STABLE``, so its step stays invisible and is
  overwritten by a retry or deleted by :meth:`RunStorage.retain` once newer steps are complete.
* ``STABLE`` holds JSON: ``{"step", "kind", "time" (UTC ISO 8601), "files": {relpath: size}}``,
  so a reader can check what it downloaded.
* Retention deletes ``STABLE`` before anything else of a step, so a step being deleted stops
  being listed as complete first.

Credentials for S3 come from the arguments (or :class:`~intellect.config.StorageConfig`), else
from ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, else botocore's own chain.
Every S3 call has a connect and read timeout and a bounded number of retries.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Mapping, cast

import fsspec

if TYPE_CHECKING:
    from intellect.config import StorageConfig

STABLE = "STABLE"
TMP_PREFIX = ".tmp-"
_STEP_RE = re.compile(r"step_(0|[1-9][0-9]*)")
_GLOB_CHARS = set("*?[]")


def split_url(url: str) -> tuple[str, str]:
    """Split a run URL into ``(scheme, path)``; bare paths are ``file``.

    >>> split_url("s3://bucket/runs/"), split_url("file:///tmp/runs"), split_url("runs/a")
    (('s3', 'bucket/runs'), ('file', '/tmp/runs'), ('file', 'runs/a'))
    >>> split_url("gs://bucket")
    Traceback (most recent call last):
    ...
    ValueError: unsupported storage URL 'gs://bucket': use file://PATH, s3://BUCKET/PREFIX or a plain path
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
    if scheme not in ("file", "s3"):
        raise ValueError(f"unsupported storage URL {url!r}: use file://PATH, s3://BUCKET/PREFIX or a plain path")
    rest = rest.rstrip("/") if scheme == "s3" else rest
    if not rest or (scheme == "s3" and rest.startswith("/")):
        raise ValueError(f"storage URL {url!r} has no {'bucket' if scheme == 's3' else 'path'}")
    return scheme, rest


def normalize_rel(rel: str, *, allow_empty: bool = False) -> str:
    """Check a path relative to the run root and return it in canonical ``a/b`` form.

    Absolute paths, ``..``, glob characters (fsspec would expand them) and the reserved
    ``.tmp-`` prefix raise ``ValueError``; ``.`` and repeated slashes are dropped.

    >>> normalize_rel("checkpoints//step_3/./model.safetensors")
    'checkpoints/step_3/model.safetensors'
    >>> normalize_rel("../other_run")
    Traceback (most recent call last):
    ...
    ValueError: path '../other_run' escapes the run root
    """
    if not isinstance(rel, str):
        raise TypeError(f"relative path must be a str, got {type(rel).__name__}")
    if rel.startswith("/") or "\\" in rel:
        raise ValueError(f"path {rel!r} must be relative to the run root, with / separators")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    for p in parts:
        if p == "..":
            raise ValueError(f"path {rel!r} escapes the run root")
        if p.startswith(TMP_PREFIX):
            raise ValueError(f"path {rel!r}: names starting with {TMP_PREFIX!r} are reserved")
        if _GLOB_CHARS & set(p):
            raise ValueError(f"path {rel!r}: characters {''.join(sorted(_GLOB_CHARS))} are not allowed")
    if not parts and not allow_empty:
        raise ValueError("path must not be empty")
    return "/".join(parts)


def step_name(step: int) -> str:
    """The folder name of ``step``, read back by :func:`parse_step`.

    >>> step_name(3), parse_step(step_name(0))
    ('step_3', 0)
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"step_{step}"


def parse_step(name: str) -> int | None:
    """The step number of a :func:`step_name`, else ``None`` (no sign, spaces or leading zeros).

    >>> parse_step("step_12"), parse_step("step_0"), parse_step("step_012"), parse_step(".tmp-step_3")
    (12, 0, None, None)
    """
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def env_first(*names: str) -> str | None:
    for n in names:
        if os.environ.get(n):
            return os.environ[n]
    return None


def _is_hidden(rel: str) -> bool:
    return any(p.startswith(TMP_PREFIX) for p in rel.split("/"))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


@contextmanager
def _atomic_local(path: str) -> Iterator[str]:
    """Yield a temp path beside ``path`` to fill; on success fsync it and rename it over ``path``."""
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=parent)
    os.close(fd)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(parent)


class RunStorage:
    """The files of one run, rooted at ``url``. See the module docstring for the guarantees."""

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        key: str | None = None,
        secret: str | None = None,
        region: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
    ) -> None:
        """Open the run at ``url``; nothing is created until the first write.

        S3 only: credentials and endpoint as in the module docstring; each request gets
        ``timeout`` seconds to connect and per read, and botocore's ``retries`` attempts inside
        s3fs's ``retries`` tries, so a dead endpoint fails in bounded time.
        """
        if not timeout > 0 or retries < 1:
            raise ValueError(f"need timeout > 0 and retries >= 1 (got {timeout}, {retries})")
        scheme, path = split_url(url)
        self.scheme = scheme
        if scheme == "file":
            self._root = os.path.abspath(os.path.expanduser(path))
            self.url = "file://" + self._root
            self.fs = fsspec.filesystem("file")
        else:
            bucket, _, prefix = path.partition("/")
            prefix = normalize_rel(prefix, allow_empty=True)
            self._root = f"{bucket}/{prefix}" if prefix else bucket
            self.url = "s3://" + self._root
            self.fs = self._s3(endpoint_url, key, secret, region, timeout, retries)

    @staticmethod
    def _s3(endpoint_url, key, secret, region, timeout, retries):
        import s3fs  # noqa: PLC0415 - only S3 runs pay for aiobotocore

        region = region or env_first("AWS_REGION", "AWS_DEFAULT_REGION")
        fs = s3fs.S3FileSystem(
            endpoint_url=endpoint_url or env_first("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
            key=key or env_first("AWS_ACCESS_KEY_ID"),
            secret=secret or env_first("AWS_SECRET_ACCESS_KEY"),
            client_kwargs={"region_name": region} if region else {},
            config_kwargs={
                "connect_timeout": timeout,
                "read_timeout": timeout,
                "retries": {"total_max_attempts": retries, "mode": "standard"},
            },
            # fsspec caches instances by arguments and listings by path: a new endpoint in the
            # same process must get a new client, and another process's new steps must be seen.
            skip_instance_cache=True,
            use_listings_cache=False,
        )
        fs.retries = retries  # s3fs's own retry loop around each call; a class attribute, not a kwarg
        return fs

    @classmethod
    def from_config(cls, cfg: StorageConfig, run_name: str) -> RunStorage:
        """The run ``run_name`` under ``cfg.url`` (default ``file://./runs/<run_name>``)."""
        name = normalize_rel(run_name)
        if "/" in name:
            raise ValueError(f"run name {run_name!r} must be a single path component")
        return cls(
            cfg.url.rstrip("/") + "/" + name,
            endpoint_url=cfg.endpoint_url,
            key=cfg.key,
            secret=cfg.secret.get_secret_value() if cfg.secret else None,
            region=cfg.region,
        )

    def __repr__(self) -> str:
        return f"RunStorage({self.url!r})"

    # ------------------------------------------------------------------ paths

    def _path(self, rel: str, *, allow_empty: bool = False) -> str:
        rel = normalize_rel(rel, allow_empty=allow_empty)
        return f"{self._root}/{rel}" if rel else self._root

    def uri(self, rel: str) -> str:
        """Full URL of ``rel``, e.g. ``s3://bucket/runs/smoke/checkpoints/step_3``."""
        rel = normalize_rel(rel, allow_empty=True)
        return f"{self.url}/{rel}" if rel else self.url

    def local_path(self, rel: str) -> Path | None:
        """``rel`` as a path on this machine (local storage), else None."""
        return Path(self._path(rel, allow_empty=True)) if self._local else None

    @property
    def _local(self) -> bool:
        return self.scheme == "file"

    # ------------------------------------------------------------------ files

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Atomically create or replace ``rel`` with ``data``."""
        path = self._path(rel)
        if self._local:
            with _atomic_local(path) as tmp, open(tmp, "wb") as f:
                f.write(data)
        else:
            self.fs.pipe_file(path, data)

    def write_text(self, rel: str, text: str, encoding: str = "utf-8") -> None:
        self.write_bytes(rel, text.encode(encoding))

    def read_bytes(self, rel: str, max_bytes: int | None = None) -> bytes:
        """The whole content of ``rel``; ``FileNotFoundError`` if absent. With ``max_bytes``, a larger file
        raises ValueError after at most ``max_bytes + 1`` bytes were read (a file others may write)."""
        # fsspec is untyped and pyright's inference of cat_file lets in str; it returns the bytes
        if max_bytes is None:
            return cast(bytes, self.fs.cat_file(self._path(rel)))
        data = cast(bytes, self.fs.cat_file(self._path(rel), start=0, end=max_bytes + 1))
        if len(data) > max_bytes:
            raise ValueError(f"{self.uri(rel)} is over {max_bytes} bytes")
        return data

    def read_text(self, rel: str, encoding: str = "utf-8") -> str:
        return self.read_bytes(rel).decode(encoding)

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` is a file or a folder (on S3 only non-empty folders exist)."""
        return self.fs.exists(self._path(rel, allow_empty=True))

    def listdir(self, rel: str = "") -> list[str]:
        """Sorted names directly under ``rel`` (files and folders); ``[]`` if it does not exist."""
        path = self._path(rel, allow_empty=True)
        try:
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != path}
        return sorted(n for n in names if n and not n.startswith(TMP_PREFIX))

    def delete(self, rel: str, recursive: bool = False) -> None:
        """Delete a file, or a folder and everything in it with ``recursive=True``."""
        path = self._path(rel)
        if not self.fs.exists(path):
            raise FileNotFoundError(self.uri(rel))
        if not recursive and self.fs.isdir(path):
            # s3fs would silently delete nothing here, fsspec's local fs raises a ValueError
            raise IsADirectoryError(f"{self.uri(rel)} is a folder: pass recursive=True")
        self.fs.rm(path, recursive=recursive)

    def put_file(self, local_path: str | os.PathLike, rel: str) -> None:
        """Atomically upload a local file to ``rel``, streamed (never read whole into memory)."""
        path = self._path(rel)
        if self._local:
            with _atomic_local(path) as tmp:
                shutil.copyfile(local_path, tmp)
        else:
            self.fs.put_file(os.fspath(local_path), path)

    def get_file(self, rel: str, local_path: str | os.PathLike) -> None:
        """Atomically download ``rel`` to ``local_path`` (temp file beside it, then rename)."""
        src = self._path(rel)
        with _atomic_local(os.path.abspath(local_path)) as tmp:
            if self._local:
                shutil.copyfile(src, tmp)
            else:
                self.fs.get_file(src, tmp)

    def _files_under(self, path: str) -> dict[str, int]:
        """``{relpath: size}`` of every visible file below ``path``."""
        try:
            found = self.fs.find(path, detail=True)
        except FileNotFoundError:
            return {}
        if not isinstance(found, dict):  # detail=True: {path: info}
            raise TypeError(f"{type(self.fs).__name__}.find(detail=True) gave a {type(found).__name__}")
        out = {}
        for p, info in found.items():
            if info.get("type", "file") != "file" or not p.startswith(path + "/"):
                continue
            rel = p[len(path) + 1 :]
            if not _is_hidden(rel):
                out[rel] = int(info["size"])
        return dict(sorted(out.items()))

    def put_dir(self, local_dir: str | os.PathLike, rel: str) -> list[str]:
        """Upload every file below ``local_dir`` to ``rel``, each atomically; returns the relpaths.

        The folder as a whole is not atomic: publish it with a ``STABLE`` marker.
        """
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise NotADirectoryError(str(local_dir))
        base = normalize_rel(rel)
        files = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())
        for name in files:
            normalize_rel(f"{base}/{name}")  # fail before uploading anything
        if self._local:
            for name in files:
                self.put_file(local_dir / name, f"{base}/{name}")
        elif files:
            # one call so s3fs uploads concurrently; each file is still its own object
            self.fs.put([str(local_dir / n) for n in files], [self._path(f"{base}/{n}") for n in files])
        return files

    def get_dir(self, rel: str, local_dir: str | os.PathLike) -> list[str]:
        """Download the folder ``rel`` into ``local_dir``, which appears complete or not at all.

        Files are assembled in a ``.tmp-*`` sibling folder and renamed into place; an existing
        ``local_dir`` is replaced. Returns the relpaths. ``FileNotFoundError`` if ``rel`` is empty.
        """
        src = self._path(rel)
        files = self._files_under(src)
        if not files:
            raise FileNotFoundError(f"no files under {self.uri(rel)}")
        dest = Path(local_dir).absolute()
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=dest.parent))
        try:
            lpaths = [tmp / name for name in files]
            for lp in lpaths:
                lp.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get([f"{src}/{n}" for n in files], [str(lp) for lp in lpaths])
            for lp in lpaths:
                _fsync_file(str(lp))
            old = None
            if dest.exists():
                # rename() cannot replace a non-empty folder: move the old one aside first
                old = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=dest.parent)) / "old"
                dest.rename(old)
            tmp.rename(dest)
            _fsync_dir(str(dest.parent))
            if old is not None:
                shutil.rmtree(old.parent, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return list(files)

    # ------------------------------------------------------------------ steps

    def step_path(self, step: int, kind: str) -> str:
        """``kind/step_<step>``, e.g. ``step_path(3, "checkpoints") == "checkpoints/step_3"``."""
        return f"{normalize_rel(kind)}/{step_name(step)}"

    def mark_stable(self, step: int, kind: str) -> dict:
        """Publish a step: write its ``STABLE`` marker, listing its files and sizes. Call last."""
        rel = self.step_path(step, kind)
        files = self._files_under(self._path(rel))
        files.pop(STABLE, None)
        if not files:
            raise FileNotFoundError(f"step {self.uri(rel)} has no files to mark stable")
        info = {
            "step": step,
            "kind": normalize_rel(kind),
            "time": datetime.now(timezone.utc).isoformat(),
            "files": files,
        }
        self.write_text(f"{rel}/{STABLE}", json.dumps(info, indent=1) + "\n")
        return info

    def is_stable(self, step: int, kind: str) -> bool:
        return self.fs.exists(self._path(f"{self.step_path(step, kind)}/{STABLE}"))

    def _all_steps(self, kind: str) -> list[int]:
        steps = (parse_step(n) for n in self.listdir(normalize_rel(kind)))
        return sorted(s for s in steps if s is not None)

    def complete_steps(self, kind: str) -> list[int]:
        """Sorted steps of ``kind`` that have ``STABLE``: the only ones readers may use."""
        return [s for s in self._all_steps(kind) if self.is_stable(s, kind)]

    def latest_step(self, kind: str) -> int | None:
        """The newest complete step of ``kind``, or ``None``."""
        complete = self.complete_steps(kind)
        return complete[-1] if complete else None

    def drop_step(self, step: int, kind: str) -> str:
        """Delete step ``step`` of ``kind``, published or not: ``STABLE`` first (no reader takes it for
        complete while the rest goes), then the folder; its path."""
        rel = self.step_path(step, kind)
        if self.is_stable(step, kind):
            self.fs.rm(self._path(f"{rel}/{STABLE}"))
        if self.fs.exists(self._path(rel)):
            self.fs.rm(self._path(rel), recursive=True)
        return rel

    def retain(self, kind: str, keep: int) -> list[int]:
        """Keep the newest ``keep`` complete steps; delete the rest and return them, sorted.

        Steps without ``STABLE`` older than the oldest kept step are crash leftovers and are
        deleted; newer ones may still be being written and are left alone. With no complete
        step nothing is deleted.
        """
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        all_steps = self._all_steps(kind)
        complete = [s for s in all_steps if self.is_stable(s, kind)]
        if not complete:
            return []
        kept = set(complete[-keep:])
        oldest_kept = min(kept)
        doomed = [s for s in all_steps if s not in kept and (s in complete or s < oldest_kept)]
        for s in doomed:
            self.drop_step(s, kind)
        return doomed

    def write_step(self, step: int, kind: str, files: Mapping[str, bytes | os.PathLike]) -> dict:
        """Write a whole step: each file (bytes, a local file or a local folder), then ``STABLE``.

        A step that is already stable is never rewritten (``FileExistsError``): readers may be
        using it. An incomplete one (a crashed attempt) is written over. Returns the marker info.
        """
        rel = self.step_path(step, kind)
        if self.is_stable(step, kind):
            raise FileExistsError(f"step {self.uri(rel)} is already stable")
        names = {name: normalize_rel(name) for name in files}
        if STABLE in names.values():
            raise ValueError(f"{STABLE!r} is written by mark_stable, not passed as a file")
        for name, content in files.items():
            target = f"{rel}/{names[name]}"
            if isinstance(content, (bytes, bytearray, memoryview)):
                self.write_bytes(target, bytes(content))
            elif isinstance(content, os.PathLike):
                if os.path.isdir(content):
                    self.put_dir(content, target)
                else:
                    self.put_file(content, target)
            else:
                raise TypeError(f"file {name!r}: expected bytes or a local Path, got {type(content).__name__}")
        return self.mark_stable(step, kind)
