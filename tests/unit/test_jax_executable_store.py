"""The compilation cache (``executable_store``): what one process compiles, the next loads without
lowering and runs to the same result; a bad file is a counted miss, never a failed start; only
``pd_fsm.jax_engine``'s module-level functions are stored; an executable JAX itself loaded from
its persistent cache is never stored (re-serialised, it fails when run)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pd_fsm.jax_engine.compilation.executable_store import ExecutableStore, key_text
from pd_fsm.jax_engine.compilation.executables import Executables
from pd_fsm.jax_engine.model.weight_cache import load_params, save_params
from pd_fsm.jax_engine.sampling.grammar import bitmask_words
from pd_fsm.jax_engine.sampling.sampler import _greedy


def _table(directory: Path) -> Executables:
    table = Executables()
    table.use_store(ExecutableStore(directory))
    return table


def _everything(logits: jax.Array) -> jax.Array:
    """The sampler's bitmask that allows every token."""
    return jnp.full((logits.shape[0], bitmask_words(logits.shape[1])), -1, jnp.int32)


def test_a_second_table_loads_what_the_first_compiled(tmp_path: Path) -> None:
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 50)), jnp.float32)
    first = _table(tmp_path)
    want = first.call(_greedy, {}, logits, _everything(logits))
    assert (first.stats().compiles, first.stats().loads) == (1, 0)
    assert first.store_counts()["writes"] == 1 and len(list(tmp_path.glob("*.exe"))) == 1

    second = _table(tmp_path)
    got = second.call(_greedy, {}, logits, _everything(logits))
    assert (second.stats().compiles, second.stats().loads) == (0, 1)
    assert second.store_counts() == {"loads": 1, "misses": 0, "writes": 0, "corrupt": 0,
                                     "write_errors": 0}
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Another shape is another entry.
    second.call(_greedy, {}, logits[:2], _everything(logits[:2]))
    assert second.stats().compiles == 1 and len(list(tmp_path.glob("*.exe"))) == 2


@pytest.mark.parametrize("damage", [b"", b"not a pickle", None])
def test_a_bad_file_is_dropped_compiled_again_and_rewritten(
    tmp_path: Path, damage: bytes | None
) -> None:
    logits = jnp.ones((2, 40), jnp.float32)
    _table(tmp_path).call(_greedy, {}, logits, _everything(logits))
    (path,) = tmp_path.glob("*.exe")
    good = path.read_bytes()
    # None: a complete file written for another key (a hash collision, or a file moved).
    path.write_bytes(good.replace(b"_greedy", b"_gre3dy") if damage is None else damage)
    table = _table(tmp_path)
    tokens, _ = table.call(_greedy, {}, logits, _everything(logits))
    assert np.asarray(tokens).tolist() == [0, 0]
    counts = table.store_counts()
    assert (counts["corrupt"], counts["writes"], table.stats().compiles) == (1, 1, 1)
    rewritten = _table(tmp_path).call(_greedy, {}, logits, _everything(logits))
    assert rewritten is not None  # the rewritten file loads


def test_only_stable_module_level_jax_engine_functions_have_a_key() -> None:
    leaves, treedef = jax.tree_util.tree_flatten((jnp.ones((2, 3)),))
    assert key_text(_greedy, {}, treedef, leaves) is not None
    local = jax.jit(lambda x: x + 1)
    assert key_text(local, {}, treedef, leaves) is None  # a lambda: no stable name
    outside = jax.jit(np.negative)  # not pd_fsm.jax_engine's
    assert key_text(outside, {}, treedef, leaves) is None
    assert key_text(_greedy, {"f": object()}, treedef, leaves) is None  # identity in the repr
    # Static arguments and shapes are part of the key.
    assert key_text(_greedy, {"k": 1}, treedef, leaves) != key_text(_greedy, {"k": 2}, treedef,
                                                                       leaves)
    other, other_tree = jax.tree_util.tree_flatten((jnp.ones((2, 4)),))
    assert key_text(_greedy, {}, other_tree, other) != key_text(_greedy, {}, treedef, leaves)


_JAX_CACHE_RUN = textwrap.dedent("""
    import sys
    from pathlib import Path
    import jax, jax.numpy as jnp
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    from pd_fsm.jax_engine.compilation.executable_store import ExecutableStore
    from pd_fsm.jax_engine.compilation.executables import Executables
    from pd_fsm.jax_engine.sampling.sampler import _greedy
    table = Executables()
    table.use_store(ExecutableStore(Path(sys.argv[2])))
    table.call(_greedy, {}, jnp.ones((2, 30), jnp.float32), jnp.full((2, 1), -1, jnp.int32))
    print(table.store_counts()["writes"])
""")


def test_an_executable_from_jaxs_own_cache_is_not_stored(tmp_path: Path) -> None:
    jax_cache = tmp_path / "jax"

    def run(store: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _JAX_CACHE_RUN, str(jax_cache), str(tmp_path / store)],
            capture_output=True, text=True, timeout=120, check=True,
        )
        return int(out.stdout.split()[-1])

    assert run("first") == 1  # compiled afresh: stored
    assert run("second") == 0  # JAX loaded it from its cache: not stored
    assert not list((tmp_path / "second").glob("*.exe"))


def test_params_round_trip_memory_mapped(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    params = {"embed": rng.normal(size=(5, 3)).astype(np.float32),
              "layers": [{"q": rng.normal(size=(3, 3)).astype(np.float32)} for _ in range(2)]}
    target = tmp_path / "m.params"
    assert load_params(target) is None
    save_params(target, params)
    save_params(target, params)  # a second writer finding the entry in place is fine
    loaded = load_params(target)
    assert loaded is not None and isinstance(loaded["embed"], np.memmap)
    np.testing.assert_array_equal(loaded["embed"], params["embed"])
    for got, want in zip(loaded["layers"], params["layers"], strict=True):
        np.testing.assert_array_equal(got["q"], want["q"])
    assert [p.name for p in tmp_path.iterdir()] == ["m.params"]  # no temporary left behind


def test_a_build_after_ready_is_logged_by_name_and_shape(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Warm-up builds are quiet; once the worker is ready, a compile or a cache load is a
    request waiting, logged once per executable with the shapes that missed."""
    caplog.set_level("WARNING", logger="pd_fsm.jax_engine.compilation.executables")
    logits = jnp.ones((2, 40), jnp.float32)
    table = _table(tmp_path)
    table.call(_greedy, {}, logits, _everything(logits))
    assert not caplog.records
    table.mark_ready()
    table.call(_greedy, {}, logits, _everything(logits))  # in the table: nothing built
    assert not caplog.records
    wide = jnp.ones((3, 40), jnp.float32)
    table.call(_greedy, {}, wide, _everything(wide))
    table.call(_greedy, {}, wide, _everything(wide))
    [compiled] = [r.getMessage() for r in caplog.records]
    assert compiled.startswith("compiled after ready (a request waited ")
    assert "_greedy(float32[3, 40] int32[3, 2])" in compiled
    caplog.clear()
    second = _table(tmp_path)  # another process: its store has the shape
    second.mark_ready()
    second.call(_greedy, {}, wide, _everything(wide))
    [loaded] = [r.getMessage() for r in caplog.records]
    assert loaded.startswith("loaded from the compilation cache after ready")
    assert "_greedy(float32[3, 40]" in loaded
