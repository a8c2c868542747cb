"""Candidates that try to forge the verdict instead of passing the tests: each scores 0.

Every payload runs for real in bubblewrap, beside a wrong (or missing) ``add``: the only way
such code could score is by making the judge believe tests passed that did not. Honest code,
including code that is only partly right, gets exactly the score its tests give it.
"""

from __future__ import annotations

import doctest

import pytest

import intellect.rl.rewards.sandbox_runner as runner
from intellect.rl.rewards import CodeRewardConfig, SandboxConfig, code_reward, run_python, sandbox_status

CFG = SandboxConfig(timeout_s=4.0, cpu_s=2, memory_mb=256, max_processes=16)
TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
WRONG = "\ndef add(a, b):\n    return None\n"

# A verdict in every format a runner of this project has used, for payloads to write wherever they can.
FAKE = (
    '{"started": true}\n{"test": 1, "ok": true}\n{"test": 2, "ok": true}\n{"done": true, "ended": false}\n'
    'S' + "0" * 32 + "\nok\nPASSED\n"
)


@pytest.fixture(scope="module")
def bwrap():
    status = sandbox_status(CFG)
    if not status.startswith("bwrap sandbox works"):
        pytest.skip(f"no bubblewrap sandbox on this machine: {status}")
    return status


def score(code: str, tests=TESTS):
    result = run_python(code, tests, CFG)
    return result


FRAME_READER = f'''
import os, sys
f = sys._getframe(0)
while f is not None:  # a runner that keeps a secret and a status pipe in its frame: report the pass
    if "secret" in f.f_locals and "status" in f.f_locals:
        os.write(f.f_locals["status"], f.f_locals["secret"])
        os._exit(0)
    f = f.f_back
fake = {FAKE!r}.encode()
fds = set()
f = sys._getframe(0)
while f is not None:  # every runner frame: its locals, and any secret-looking value in them
    for name, value in list(f.f_locals.items()):
        if isinstance(value, int) and 0 <= value < 1024:
            fds.add(value)
        if isinstance(value, (bytes, str)) and len(value) == 32:
            fake += b"S" + (value.encode() if isinstance(value, str) else value)
    f = f.f_back
fds.update(int(n) for n in os.listdir("/proc/self/fd"))
for fd in sorted(fds):
    try:
        os.write(fd, fake)
    except OSError:
        pass
sys.stdout.flush()
os._exit(0)
'''

PROTOCOL_FORGER = r'''
import json, os, sys
f = sys._getframe(0)
while f is not None and "sock" not in f.f_locals:
    f = f.f_back
sock = f.f_locals["sock"]
def send(obj):
    data = json.dumps(obj).encode()
    os.write(sock, len(data).to_bytes(4, "big") + data)
send({"ready": True})
for reply in ({"ok": True}, {"done": True}, {"test": 1, "ok": True}, {"ok": {"h": 0}}, {"ok": 5}, {"ok": 0}):
    send(reply)  # answers sent ahead of any question, in every shape the judge might accept
while True:
    head = os.read(sock, 4)
    if not head:
        os._exit(0)
    os.read(sock, int.from_bytes(head, "big"))
    send({"ok": {"h": 0}})
'''

PAYLOADS = {
    "frame-reading": FRAME_READER,
    "fake-lines-on-stdout-and-stderr": f"import sys\nprint({FAKE!r})\nsys.stderr.write({FAKE!r})" + WRONG,
    "exit-0-after-a-pass-marker": f"import os, sys\nprint({FAKE!r})\nsys.stdout.flush()\nos._exit(0)" + WRONG,
    "sys-exit-0": "import sys\nsys.exit(0)" + WRONG,
    "files": (f"for p in ('/work/verdict', '/tmp/verdict', '/dev/shm/verdict', '/work/result.json'):\n"
              f"    open(p, 'w').write({FAKE!r})" + WRONG),
    "monkeypatched-builtins": (
        "import builtins, os, sys\n"
        "builtins.AssertionError = type('AssertionError', (BaseException,), {})\n"
        "builtins.print = lambda *a, **k: None\n"
        "builtins.isinstance = lambda *a: True\n"
        "sys.exit = os._exit = lambda *a: None\n"
        "sys.excepthook = lambda *a: None\n" + WRONG
    ),
    "closed-descriptors": "import os\nos.closerange(0, 1024)" + WRONG,
    "rigged-eq": "class Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
                 "def add(a, b):\n    return Yes()\n",
    "int-subclass": "class I(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
                    "def add(a, b):\n    return I(0)\n",
    "protocol-forgery": PROTOCOL_FORGER,
    "kill-everything-visible": "import os, signal\n" + WRONG + "os.kill(-1, signal.SIGKILL)\n",
    "tracer": "import sys\nsys.settrace(lambda *a: None)\nsys.setprofile(lambda *a: None)" + WRONG,
}


@pytest.mark.parametrize("name", list(PAYLOADS))
@pytest.mark.usefixtures("bwrap")
def test_forgery_scores_0(name):
    result = score(PAYLOADS[name])
    assert not result.passed and result.tests_passed == 0, (name, result)
    reward = code_reward(f"```python\n{PAYLOADS[name]}\n```", TESTS, CodeRewardConfig(sandbox=CFG))
    assert reward.reward == 0.0, (name, reward)


@pytest.mark.usefixtures("bwrap")
def test_the_candidate_never_sees_the_tests():
    # the tests live only in the judge's process: nothing in the candidate's frames or argv names them
    code = (
        "import sys\n"
        "def look():\n"
        "    needle = '== 5  # marker-' + '7f3a'  # a local: not in any frame this search reads\n"
        "    seen = needle in open('/proc/self/cmdline').read()\n"
        "    f = sys._getframe(1)\n"
        "    while f is not None:\n"
        "        seen = seen or any(needle in repr(v) for v in f.f_locals.values())\n"
        "        f = f.f_back\n"
        "    return seen\n"
        "seen = look()\n"
        "def add(a, b):\n"
        "    return a + b if not seen else 0\n"
    )
    result = score(code, [t + "  # marker-7f3a" for t in TESTS])
    assert result.passed, result


@pytest.mark.usefixtures("bwrap")
def test_honest_code_passes_with_objects_exceptions_and_iteration():
    code = '''
class Stack:
    def __init__(self):
        self.items = []
    def push(self, x):
        self.items.append(x)
    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()
    def __len__(self):
        return len(self.items)
    def __iter__(self):
        return iter(list(self.items))
    def __repr__(self):
        return f"Stack({self.items!r})"
def fact(n):
    return 1 if n < 2 else n * fact(n - 1)
def stats(xs):
    return {"min": min(xs), "max": max(xs), "pair": (xs[0], xs[-1]), "set": set(xs), "raw": bytes(xs)}
LIMIT = 10
'''
    tests = [
        "s = Stack()\ns.push(1)\ns.push(2)\nassert len(s) == 2 and list(s) == [1, 2]\nassert s.pop() == 2",
        "assert repr(s) == 'Stack([1])' and s.items == [1]",
        "try:\n    Stack().pop()\nexcept IndexError as e:\n    assert 'empty' in str(e)\n"
        "else:\n    raise AssertionError",
        "assert fact(30) == 265252859812191058636308480000000 and fact(300) % 10 ** 70 == 0",
        "assert stats([3, 1, 2]) == {'min': 1, 'max': 3, 'pair': (3, 2), 'set': {1, 2, 3}, 'raw': b'\\x03\\x01\\x02'}",
        "def helper():\n    return fact(5) + LIMIT\nassert helper() == 130",
        "import math\nassert math.isclose(fact(3) / 7, 6 / 7) and isinstance(fact(3), int)",
    ]
    result = run_python(code, tests, CFG)
    assert result.passed and result.tests_passed == 7 == result.tests_total, result


@pytest.mark.usefixtures("bwrap")
def test_partial_solutions_get_their_true_partial_score():
    code = "def add(a, b):\n    return a + b if a >= 0 else 7"
    result = run_python(code, TESTS, CFG)
    assert (result.passed, result.tests_passed, result.tests_total, result.score) == (False, 1, 2, 0.5), result
    assert "<test 2>" in result.detail and "AssertionError" in result.detail
    tests = ["assert add(1, 1) == 2", "assert add(-1, 1) == 0", "assert add(0, 0) == 0", "assert add(5, 5) == 10"]
    result = run_python(code, tests, CFG)
    assert (result.tests_passed, result.score) == (3, 0.75), result
    # a test that fails does not stop the later ones, even when it leaves the candidate's process dead
    result = run_python("import os\ndef add(a, b):\n    return a + b\ndef die():\n    os._exit(3)",
                        ["assert add(1, 2) == 3", "die()", "assert add(2, 2) == 4"], CFG)
    assert (result.tests_passed, result.reason) == (1, "exit:3"), result


@pytest.mark.usefixtures("bwrap")
def test_a_timeout_keeps_the_tests_passed_before_it():
    code = "def add(a, b):\n    return a + b\ndef spin():\n    while True:\n        pass"
    cfg = CFG.model_copy(update={"timeout_s": 2.0, "cpu_s": 5})
    result = run_python(code, ["assert add(1, 2) == 3", "spin()", "assert add(2, 2) == 4"], cfg)
    assert (result.passed, result.reason, result.tests_passed, result.tests_total) == (False, "timeout", 1, 3), result


def test_runner_docstring_examples_hold():
    result = doctest.testmod(runner)
    assert result.attempted > 0 and result.failed == 0
