"""This process's memory as Linux counts it, for the memory benchmarks: ``/proc/self/status`` fields and
a reset of the peak (``VmHWM``), so a benchmark measures the high-water mark of one phase alone."""

from __future__ import annotations

from pathlib import Path


def status_kb(key: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_peak() -> int:
    """Reset ``VmHWM`` to the current resident set (``clear_refs`` 5) and return that, in KiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_kb("VmRSS")
