"""The profile's optional fields (platform, device, step, grids, skipped points, the KV path's
legs): they round-trip, a profile written before them loads as it did, and a reader that only
knows the old keys still reads a new file."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from pd_fsm.sim.perf_profile import LEGS, CoreProfile, Profile

BENCH = Path(__file__).resolve().parents[2] / "bench"

TPU = Profile(
    model="qwen3-0.6b", kv_bytes_per_token=114688, page_size=16, max_batched_tokens=1024,
    max_running=256, platform="tpu", device_kind="TPU v5 lite", step="fused",
    kv_dtype="bfloat16", prefill_grid=(128, 1024, 8192), decode_grid=((1, 512), (256, 8192)),
    skipped=("decode 256 x 8192: its pool does not fit the chip's memory",),
    by_cores=(CoreProfile(
        cores=13, prefill=((128, 0.003), (1024, 0.014)), decode=((1, 512, 0.0027),),
        copy=((1 << 20, 1e-5),), pull=(),
        gather=((117 << 20, 0.001), (470 << 20, 0.004)), d2h=((117 << 20, 0.012),),
        d2h_pinned=(), h2d=((117 << 20, 0.009),), scatter=((117 << 20, 0.002),)),))


def test_new_fields_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    TPU.dump(path)
    back = Profile.load(path)
    assert back == TPU
    core = back.on(13)
    assert core.has_leg("d2h") and not core.has_leg("d2h_pinned") and not core.has_leg("pull")
    assert core.leg_s("gather", 117 << 20) == pytest.approx(0.001)
    assert core.leg_s("gather", (117 + 470) << 19) == pytest.approx(0.0025)
    with pytest.raises(ValueError, match="no d2h_pinned leg"):
        core.leg_s("d2h_pinned", 1 << 20)


@pytest.mark.parametrize("name", sorted(p.name for p in BENCH.glob("profile_*.json")))
def test_a_profile_written_before_the_fields_loads_unchanged(name: str) -> None:
    raw = json.loads((BENCH / name).read_text())
    assert not {"platform", "device_kind", "skipped"} & set(raw)  # written before them
    profile = Profile.load(BENCH / name)
    assert (profile.platform, profile.device_kind, profile.step) == ("cpu", "", "")
    assert profile.prefill_grid == () and profile.skipped == ()
    for core, old in zip(profile.by_cores, raw["by_cores"], strict=True):
        assert [list(p) for p in core.prefill] == old["prefill"]
        assert [list(p) for p in core.decode] == old["decode"]
        assert not any(core.has_leg(leg) for leg in LEGS)


def test_a_reader_of_the_old_keys_reads_a_new_file(tmp_path: Path) -> None:
    """What a reader from before the fields does (named keys only) still works on a new file:
    the new keys are additions, none renamed or retyped, and the version is unchanged."""
    path = tmp_path / "p.json"
    TPU.dump(path)
    raw = json.loads(path.read_text())
    assert raw["version"] == 1
    old_keys = {"version", "model", "kv_bytes_per_token", "page_size", "max_batched_tokens",
                "max_running", "by_cores"}
    assert old_keys <= set(raw)
    core = raw["by_cores"][0]
    assert [tuple(p) for p in core["prefill"]] == list(TPU.by_cores[0].prefill)
    assert [tuple(p) for p in core["decode"]] == list(TPU.by_cores[0].decode)


def test_profiles_of_different_platforms_do_not_merge() -> None:
    with pytest.raises(ValueError, match="different platforms"):
        TPU.merged(attrs.evolve(TPU, platform="cpu"))
