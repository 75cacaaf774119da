"""`pd-fsm profile` on a machine that refuses every TCP and UDP socket (the TPU machine's way,
emulated by a seccomp filter: tests/support/no_inet.py), with the accelerator's step and pool
forced on the CPU: it measures the fused steps and the KV legs, and says that it did not measure
the loopback pull (jax.experimental.transfer listens on TCP only) instead of failing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pd_fsm.sim.perf_profile import Profile
from tests.support import no_inet

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not no_inet.supported(), reason="the seccomp filter is for Linux x86-64 "
                    "and aarch64")
def test_profile_without_tcp_measures_the_chip_costs_and_says_what_it_skipped(
        tmp_path: Path) -> None:
    out = tmp_path / "prof.json"
    run = subprocess.run(
        [sys.executable, "-m", "tests.support.no_inet", sys.executable, "-m", "pd_fsm.cli",
         "profile", "--model", "tiny", "--backend", "accelerator-on-cpu",
         "--prefill-tokens", "16,64", "--max-batched-tokens", "32", "--decode-rows", "1,4",
         "--decode-contexts", "32,512", "--copy-mib", "1", "--legs-tokens", "64",
         "--repeats", "1", "--legs-repeats", "1", "--legs-tier-wait-s", "10",
         # a pool of 48 pages: 4 rows x 512 tokens (128 pages) do not fit
         "--hbm-gb", str(48 * 4096 / 1e9), "--hbm-reserve-gb", "0", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "refused a TCP socket" in run.stdout
    profile = Profile.load(out)
    (core,) = profile.by_cores
    assert (profile.platform, profile.step, profile.kv_dtype) == ("cpu", "fused", "bfloat16")
    assert profile.prefill_grid == (16, 64)
    assert profile.decode_grid == ((1, 32), (4, 32), (1, 512), (4, 512))
    assert [t for t, _ in core.prefill] == [16, 64]
    assert [(r, c) for r, c, _ in core.decode] == [(1, 32), (4, 32), (1, 512)]
    assert all(s > 0 for *_, s in core.decode) and all(s > 0 for _, s in core.prefill)
    assert core.pull == () and core.copy[0][1] > 0
    assert any(line.startswith("decode 4 x 512: its KV") for line in profile.skipped)
    assert any(line.startswith("pull over loopback: not measured") and "TCP" in line
               for line in profile.skipped)
    room = 64 * profile.kv_bytes_per_token
    for leg in ("gather", "d2h", "d2h_pinned", "h2d", "scatter"):
        assert core.has_leg(leg), leg
        assert core.leg_s(leg, room) > 0
