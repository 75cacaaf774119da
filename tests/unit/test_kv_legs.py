"""The KV path's legs (pd_fsm/sim/profiler/kv_legs.py, bench/bench_kv_legs.py) at the tiny
model's KV shape on the CPU: every leg runs on the bytes of the room it says, a wrong copy is
caught by the bytes check, and the bench writes its table and JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from pd_fsm.jax_engine import backend
from pd_fsm.sim.profiler.kv_legs import (
    BytesDiffer,
    LegRoom,
    LegSpec,
    model_config,
    room_legs,
    same_bytes,
    schema_legs,
    table,
    time_leg,
)

TINY = model_config("tiny")
# tiny: 2 layers x 2 (K, V) x 4 kv-heads x 8 dims, bf16 -> 256 bytes a token
TOKEN_BYTES = 2 * 2 * 4 * 8 * 2


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "accelerator-on-cpu"])
def test_every_leg_moves_the_rooms_bytes(accelerator: bool) -> None:
    choices = backend.accelerator_on_cpu() if accelerator else backend.current()
    with backend.using(choices):
        legs = room_legs(TINY, 200, kv_dtype="bfloat16", repeats=2,
                         gathers=["xla", "take", "pallas"], scatters=["xla", "pallas"],
                         tier_wait_s=30)
    names = [leg.name for leg in legs]
    assert names == ["gather:xla", "gather:take", "gather:pallas", "d2h", "d2h_layers",
                     "d2h_pinned", "h2d", "h2d_pinned", "scatter:xla", "scatter:pallas"]
    # 200 tokens: 13 pages of 16 (the padding of its page bucket, 14, is not counted)
    assert {leg.nbytes for leg in legs} == {13 * 16 * TOKEN_BYTES}
    assert all(leg.seconds is not None and leg.seconds > 0 for leg in legs)
    assert legs[0].note == "the run loop"  # the XLA tier timed is the one it settles on
    lines = table(legs, 819.0)
    assert len(lines) == 2 + len(legs) and "HBM (published)" in lines[-1]
    held = schema_legs(legs, "take", "pallas")
    assert held["gather"] == ((legs[1].nbytes, legs[1].seconds),)
    assert held["d2h"] == ((legs[3].nbytes, min(legs[3].seconds or 1, legs[4].seconds or 1)),)
    assert held["scatter"] == ((legs[9].nbytes, legs[9].seconds),)


def test_the_bytes_check_catches_a_wrong_copy() -> None:
    room = LegRoom(TINY, 64, kv_dtype="bfloat16")
    right = LegSpec("d2h", lambda: room.gather("take"), np.asarray, np.asarray)
    assert time_leg(right, room.want, repeats=1) > 0

    def flipped(x: jax.Array) -> np.ndarray:
        out = np.array(x)
        out.view(np.uint8).reshape(-1)[12345 % out.nbytes] ^= 1
        return out

    with pytest.raises(BytesDiffer, match="d2h: the bytes it produced differ"):
        time_leg(LegSpec("d2h", lambda: room.gather("take"), flipped, np.asarray),
                 room.want, repeats=1)
    # A copy of other pages (the scatter's destination, before any scatter) differs too.
    assert not same_bytes(room.scattered(), room.want)


def test_the_bench_prints_its_table_and_writes_json(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import bench_kv_legs

    out = tmp_path / "legs.json"
    assert bench_kv_legs.main(["--shapes", "tiny", "--tokens", "32,64", "--repeats", "1",
                               "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tiny, a room of 64 tokens" in printed and "d2h_layers" in printed
    doc = json.loads(out.read_text())
    assert doc["platform"] == "cpu" and doc["hbm_gbps"] is None
    assert [(r["shape"], r["tokens"]) for r in doc["rooms"]] == [("tiny", 32), ("tiny", 64)]
    legs = doc["rooms"][1]["legs"]
    assert {leg["nbytes"] for leg in legs} == {64 * TOKEN_BYTES}
    assert all(leg["gbps"] > 0 for leg in legs)
