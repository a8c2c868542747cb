"""The guard of tests/unit/conftest.py: a unit test that starts a process or opens a socket fails.

Each case runs the real conftest, copied into a pytester folder, around a one-test file, in this
process (``runpytest_inprocess``). Should the copied guard miss a case, this file's own guard catches
what the inner test started, and this test fails all the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest

GUARD = Path(__file__).with_name("conftest.py")

OFFENDERS = {
    "subprocess": "import subprocess, sys\n    subprocess.run([sys.executable, '-c', 'pass'])",
    "fork": "import os\n    os.fork()",
    "posix_spawn": "import os, sys\n    os.posix_spawn(sys.executable, [sys.executable, '-c', 'pass'], {})",
    "multiprocessing": "import multiprocessing\n    multiprocessing.get_context('spawn').Process(target=print).start()",
    "bind": "import socket\n    socket.socket().bind(('127.0.0.1', 0))",
    "connect": "import socket\n    socket.create_connection(('127.0.0.1', 9), timeout=1)",
    "http": "import urllib.request\n    urllib.request.urlopen('http://127.0.0.1:9', timeout=1)",
    "udp": "import socket\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 9))",
    "gloo": "import torch.distributed as dist\n"
    "    dist.ProcessGroupGloo(dist.HashStore(), 0, 1, dist.ProcessGroupGloo._Options())",
    "tcpstore": "import torch.distributed as dist\n    dist.TCPStore('127.0.0.1', 0, 1, True)",
    # code that catches the error (a retry loop, a fallback) does not hide what it tried
    "swallowed": "import subprocess, sys\n    try:\n        subprocess.run([sys.executable, '-c', 'pass'])\n"
    "    except Exception:\n        pass",
}


@pytest.fixture
def guarded(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(GUARD.read_text())
    return pytester


@pytest.mark.parametrize("body", OFFENDERS.values(), ids=OFFENDERS.keys())
def test_a_unit_test_that_starts_a_process_or_opens_a_socket_fails(guarded: pytest.Pytester, body: str):
    guarded.makepyfile(test_offender=f"def test_offends():\n    {body}\n")
    result = guarded.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*move this test to tests/integration/*"])


def test_a_module_fixture_that_starts_a_server_errors_the_test(guarded: pytest.Pytester):
    guarded.makepyfile(test_offender="""
import http.server
import pytest

@pytest.fixture(scope="module")
def server():
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler) as s:
        yield s

def test_uses_it(server):
    pass
""")
    result = guarded.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*socket.bind*move this test to tests/integration/*"])


def test_threads_and_an_asyncio_loop_are_allowed(guarded: pytest.Pytester):
    guarded.makepyfile(test_allowed="""
import asyncio
import threading

def test_loop_and_thread():
    assert asyncio.run(asyncio.sleep(0, result=3)) == 3  # the loop's self-pipe is a socketpair
    t = threading.Thread(target=print)
    t.start()
    t.join()
""")
    guarded.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
