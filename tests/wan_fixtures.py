"""Pytest fixtures for the WAN testbed (infra/wan): emulated hosts with shaped links.

Load with ``pytest_plugins = ["wan_fixtures"]`` in tests/conftest.py, or import the fixtures
into a test module: ``from wan_fixtures import wan_caps, wan_testbed  # noqa: F401``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # `infra` is not an installed package; plain `pytest` lacks the repo root
    sys.path.append(_ROOT)

from infra.wan.testbed import Caps, Testbed, cleanup_stale, probe  # noqa: E402


@pytest.fixture(scope="session")
def wan_caps() -> Caps:
    """What this machine can emulate; also clears testbeds left by crashed runs."""
    caps = probe()
    if not caps.netns:
        cleanup_stale()
    return caps


@pytest.fixture
def wan_testbed(wan_caps: Caps) -> Iterator[Callable[..., Testbed]]:
    """Factory: ``wan_testbed(n_hosts, topology=..., rate_mbit=..., delay_ms=..., downlink_mbit=...)``.

    Skips the test when the machine cannot build it (not root, no network namespaces, no tc
    tbf; no tc netem if ``delay_ms`` is set or ``needs_delay=True``, for tests that add delay
    later with set_link). Every testbed it made is torn down after the test.
    """
    made: list[Testbed] = []

    def make(n_hosts: int, *, needs_delay: bool = False, **kwargs: Any) -> Testbed:
        delay = kwargs.get("delay_ms", 0)
        if why := wan_caps.missing(rate=True, delay=needs_delay or bool(delay)):
            pytest.skip(f"WAN testbed unavailable: {why}")
        made.append(Testbed(n_hosts, **kwargs))
        return made[-1]

    try:
        yield make
    finally:
        for tb in made:
            tb.close()
