"""`python -m grafana generate [--check]`: the one command that writes every generated file (see
grafana/generate.py for the list)."""

import argparse
import sys

from grafana import generate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grafana", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("generate", help="write the dashboards, alert provisioning, chart files, "
                                               "docs/exporter.md metric table and docs/alerts.md alert table from "
                                               "their sources")
    run.add_argument("--check", action="store_true", help="write nothing; list stale outputs and exit 1")
    args = parser.parse_args(argv)
    try:
        return _check() if args.check else _write()
    except generate.GenerateError as error:
        print(f"generate: error: {error}", file=sys.stderr)
        return 2


def _check() -> int:
    problems = generate.stale(generate.REPO)
    for line in problems:
        print(line)
    if problems:
        print("generated files are out of date: run python -m grafana generate", file=sys.stderr)
    return 1 if problems else 0


def _write() -> int:
    for path in generate.write(generate.REPO):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
