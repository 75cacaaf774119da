"""`pd-fsm`: one command, a subcommand per service (DESIGN §8)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

Command = Callable[[argparse.Namespace], int]


def _spec_check(args: argparse.Namespace) -> int:
    from pd_fsm.core.tables import check_all

    directory = Path(args.tables) if args.tables else None
    report = check_all(directory)
    bad = 0
    for name, problems in report.items():
        print(f"{name}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
        for p in problems:
            print(f"  - {p}")
        bad += len(problems)
    if not report:
        print("no tables found", file=sys.stderr)
        return 2
    return 1 if bad else 0


def _spec_diagram(args: argparse.Namespace) -> int:
    from pd_fsm.core.diagram import markdown
    from pd_fsm.core.tables import ALL_TABLES

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for table in ALL_TABLES.values():
        path = out / f"{table.name}.md"
        path.write_text(markdown(table))
        print(f"wrote {path}")
    return 0


def _add_spec(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    spec = sub.add_parser("spec", help="validate the state tables and draw their diagrams")
    spec_sub = spec.add_subparsers(dest="spec_command", required=True)
    check = spec_sub.add_parser("check", help="report every problem in spec/state_tables/*.toml")
    check.add_argument("--tables", help="directory of tables (default: the project's)")
    check.set_defaults(func=_spec_check)
    diagram = spec_sub.add_parser("diagram", help="write a Mermaid diagram per table")
    diagram.add_argument("--out", default="docs/state_machines", help="output directory")
    diagram.set_defaults(func=_spec_diagram)


# Each service module adds its own subcommand; imported lazily so `pd-fsm spec` needs no JAX.
_REGISTRARS: list[str] = [
    "pd_fsm.io_trio.cli_bootstrap",
    "pd_fsm.io_trio.cli_serve",
    "pd_fsm.io_trio.cli_proxy",
    "pd_fsm.io_trio.cluster",
    "pd_fsm.io_trio.bench_client",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-fsm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_spec(sub)
    import importlib

    for module_name in _REGISTRARS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # that service is not built in this checkout
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Command = args.func
    return func(args)


if __name__ == "__main__":
    raise SystemExit(main())
