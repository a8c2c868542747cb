"""``benchmarks/gpu_check.sh`` as far as a machine without a GPU can check it: the wheels it carries to
the lent GPU machine cover what the project needs beyond that machine's image (read from the
project's own metadata and the installed distributions' requirements: no network), the scripts parse,
one call stays inside the device's 600 s, and the tests its header names are the ones in tests/gpu/."""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPT = BENCH / "gpu_check.sh"
CALL_LIMIT = 540  # seconds: a device call runs at most 600, and the machine's start and copies need their share
# the lent machine: CPython 3.12 on Linux x86_64
DEVICE = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
          "platform_machine": "x86_64", "os_name": "posix"}


def lines(path: Path) -> list[str]:
    return [s for s in (raw.strip() for raw in path.read_text().splitlines()) if s and not s.startswith("#")]


def pins() -> dict[str, str]:
    """benchmarks/gpu_wheels.txt as {canonical name: version}; asserts each line is exactly name==version."""
    out: dict[str, str] = {}
    for line in lines(BENCH / "gpu_wheels.txt"):
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!-]+", line), f"not name==version: {line!r}"
        name, version = line.split("==")
        key = canonicalize_name(name)
        assert key not in out, f"{name} pinned twice"
        out[key] = version
    return out


def image() -> set[str]:
    return {canonicalize_name(n) for n in lines(BENCH / "gpu_image_packages.txt")}


def not_carried() -> set[str]:
    """Names on the wheel list's ``# not carried: a b c -- why`` lines."""
    out = set()
    for raw in (BENCH / "gpu_wheels.txt").read_text().splitlines():
        if raw.startswith("# not carried:"):
            names, sep, why = raw.removeprefix("# not carried:").partition("--")
            assert sep and why.strip(), f"a package left behind needs its reason: {raw!r}"
            out |= {canonicalize_name(n) for n in names.split()}
    return out


def needs(req: Requirement, extras: frozenset[str] = frozenset()) -> bool:
    """Whether ``req`` applies on the device when its owner was installed with ``extras``."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**DEVICE, "extra": e}) for e in (extras or {""}))


def runtime_requirements() -> list[Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [r for r in map(Requirement, deps) if needs(r)]


def test_the_wheel_list_pins_each_package_once_and_leaves_the_image_alone():
    carried = pins()
    assert len(carried) > 10
    shadowed = set(carried) & image()
    notes = (BENCH / "gpu_wheels.txt").read_text()
    # a package the image has travels only on purpose (it costs the call's 64 MiB), said in a comment
    assert all(re.search(rf"^# {re.escape(n)} shadows", notes, re.M | re.I) for n in shadowed), shadowed
    assert not set(carried) & not_carried()


def test_every_runtime_dependency_is_in_the_image_or_carried():
    have = image() | set(pins()) | not_carried()
    missing = [str(r) for r in runtime_requirements() if canonicalize_name(r.name) not in have]
    assert not missing, f"neither in the image nor on benchmarks/gpu_wheels.txt: {missing}"


def test_the_carried_packages_bring_everything_they_need():
    """Walk the requirements of the project's dependencies, as this environment's installed copies
    declare them, for CPython 3.12 on Linux: everything reached beyond the image is carried."""
    carried, img, skipped = pins(), image(), not_carried()
    todo = [(r, frozenset(r.extras)) for r in runtime_requirements()]
    seen: set[str] = set()
    lacking: dict[str, str] = {}
    while todo:
        req, extras = todo.pop()
        key = canonicalize_name(req.name)
        if key in skipped or (key in img and not extras):
            continue  # the image's own packages bring their own needs; a package left behind, its reason
        if key not in carried and key not in img:
            lacking.setdefault(key, str(req))
        if (key, extras) in seen:
            continue
        seen.add((key, extras))
        try:
            reqs = md.distribution(req.name).requires or []
        except md.PackageNotFoundError:
            continue  # not installed here (another platform's need): its name was checked above
        for sub in map(Requirement, reqs):
            # of an image package only what the extras asked for add (httpx[http2] needs h2, httpx does not)
            if needs(sub, extras) and not (key in img and needs(sub)):
                todo.append((sub, frozenset(sub.extras)))
    assert seen, "walked nothing"
    assert not lacking, f"needed on the device, neither in its image nor carried: {sorted(lacking.values())}"


def test_the_scripts_parse():
    for script in (SCRIPT, BENCH / "gpu_wheels.sh"):
        run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert run.returncode == 0, f"{script.name}: {run.stderr}"


def test_one_call_of_the_check_stays_inside_the_device_limit():
    text = SCRIPT.read_text()
    steps = {name: int(s) for name, s in re.findall(r"^\s*run_step\s+(\w+)\s+(\d+)\b", text, re.M)}
    assert {"preflight", "tests", "smoke", "diloco"} <= set(steps), steps
    (grace,) = re.findall(r"^GRACE=(\d+)", text, re.M)
    others = [int(s) for s in re.findall(r"\btimeout\s+(\d+)\b", text)]  # any limit outside run_step
    total = sum(steps.values()) + int(grace) * len(steps) + sum(others)
    assert total < CALL_LIMIT, f"steps {steps}, grace {grace} each, others {others}: {total} s"


def test_the_header_names_exactly_the_gpu_tests_that_exist():
    header = "\n".join(line for line in SCRIPT.read_text().splitlines() if line.startswith("#"))
    named = set(re.findall(r"\btest_\w+\.py\b", header))
    present = {p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    assert named == present, f"named {sorted(named)}, present {sorted(present)}"
