"""The transfer server's socket threads raised above compute (thread_priority.py), on a real
``jax.experimental.transfer`` server: which threads, once each, and the unprivileged path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pd_fsm.jax_engine.transfer import JaxTransferKVEngine
from pd_fsm.jax_engine.transfer.thread_priority import (
    DATA_PLANE_THREADS,
    DataPlanePriority,
    raise_this_thread,
)

ROOT = Path(__file__).resolve().parents[2]


def _threads() -> dict[int, tuple[str, int]]:
    out = {}
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            out[tid] = (comm, os.getpriority(os.PRIO_PROCESS, tid))
        except OSError:
            continue
    return out


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_raises_only_the_transfer_threads_once_each() -> None:
    if os.geteuid() != 0:
        pytest.skip("raising a priority needs root here; the refusal is tested below")
    engine = JaxTransferKVEngine(reaper_interval_s=None)
    try:
        before = _threads()
        ours = {tid for tid, (comm, _) in before.items() if comm in DATA_PLANE_THREADS}
        assert ours, f"no transfer threads found: {sorted(set(before.values()))}"
        priority = DataPlanePriority(-7)
        assert priority.apply() == len(ours)
        assert priority.apply() == 0  # remembered, not reniced again
        after = _threads()
        for tid, (comm, nice) in after.items():
            if tid in ours:
                assert nice == -7, (comm, nice)
            elif tid in before:
                assert nice == before[tid][1], (comm, nice)  # compute and the rest untouched
        assert priority.as_dict() == {"nice": -7, "raised_total": len(ours), "refused": None}
    finally:
        engine.close()


def test_zero_leaves_everything_and_range_is_checked() -> None:
    assert DataPlanePriority(0).apply() == 0
    for bad in (1, -21):
        with pytest.raises(ValueError, match=r"-20\.\.0"):
            DataPlanePriority(bad)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to an unprivileged user needs root")
def test_unprivileged_process_is_refused_once_and_keeps_working() -> None:
    """A process without CAP_SYS_NICE: the first attempt is refused and recorded, nothing
    raises, and it is not retried."""
    code = textwrap.dedent("""
        import os
        from pd_fsm.jax_engine.transfer import JaxTransferKVEngine
        from pd_fsm.jax_engine.transfer.thread_priority import DataPlanePriority
        engine = JaxTransferKVEngine(reaper_interval_s=None)
        p = DataPlanePriority(-10)
        # Then become nobody (every thread: glibc changes them all): no CAP_SYS_NICE, and
        # RLIMIT_NICE 0. Imports first: the interpreter's files may be unreadable to nobody.
        os.setgid(65534); os.setuid(65534)
        print(p.apply(), p.apply(), p.refused is not None, p.raised)
        engine.close()
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HOME": "/tmp", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd="/tmp")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "0", "True", "0"], done.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root here")
def test_raise_this_thread_touches_only_the_calling_thread() -> None:
    import threading


    seen: dict[str, object] = {}
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    # Below both this thread's value and 0 (0 means "leave it"; a run under `nice -n 5` starts
    # at 5, where 5 below would be 0).
    target = max(-20, min(mine, 0) - 5)

    def pull_thread() -> None:
        seen["applied"] = raise_this_thread(target)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=pull_thread)
    t.start()
    t.join()
    assert seen == {"applied": True, "nice": target}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # untouched
    assert raise_this_thread(0) is False
