"""The ``intellect`` command: run a flow from a TOML config plus ``key=value`` overrides."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path

from intellect.config import ConfigError, SmokeConfig, load_config
from intellect.diloco.config import DilocoRunConfig

EXAMPLES = {"smoke": "smoke", "diloco": "diloco-tiny", "rl": "rl-tiny", "filter": "filter-tiny", "demo": "demo"}
# imported once the config parsed: Prefect's import is slow, wasted on a bad config
FLOWS = {"smoke": ("flows.smoke", "smoke"), "diloco": ("flows.diloco", "diloco_train"), "rl": ("flows.rl", "rl_train"),
         "filter": ("flows.filter", "filter_pass_at_k"), "demo": ("flows.demo", "demo")}


def run_config(command: str) -> type:
    """The config class of a flow command. The RL and demo configs are imported here, when a flow
    command runs: they name the RL trainer's and the service's configs, whose modules ``intellect
    worker`` (untrusted machines) must never load."""
    from intellect.pipeline import DemoConfig  # noqa: PLC0415 - not for `intellect worker`
    from intellect.rl.config import FilterRunConfig, RLRunConfig  # noqa: PLC0415 - not for `intellect worker`

    return {"smoke": SmokeConfig, "diloco": DilocoRunConfig, "rl": RLRunConfig, "filter": FilterRunConfig,
            "demo": DemoConfig}[command]


# Set for the flow commands before Prefect is imported: Prefect reads its settings at import, and
# the temporary server it starts inherits them; a user's own setting wins. With analytics on, the
# server's telemetry service logs an error at start on a machine without network, or while its SQLite
# file is busy with the first flow runs ("database is locked"). The startup bound is the one the test
# suite uses: Prefect's default gives up on a server still migrating its database on a busy machine.
PREFECT_DEFAULTS = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
                    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}


def prefect_defaults(environ=os.environ) -> dict[str, str]:
    """Put :data:`PREFECT_DEFAULTS` into ``environ`` where unset; the values now in force.

    >>> env = {"DO_NOT_TRACK": "0"}
    >>> prefect_defaults(env)["DO_NOT_TRACK"], env["PREFECT_SERVER_ANALYTICS_ENABLED"]
    ('0', 'false')
    """
    return {k: environ.setdefault(k, v) for k, v in PREFECT_DEFAULTS.items()}


def _not_task_run_info(record: logging.LogRecord) -> bool:
    return not (record.name.startswith("prefect.task_runs") and record.levelno < logging.WARNING)


def quiet_task_runs() -> int:
    """Keep task runs' records below WARNING off the console handlers Prefect installed on the root
    logger, so a run prints one line per DiLoCo outer step or RL step rather than one per task run
    (tens a step). Only the console: ``prefect.task_runs`` keeps its own API handler, so the dashboard
    still shows every task run's logs. The number of handlers filtered."""
    importlib.import_module("prefect.main")  # its import installs Prefect's logging configuration
    from prefect.logging.handlers import PrefectConsoleHandler  # noqa: PLC0415 - Prefect only for flow commands

    handlers = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    for h in handlers:
        if _not_task_run_info not in h.filters:
            h.addFilter(_not_task_run_info)
    return len(handlers)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="intellect", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    helps = {
        "smoke": "build a model, pretrain it briefly (arithmetic or a text corpus), report held-out results",
        "diloco": "DiLoCo pretraining with N worker processes (int8 all-reduce, elastic membership)",
        "rl": "asynchronous GRPO: inference worker processes, validator, DuckDB ledger, trainer",
        "filter": "offline difficulty filter: pass@k of the current model, keep prompts in the window",
        "demo": "the whole pipeline: DiLoCo pretraining, pass@k filter, RL with TOPLOC and SHARDCAST, one report",
    }
    for name, text in helps.items():
        s = sub.add_parser(name, help=text)
        s.add_argument("--config", help=f"TOML run file (e.g. configs/{EXAMPLES[name]}.toml)")
        s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. train.steps=200 data.max_digits=2")
        s.add_argument("--cluster", nargs="?", const=".cluster", metavar="STATE",
                       help="report to the local cluster of `python -m infra.cluster up` (its state folder, "
                       "default .cluster) instead of a temporary Prefect server")
    sub.add_parser("worker", add_help=False,
                   help="a permissionless RL inference worker: keygen, or join a run by its URL "
                   "(see `intellect worker -h`)")
    sub.add_parser("diloco-join", add_help=False,
                   help="a DiLoCo contributor: join a run with its own key, listed in diloco.contributors "
                   "(see `intellect diloco-join -h`)")
    sub.add_parser("tokenizer", add_help=False,
                   help="train a BPE tokenizer on a run config's text corpus (see `intellect tokenizer -h`)")
    sub.add_parser("shardcast", add_help=False,
                   help="SHARDCAST servers and client: origin | publish | relay | client "
                   "(see `intellect shardcast -h`)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # its own parser, and no Prefect: it runs on machines nobody here owns
        from intellect.rl.worker.worker import main as worker_main  # noqa: PLC0415 - no Prefect, no RL trainer code

        return worker_main(argv[1:], prog="intellect worker")
    if argv[:1] == ["diloco-join"]:  # a DiLoCo contributor: its own key, no Prefect, no run secret
        from intellect.diloco.coordinator import main as diloco_main  # noqa: PLC0415 - no Prefect

        return diloco_main(["join", *argv[1:]], prog="intellect diloco-join")
    if argv[:1] == ["tokenizer"]:  # its own parser: a tokenizer from a run config's corpus, no flow
        from intellect.model.bpe import main as tokenizer_main  # noqa: PLC0415 - no Prefect

        return tokenizer_main(argv[1:], prog="intellect tokenizer", run_configs=(SmokeConfig, DilocoRunConfig))
    if argv[:1] == ["shardcast"]:  # its own parser: servers and a client, not a run config
        from intellect.shardcast.__main__ import main as shardcast_main  # noqa: PLC0415 - no Prefect

        return shardcast_main(argv[1:], prog="intellect shardcast")
    args = _parser().parse_args(argv)
    if args.cluster:
        from infra.cluster import load_env  # noqa: PLC0415 - only with --cluster

        try:
            os.environ.update(load_env(Path(args.cluster)))
        except FileNotFoundError:
            print(f"intellect: no cluster state in {args.cluster} (run `python -m infra.cluster up`)", file=sys.stderr)
            return 2
    prefect_defaults()
    from intellect.preflight import DATA_ERRORS, check_data  # noqa: PLC0415 - loads transformers

    try:
        cfg = load_config(run_config(args.command), args.config, args.overrides)
        if isinstance(cfg, (SmokeConfig, DilocoRunConfig)):
            check_data(cfg.data, cfg.model)  # a corpus or tokenizer that cannot work, named before any process starts
        quiet_task_runs()
        module, name = FLOWS[args.command]
        getattr(importlib.import_module(module), name)(cfg)
    except (ConfigError, *DATA_ERRORS) as e:
        print(f"intellect: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
