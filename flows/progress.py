"""Terminal progress bars for the long phases (DiLoCo outer steps, RL steps), on stderr.

Shown only when stderr is a terminal, so logs, CI output and worker processes stay clean; the
dashboard's progress artifacts carry the same numbers everywhere.
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def progress_bar(total: int, desc: str, initial: int = 0, unit: str = "step") -> tqdm:
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=not sys.stderr.isatty(), leave=True)
