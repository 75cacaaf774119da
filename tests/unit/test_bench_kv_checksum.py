"""bench/bench_kv_checksum.py's pure parts: the ``--links`` values, the links' order per
repetition, and a table row's figures from the medians."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_kv_checksum as bk  # bench/, not a package: found by the path above


def test_links_parse_to_loopback_unshaped_or_a_rate() -> None:
    assert bk.parse_link("loopback") == bk.LOOPBACK
    assert bk.parse_link("unshaped") == bk.UNSHAPED
    assert bk.parse_link("10") == "10" and bk.parse_link("1.0") == "1"
    assert bk.parse_link("2.5") == "2.5"
    for bad in ("0", "-1", "fast", "inf", "nan", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="a rate in Gbit/s"):
            bk.parse_link(bad)


def test_link_rates_and_labels() -> None:
    assert bk.link_bps("10") == 10e9 and bk.link_bps("1") == 1e9
    assert bk.link_bps(bk.LOOPBACK) is None and bk.link_bps(bk.UNSHAPED) is None
    assert bk.link_label("10") == "10 Gbit/s" and bk.link_label(bk.LOOPBACK) == "loopback"


def test_each_link_comes_first_in_turn() -> None:
    links = ["loopback", "10", "1"]
    orders = [bk.rotated(links, rep) for rep in range(4)]
    assert [o[0] for o in orders] == ["loopback", "10", "1", "loopback"]
    assert all(sorted(o) == sorted(links) for o in orders)
    assert bk.rotated([], 3) == []


def test_row_shares_are_of_the_pull() -> None:
    med = {"pull": 0.100, "p": 0.002, "d": 0.003, "xla": 0.010, "plain": 0.0015}
    row = bk.table_row("1", 16, med)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["1 Gbit/s", "16 MiB"]
    assert cells[2] == f"100.00 ({16 * bk.MIB / 0.1 / 1e9:.3f})"  # 0.168 GB/s
    assert cells[3:6] == ["2.000 (2.0 %)", "3.000 (3.0 %)", "5.0 %"]
    assert cells[6:] == ["10.00", "1.500"]
    assert len(cells) == bk.TABLE_HEAD.splitlines()[0].count("|") - 1
