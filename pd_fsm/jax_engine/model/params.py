"""Parameter pytrees: random initialisation (the tiny test model) and KV pool allocation."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pd_fsm.jax_engine.kv.pool import KVPoolConfig, allocate_kv_pool
from pd_fsm.jax_engine.model.config import ModelConfig
from pd_fsm.jax_engine.model.forward import KV, Params


def random_params_np(config: ModelConfig, seed: int = 0) -> dict[str, object]:
    """Deterministic random weights as numpy arrays (the same for a given seed on every machine).

    Scales keep activations O(1) through the layers so that logits are well spread: greedy
    decoding on the tiny model then produces varied tokens, which the scheduler tests rely on.
    """
    rng = np.random.default_rng(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    nh, nkv = config.num_heads, config.num_kv_heads

    def dense(n_in: int, n_out: int) -> np.ndarray:
        return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)

    layers = [
        {
            "attn_norm": norm(),
            "wq": dense(h, nh * d),
            "wk": dense(h, nkv * d),
            "wv": dense(h, nkv * d),
            "wo": dense(nh * d, h),
            "mlp_norm": norm(),
            "w_gate": dense(h, i),
            "w_up": dense(h, i),
            "w_down": dense(i, h),
        }
        for _ in range(config.num_layers)
    ]
    params: dict[str, object] = {
        "embed": rng.standard_normal((config.vocab_size, h)).astype(np.float32),
        "final_norm": norm(),
        "layers": layers,
    }
    if not config.tie_embeddings:
        params["lm_head"] = dense(h, config.vocab_size) * 4.0
    return params


def to_device(params_np: dict[str, object], dtype: str) -> Params:
    """Numpy pytree -> device arrays of ``dtype``."""
    return jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype), params_np)


def fuse_projections(params: Params) -> Params:
    """The same weights with each layer's q, k and v projections as one ``wqkv`` (and
    ``bqkv``) and its gate and up as one ``w_gu``: one product each instead of three and two.
    Works on numpy or device arrays; the separate arrays are not kept."""
    def fused(layer: dict[str, Any]) -> dict[str, Any]:
        out = dict(layer)
        if "wq" in out:
            out["wqkv"] = _concat([out.pop(k) for k in ("wq", "wk", "wv")], 1)
        if "bq" in out:
            out["bqkv"] = _concat([out.pop(k) for k in ("bq", "bk", "bv")], 0)
        if "w_gate" in out:
            out["w_gu"] = _concat([out.pop("w_gate"), out.pop("w_up")], 1)
        return out

    return {**params, "layers": [fused(layer) for layer in params["layers"]]}


def stack_layers(params: Params) -> Params:
    """The same weights with ``layers`` as one array per weight name, the layers stacked on a
    leading axis (``[L, ...]``): a step program then takes ~11 weight arguments instead of ~11
    per layer (each argument is a share of a dispatch's host time). The fused step reads
    either form (``layer_views``); the chain takes the list. Refused where the layers' weights
    differ in name (dense and MoE layers mixed)."""
    layers = params["layers"]
    names = set(layers[0])
    if any(set(layer) != names for layer in layers):
        raise ValueError("layers with different weights cannot be stacked")
    return {**params, "layers": {name: _xp(layers[0][name]).stack([layer[name] for layer in layers])
                                 for name in sorted(names)}}


def layer_views(layers: list[dict[str, Any]] | dict[str, Any]) -> list[dict[str, Any]]:
    """Each layer's weights, from a list of them or from ``stack_layers``'s stacked arrays (a
    static slice each, inside a jitted program)."""
    if isinstance(layers, list):
        return layers
    count = next(iter(layers.values())).shape[0]
    return [{name: array[i] for name, array in layers.items()} for i in range(count)]


def _xp(array: Any) -> Any:
    """numpy for a numpy array, jax.numpy for a device one: weights are either."""
    return np if isinstance(array, np.ndarray) else jnp


def _concat(arrays: list[Any], axis: int) -> Any:
    return _xp(arrays[0]).concatenate(arrays, axis=axis)


def random_params(config: ModelConfig, seed: int = 0) -> Params:
    return to_device(random_params_np(config, seed), config.dtype)


def new_kv_pool(pool: KVPoolConfig) -> KV:
    """Zeroed pool arrays, one per layer, in the ``kv/pool.py`` layout."""
    return allocate_kv_pool(pool)
