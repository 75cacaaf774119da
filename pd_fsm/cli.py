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
    if directory is None:  # the project's tables: also every effect against its code
        from pd_fsm.core.dispatch import handler_problems
        from pd_fsm.core.machines import core_machines

        for owner, parts, tables in core_machines():
            problems = handler_problems(owner, tables, parts)
            names = "+".join(t.name for t in tables)
            through = f" (with {', '.join(p.__name__ for p in parts)})" if parts else ""
            print(f"{owner.__name__} runs {names}: "
                  f"{'every effect has its handler' if not problems else 'mismatch'}{through}")
            for p in problems:
                print(f"  - {p}")
            bad += len(problems)
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


# Each service module adds its own subcommand; imported lazily so `pd-fsm spec` needs no JAX,
# and only the one named on the command line is imported: importing all of them cost every
# `pd-fsm` process ~1 s of CPU at start (a cluster starts four at once on two cores).
_REGISTRARS: dict[str, str] = {
    "bootstrap": "pd_fsm.io_trio.bootstrap.cli",
    "serve": "pd_fsm.io_trio.worker.cli",
    "switch-role": "pd_fsm.io_trio.worker.switch_cli",
    "proxy": "pd_fsm.io_trio.proxy.cli",
    "planner": "pd_fsm.io_trio.planner.cli",
    "cluster": "pd_fsm.io_trio.cluster.local",
    "bench": "pd_fsm.io_trio.bench_client",
    "sim": "pd_fsm.sim.cli",
    "profile": "pd_fsm.sim.profiler",
    "plan": "pd_fsm.sim.plan_cli",
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv`` naming a subcommand, only that subcommand's module is
    imported (``--help`` and anything else import them all)."""
    parser = argparse.ArgumentParser(prog="pd-fsm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_spec(sub)
    import importlib

    first = next(iter(argv), None) if argv else None
    names = [first] if first in _REGISTRARS else list(_REGISTRARS)
    for name in names:
        module_name = _REGISTRARS[name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # that service is not built in this checkout
        module.add_parser(sub)
    return parser


def _host_heap(argv: Sequence[str]) -> str:
    """``serve``'s ``--host-heap`` value as given on the command line (its default otherwise)."""
    for i, arg in enumerate(argv):
        if arg == "--host-heap" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--host-heap="):
            return arg.split("=", 1)[1]
    return "hugepages"


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        if argv[:1] == ["serve"] and _host_heap(argv) == "hugepages":
            # Before importing anything heavy: the huge-page tunable needs a re-executed process
            # (``host_memory``), and every import before it is paid twice (~1-2 s of a start).
            from pd_fsm.jax_engine.kv.host_memory import reexec_with_hugepages

            reexec_with_hugepages()
    argv = list(argv)
    args = build_parser(argv).parse_args(argv)
    func: Command = args.func
    return func(args)


if __name__ == "__main__":
    raise SystemExit(main())
