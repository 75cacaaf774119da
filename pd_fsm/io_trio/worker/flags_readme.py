"""The table of `pd-fsm serve` flags in docs/flags.md, rendered from their declarations (flags.py).

    python -m pd_fsm.io_trio.worker.flags_readme            # rewrite docs/flags.md's table
    python -m pd_fsm.io_trio.worker.flags_readme --check    # exit 1 while it differs

The table sits between two marker comments in docs/flags.md; everything else there is
hand-written. ``tests/unit/test_flags_readme.py`` fails while the page's table is not what this
renders, so a flag cannot be added, renamed or re-defaulted without its documentation following.
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

FLAGS_DOC = Path(__file__).resolve().parents[3] / "docs" / "flags.md"
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


def splice(page: str, table: str) -> str:
    """``page`` with the text from BEGIN to END replaced by ``table``."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError("the page has no serve flags table (its marker comments are missing)")
    return page[:start] + table + page[end + len(END):]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd_fsm.io_trio.worker.flags_readme",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("page", nargs="?", type=Path, default=FLAGS_DOC)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the table differs from the declarations")
    args = parser.parse_args(argv)
    text = args.page.read_text(encoding="utf-8")
    updated = splice(text, render())
    if args.check:
        if updated != text:
            print(f"{args.page}: the serve flags table is out of date", file=sys.stderr)
            return 1
        return 0
    if updated != text:
        args.page.write_text(updated, encoding="utf-8")
        print(f"wrote {args.page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
