"""``intellect worker`` as a process: routed without Prefect, and a refusal exit code when its service
is unreachable."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from intellect.rl.worker.worker import main
from intellect.trust.keys import SigningKey

ROOT = Path(__file__).resolve().parents[2]


def test_the_cli_routes_worker_without_prefect(tmp_path):
    """``intellect worker keygen`` through ``flows.cli`` in a fresh process, which never imports Prefect."""
    code = ("import sys; from flows.cli import main; rc = main(['worker', 'keygen', '--out', sys.argv[1]]); "
            "assert 'prefect' not in sys.modules, 'the worker imported Prefect'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "k.key")], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert SigningKey.load(tmp_path / "k.key").public.id in r.stdout


def test_an_unreachable_service_is_a_refusal_exit_code(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "w.key"
    SigningKey.generate().save(path)
    rc = main(["--run-url", f"http://127.0.0.1:{port}", "--key", str(path),
               "--trainer-key", SigningKey.generate().public.hex])
    assert rc == 5
