"""README's table of `pd-fsm serve` flags, rendered from their declarations (flags.py).

    python -m pd_fsm.io_trio.worker.flags_readme            # rewrite README.md's table
    python -m pd_fsm.io_trio.worker.flags_readme --check    # exit 1 while it differs

The table sits between two marker comments in README.md; everything else there is hand-written.
``tests/unit/test_flags_readme.py`` fails while README's table is not what this renders, so a
flag cannot be added, renamed or re-defaulted without its documentation following.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pd_fsm.io_trio.flag_spec import Flag, config_default
from pd_fsm.io_trio.worker.config import ServeConfig
from pd_fsm.io_trio.worker.flags import SERVE_FLAGS

README = Path(__file__).resolve().parents[3] / "README.md"
BEGIN = ("<!-- serve flags: rendered from pd_fsm/io_trio/worker/flags.py by "
         "`python -m pd_fsm.io_trio.worker.flags_readme`; edit the declarations, not this -->")
END = "<!-- end of serve flags -->"
HEADER = ("| flag | default | RFC-2 / sglang | meaning |", "|---|---|---|---|")


def _default(flag: Flag) -> str:
    if flag.shown_default is not None:
        return flag.shown_default
    value: Any = config_default(flag, ServeConfig)
    if isinstance(value, bool):
        shown = "on" if value else "off"
    elif value is None:
        shown = "none"
    elif isinstance(value, float):
        shown = f"{value:g}"
    else:
        shown = str(value)
    return shown if flag.env is None else f"{shown} (or `${flag.env}`)"


def _usage(flag: Flag) -> str:
    if flag.choices is not None:
        value = f" {{{','.join(flag.choices)}}}"
    else:
        value = "" if flag.metavar is None else f" {flag.metavar}"
    aliases = "".join(f" (`{alias}`)" for alias in flag.aliases)
    return f"`{flag.name}{value}`{aliases}"


def _counterparts(flag: Flag) -> str:
    found = ["RFC-2 §7"] if flag.rfc2 else []
    if flag.sglang is not None:
        same = flag.sglang in flag.names
        found.append("sglang" if same else f"sglang `{flag.sglang}`")
    return ", ".join(found)


def _meaning(flag: Flag) -> str:
    if flag.doc is not None:
        return flag.doc
    # argparse's help may show the default (%(default)s): the config's, as in the table.
    return flag.help % {"default": config_default(flag, ServeConfig)}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(flags: Sequence[Flag] = SERVE_FLAGS) -> str:
    """The markdown table, a row per flag in declaration order, with the markers around it."""
    rows = []
    for flag in flags:
        cells = (_usage(flag), _default(flag), _counterparts(flag), _meaning(flag))
        rows.append(f"| {' | '.join(_cell(c) for c in cells)} |")
    return "\n".join((BEGIN, *HEADER, *rows, END))


def splice(readme: str, table: str) -> str:
    """``readme`` with the text from BEGIN to END replaced by ``table``."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError("README has no serve flags table (its marker comments are missing)")
    return readme[:start] + table + readme[end + len(END):]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd_fsm.io_trio.worker.flags_readme",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("readme", nargs="?", type=Path, default=README)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the table differs from the declarations")
    args = parser.parse_args(argv)
    text = args.readme.read_text(encoding="utf-8")
    updated = splice(text, render())
    if args.check:
        if updated != text:
            print(f"{args.readme}: the serve flags table is out of date", file=sys.stderr)
            return 1
        return 0
    if updated != text:
        args.readme.write_text(updated, encoding="utf-8")
        print(f"wrote {args.readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
