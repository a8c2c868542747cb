"""The ``intellect`` command: run a flow from a TOML config plus ``key=value`` overrides."""

from __future__ import annotations

import argparse
import sys

from intellect.config import ConfigError, SmokeConfig, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="intellect", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("smoke", help="build the tiny model, pretrain it briefly, report accuracy")
    s.add_argument("--config", help="TOML run file (e.g. configs/smoke.toml)")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. train.steps=200 data.max_digits=2")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "smoke":
            cfg = load_config(SmokeConfig, args.config, args.overrides)
            from flows.smoke import smoke  # imported late: Prefect's import costs ~2 s

            smoke(cfg)
    except ConfigError as e:
        print(f"intellect: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
