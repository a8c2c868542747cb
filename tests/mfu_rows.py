"""Every metrics row a test run wrote, checked for an MFU above 1 (tests/conftest.py runs this over the
session's temporary folders when the session ends; tests/unit/test_metrics.py tests it)."""

from __future__ import annotations

import json
from pathlib import Path


def mfu_above_one(folder: Path, limit: int = 20) -> list[str]:
    """``file:line mfu=...`` of each JSONL row under ``folder`` whose ``mfu`` exceeds 1 (at most ``limit``)."""
    bad: list[str] = []
    for path in sorted(folder.rglob("*.jsonl")):
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:  # removed while we looked (a test's folder cleaned up by another worker)
            continue
        for n, line in enumerate(lines, 1):
            if '"mfu"' not in line:
                continue
            try:
                value = json.loads(line).get("mfu")
            except (ValueError, AttributeError):
                continue
            if isinstance(value, (int, float)) and value > 1:
                bad.append(f"{path}:{n} mfu={value}")
                if len(bad) >= limit:
                    return bad
    return bad
