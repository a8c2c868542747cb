"""The ``intellect`` command: run a flow from a TOML config plus ``key=value`` overrides."""

from __future__ import annotations

import argparse
import sys

from intellect.config import ConfigError, DilocoRunConfig, SmokeConfig, load_config

RUNS = {"smoke": SmokeConfig, "diloco": DilocoRunConfig}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="intellect", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    helps = {
        "smoke": "build the tiny model, pretrain it briefly, report accuracy",
        "diloco": "DiLoCo pretraining with N worker processes (int8 all-reduce, elastic membership)",
    }
    for name, text in helps.items():
        s = sub.add_parser(name, help=text)
        s.add_argument("--config", help=f"TOML run file (e.g. configs/{'smoke' if name == 'smoke' else 'diloco-tiny'}.toml)")
        s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. train.steps=200 data.max_digits=2")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(RUNS[args.command], args.config, args.overrides)
        # flows are imported late: Prefect's import costs ~2 s, wasted on a bad config
        if args.command == "smoke":
            from flows.smoke import smoke

            smoke(cfg)
        elif args.command == "diloco":
            from flows.diloco import diloco_train

            diloco_train(cfg)
    except ConfigError as e:
        print(f"intellect: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
