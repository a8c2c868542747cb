"""Start an origin and relays as local processes (the one-machine default), stop them by PID.

Each server is ``python -m intellect.shardcast origin|relay`` in its own session (one signal stops
the process group), listening on a free port it reports through a port file. It also exits when
the process that started it dies (``--parent``), so a killed run leaves no server behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from intellect.shardcast.config import ShardcastConfig
from intellect.trust.keys import VerifyKey


class ServerProcess:
    """One server process; ``url`` is its base URL once it listens."""

    def __init__(self, role: str, data_dir: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 0,
                 extra: list[str] | None = None, log_dir: str | os.PathLike | None = None, name: str | None = None,
                 start_timeout: float = 60.0):
        data_dir = Path(data_dir)
        log_dir = Path(log_dir) if log_dir is not None else data_dir.parent
        log_dir.mkdir(parents=True, exist_ok=True)
        self.name = name or f"{role}-{data_dir.name}"
        self.port_file = log_dir / f"{self.name}.url"
        self.port_file.unlink(missing_ok=True)
        self.log_path = log_dir / f"{self.name}.log"
        self._log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "intellect.shardcast", role, "--data-dir", str(data_dir), "--host", host,
               "--port", str(port), "--port-file", str(self.port_file), "--parent", str(os.getpid()),
               *(extra or [])]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=Path(__file__).resolve().parents[2])
        self.pid = self.proc.pid
        deadline = time.monotonic() + start_timeout
        while not self.port_file.exists():
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} did not listen within {start_timeout:.0f} s; see {self.log_path}")
            time.sleep(0.02)
        self.url = self.port_file.read_text().strip()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()

    def stop(self, grace: float = 10.0) -> int | None:
        if self.alive():
            os.killpg(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(grace)
        self._log.close()
        return self.proc.returncode


@dataclass
class LocalCDN:
    """An origin and its relays on this machine."""

    origin_dir: Path
    origin: ServerProcess
    relays: list[ServerProcess] = field(default_factory=list)

    @property
    def relay_urls(self) -> list[str]:
        return [r.url for r in self.relays] or [self.origin.url]

    def stop(self) -> None:
        for p in [*self.relays, self.origin]:
            p.stop()


def start_local(cfg: ShardcastConfig, root: str | os.PathLike, trainer_key: VerifyKey | str) -> LocalCDN:
    """Origin serving ``root/origin`` and ``cfg.local_relays`` relays under ``root/relay<i>``, which
    mirror only what ``trainer_key`` (the trainer's public key, or its hex) signed."""
    root = Path(root)
    key_hex = trainer_key.hex if isinstance(trainer_key, VerifyKey) else VerifyKey.from_hex(trainer_key).hex
    origin = ServerProcess("origin", root / "origin", host=cfg.host, port=cfg.origin_port,
                           extra=["--keep", str(cfg.keep)], log_dir=root / "logs")
    cdn = LocalCDN(root / "origin", origin)
    try:
        for i in range(cfg.local_relays):
            cdn.relays.append(ServerProcess("relay", root / f"relay{i}", host=cfg.host, log_dir=root / "logs",
                                            extra=["--upstream", origin.url, "--keep", str(cfg.keep),
                                                   "--trainer-key", key_hex]))
    except BaseException:
        cdn.stop()
        raise
    return cdn
