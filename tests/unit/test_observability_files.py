"""The shipped dashboard and rule file are what ``pd_fsm.io_trio.cluster.observability`` writes
(edit that module, then run it), and the targets the cluster runner writes label every process."""

from __future__ import annotations

import json
from pathlib import Path

from pd_fsm.io_trio.cluster import observability


def test_the_committed_files_are_the_generated_ones(tmp_path: Path) -> None:
    for written in observability.write(tmp_path):
        committed = observability.deploy_dir() / written.relative_to(tmp_path)
        assert committed.read_text() == written.read_text(), (
            f"{committed} is stale: run `python -m pd_fsm.io_trio.cluster.observability`")


def test_every_panel_has_queries_and_ids_are_unique() -> None:
    dash = observability.dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]


def test_targets_label_each_process_by_role_and_name(tmp_path: Path) -> None:
    urls = {"bootstrap": "http://127.0.0.1:1", "prefill-0": "http://127.0.0.1:2",
            "decode-1": "https://h:3/", "proxy": "http://127.0.0.1:4"}
    path = tmp_path / "t" / "targets.json"
    observability.write_targets(path, urls)
    got = {e["labels"]["name"]: e for e in json.loads(path.read_text())}
    assert got["decode-1"] == {"targets": ["h:3"], "labels": {
        "role": "decode", "name": "decode-1", "__scheme__": "https"}}
    assert [got[n]["labels"]["role"] for n in ("bootstrap", "prefill-0", "proxy")] == [
        "bootstrap", "prefill", "proxy"]
