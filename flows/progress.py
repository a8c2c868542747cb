"""Progress lines of the library (:mod:`intellect.progress`) in the console and in Prefect's run logs.

Prefect's logging configuration shows only WARNING and above of loggers outside ``prefect`` on the
console, and sends none of them to the API. :func:`show_progress` lets the INFO lines of the
``intellect.progress`` logger and of ``intellect.device`` (what ``compute.precision = "auto"`` chose on
this machine, and why) through, and sends them to the run logs of the flow or task run they are written
in (lines written outside any run, e.g. by a DiLoCo worker between its outer-step flow runs, stay in
the console and the process's log file).
"""

from __future__ import annotations

import logging

from prefect.context import FlowRunContext, TaskRunContext
from prefect.logging.handlers import APILogHandler

from intellect import device, progress
from intellect.config import LoggingConfig

# the library's loggers whose INFO lines a user watching a run must see
SHOWN = (progress.LOGGER, device.log.name)


def _in_a_run(record: logging.LogRecord) -> bool:  # noqa: ARG001 - a logging filter's signature
    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def show_progress(cfg: LoggingConfig | None = None) -> logging.Logger:
    """Route progress lines to the console and the run logs (idempotent); with ``cfg``, its
    ``progress_seconds`` becomes the interval of the progress made in this process from now on."""
    for name in SHOWN:
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        if not any(isinstance(h, APILogHandler) for h in logger.handlers):
            handler = APILogHandler()
            handler.addFilter(_in_a_run)
            logger.addHandler(handler)
    if cfg is not None:
        progress.configure(cfg.progress_seconds)
    return logging.getLogger(progress.LOGGER)
