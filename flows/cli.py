"""The ``intellect`` command: run a flow from a TOML config plus ``key=value`` overrides."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from intellect.config import ConfigError, DilocoRunConfig, SmokeConfig, load_config
from intellect.pipeline import DemoConfig
from intellect.rl.config import FilterRunConfig, RLRunConfig

RUNS = {"smoke": SmokeConfig, "diloco": DilocoRunConfig, "rl": RLRunConfig, "filter": FilterRunConfig,
        "demo": DemoConfig}
EXAMPLES = {"smoke": "smoke", "diloco": "diloco-tiny", "rl": "rl-tiny", "filter": "filter-tiny", "demo": "demo"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="intellect", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    helps = {
        "smoke": "build the tiny model, pretrain it briefly, report accuracy",
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
    sub.add_parser("shardcast", add_help=False,
                   help="SHARDCAST servers and client: origin | publish | relay | client "
                   "(see `intellect shardcast -h`)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # its own parser, and no Prefect: it runs on machines nobody here owns
        from intellect.rl.worker import main as worker_main

        return worker_main(argv[1:], prog="intellect worker")
    if argv[:1] == ["shardcast"]:  # its own parser: servers and a client, not a run config
        from intellect.shardcast.__main__ import main as shardcast_main

        return shardcast_main(argv[1:], prog="intellect shardcast")
    args = _parser().parse_args(argv)
    if args.cluster:
        from infra.cluster import load_env

        try:
            os.environ.update(load_env(Path(args.cluster)))
        except FileNotFoundError:
            print(f"intellect: no cluster state in {args.cluster} (run `python -m infra.cluster up`)", file=sys.stderr)
            return 2
    try:
        cfg = load_config(RUNS[args.command], args.config, args.overrides)
        # flows are imported late: Prefect's import costs ~2 s, wasted on a bad config
        if args.command == "smoke":
            from flows.smoke import smoke

            smoke(cfg)
        elif args.command == "diloco":
            from flows.diloco import diloco_train

            diloco_train(cfg)
        elif args.command == "rl":
            from flows.rl import rl_train

            rl_train(cfg)
        elif args.command == "filter":
            from flows.filter import filter_pass_at_k

            filter_pass_at_k(cfg)
        elif args.command == "demo":
            from flows.demo import demo

            demo(cfg)
    except ConfigError as e:
        print(f"intellect: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
