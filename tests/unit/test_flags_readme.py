"""docs/flags.md's table of `pd-fsm serve` flags is what their declarations render: a flag
added, renamed or re-defaulted without the page following fails here. To fix a failure, run
``python -m pd_fsm.io_trio.worker.flags_readme``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pd_fsm.io_trio.worker import flags_readme
from pd_fsm.io_trio.worker.config import add_serve_arguments
from pd_fsm.io_trio.worker.flags import SERVE_FLAGS

ROOT = Path(__file__).resolve().parents[2]


def test_flags_page_table_is_rendered_from_the_declarations() -> None:
    assert flags_readme.FLAGS_DOC == ROOT / "docs" / "flags.md"
    page = flags_readme.FLAGS_DOC.read_text(encoding="utf-8")
    assert flags_readme.splice(page, flags_readme.render()) == page, (
        "docs/flags.md's serve flags table differs from pd_fsm/io_trio/worker/flags.py: run "
        "`python -m pd_fsm.io_trio.worker.flags_readme`"
    )


def test_every_parser_flag_is_declared_and_has_a_row() -> None:
    # An argument added to the parser by hand, past the declarations, would have no row.
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    parsed = {name for action in parser._actions for name in action.option_strings} - {
        "-h", "--help"}
    assert parsed == {name for flag in SERVE_FLAGS for name in flag.names}
    table = flags_readme.render()
    for flag in SERVE_FLAGS:
        assert f"| `{flag.name}" in table


def test_check_mode_fails_on_a_stale_table_and_write_mode_fixes_it(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    stale = f"intro\n\n{flags_readme.BEGIN}\n| old |\n{flags_readme.END}\n\nrest\n"
    readme.write_text(stale)
    assert flags_readme.main([str(readme), "--check"]) == 1
    assert readme.read_text() == stale  # --check writes nothing
    assert flags_readme.main([str(readme)]) == 0
    fixed = readme.read_text()
    assert fixed.startswith("intro\n\n") and fixed.endswith("\n\nrest\n")
    assert flags_readme.render() in fixed
    assert flags_readme.main([str(readme), "--check"]) == 0


def test_readme_points_at_the_flags_page_and_holds_no_copy_of_the_table() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/flags.md" in readme
    assert flags_readme.BEGIN not in readme


def test_a_page_without_the_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="marker"):
        flags_readme.splice("no table here", flags_readme.render())
