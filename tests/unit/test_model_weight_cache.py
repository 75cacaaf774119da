"""The converted-weights cache: entries keyed by the source's content (a reinstalled file with a
new mtime shares one), and converting one removes the same source's other entries (old formats,
mtime keys) but nothing else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pd_fsm.jax_engine.model.weight_cache import remove_other_entries, source_key


def test_key_follows_content_not_mtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_FSM_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(b"weights" * 1000)
    os.utime(b, ns=(1, 1))
    assert source_key(a) == source_key(b) == source_key(a)  # the last one from the memo
    b.write_bytes(b"weightz" * 1000)  # same size, other content
    assert source_key(b) != source_key(a)
    assert source_key(a).startswith("m-7000-")


def test_converting_removes_only_the_same_sources_other_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PD_FSM_CACHE_DIR", str(tmp_path))
    keep = "m-7000-0123456789abcdef"
    old = ["m-7000-1796051024785474370.npz", "m-7000-1796051024785474370.json",
           "m-7000-fedcba9876543210.json"]
    others = ["m-v2-7000-0123456789abcdef.json", "digest-abc.txt", "smollm2-f32-m-1-2.gguf",
              f"{keep}.json"]
    for name in (*old, *others):
        (tmp_path / name).write_text("x")
    (tmp_path / "m-7000-fedcba9876543210.params").mkdir()
    (tmp_path / f"{keep}.params").mkdir()
    remove_other_entries(keep, "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*others, f"{keep}.params"])


def test_a_config_read_back_from_json_is_hashable() -> None:
    """The cache keeps the model's config as JSON, where tuples come back as lists; the config
    is a static jit argument, so it must still hash (a SmolLM2 worker started from the cache
    failed its warm-up with "unhashable type: 'list'")."""
    import json

    import attrs

    from pd_fsm.jax_engine.model.config import SMOLLM2_135M, ModelConfig

    moe = attrs.evolve(SMOLLM2_135M, sparse_layers=(0, 2))
    again = ModelConfig(**json.loads(json.dumps(attrs.asdict(moe))))
    assert again == moe and hash(again) == hash(moe)
