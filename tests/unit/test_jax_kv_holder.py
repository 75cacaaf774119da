import threading

import jax.numpy as jnp
import pytest

from pd_fsm.jax_engine.kv.holder import KVCacheHolder


def test_locked_read_replace_and_swap() -> None:
    holder = KVCacheHolder({"main_kv": [jnp.zeros(3), jnp.zeros(3)]})
    with holder.locked() as kv:
        kv["main_kv"] = [a + 1 for a in kv["main_kv"]]
    holder.swap(lambda pools: {"main_kv": [a * 5 for a in pools["main_kv"]]})
    with holder.locked() as kv:
        assert [float(a[0]) for a in kv["main_kv"]] == [5.0, 5.0]
        with pytest.raises(ValueError):
            kv["main_kv"] = [jnp.zeros(3)]  # layer count must not change
    assert holder.generation == 2
    with pytest.raises(RuntimeError):
        kv["main_kv"]  # the view is dead outside the with block


def test_lock_excludes_and_times_out() -> None:
    holder = KVCacheHolder({"p": [jnp.zeros(1)]})
    entered = threading.Event()
    leave = threading.Event()

    def hold() -> None:
        with holder.locked():
            entered.set()
            leave.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    assert entered.wait(5)
    with pytest.raises(TimeoutError), holder.locked(timeout=0.05):
        pass
    leave.set()
    t.join(5)
    with holder.locked(timeout=1):
        pass
