"""``--load-format dummy`` (vLLM's name): random weights at a checkpoint's shape, for measuring
a model nobody shipped here. The shapes come from a ``config.json`` — one of the published ones
kept in ``configs/`` (Qwen3 0.6B / 1.7B / 4B, Llama 3.2 1B / 3B), or a checkpoint directory's
own — and the weights are drawn on the device, in the weights' dtype (a 4B model's 16 GB of f32
draws would not fit the host's time or a chip's memory). The text side is a byte tokenizer: a
dummy model's words mean nothing, and prompts of any length can still be served and counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from pd_fsm.jax_engine.model.config import ModelConfig
from pd_fsm.jax_engine.model.forward import Params
from pd_fsm.jax_engine.model.hf_loader import config_from_hf

CONFIG_DIR = Path(__file__).parent / "configs"
SHAPE_NAMES = tuple(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))


def shape_config(name: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """The config (and the raw ``config.json``) of a named shape or a checkpoint directory."""
    path = CONFIG_DIR / f"{name}.json" if str(name) in SHAPE_NAMES else Path(name) / "config.json"
    if not path.is_file():
        raise ValueError(f"no model shape {name!r}: known {', '.join(SHAPE_NAMES)}, or a "
                         "checkpoint directory with a config.json")
    raw = json.loads(path.read_text())
    return config_from_hf(raw), raw


def _layer_shapes(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    nh, nkv = config.num_heads, config.num_kv_heads
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm": (h,), "mlp_norm": (h,), "wq": (h, nh * d), "wk": (h, nkv * d),
        "wv": (h, nkv * d), "wo": (nh * d, h),
    }
    if config.model_type in ("qwen3", "qwen3_moe"):
        shapes |= {"q_norm": (d,), "k_norm": (d,)}
    if config.num_experts and i in config.sparse_layers:
        e = config.num_experts
        shapes |= {"router": (h, e), "e_gate": (e, h, inter), "e_up": (e, h, inter),
                   "e_down": (e, inter, h)}
    else:
        shapes |= {"w_gate": (h, inter), "w_up": (h, inter), "w_down": (inter, h)}
    return shapes


def dummy_params(config: ModelConfig, dtype: str, seed: int = 0) -> Params:
    """Random weights of ``config``'s shapes on the default device: projections scaled by
    ``1/sqrt(fan_in)`` and norms near 1, so activations stay O(1) through the layers."""
    key = jax.random.PRNGKey(seed)
    out_dtype = jnp.dtype(dtype)

    def draw(shape: tuple[int, ...], norm: bool) -> jax.Array:
        nonlocal key
        key, sub = jax.random.split(key)
        if norm:
            return (1.0 + 0.1 * jax.random.normal(sub, shape, jnp.float32)).astype(out_dtype)
        scale = shape[-2] ** -0.5 if len(shape) >= 2 else 1.0
        return (jax.random.normal(sub, shape, out_dtype) * scale).astype(out_dtype)

    layers = []
    for i in range(config.num_layers):
        layers.append({name: draw(shape, name.endswith("norm"))
                       for name, shape in _layer_shapes(config, i).items()})
    params: Params = {
        "embed": draw((config.vocab_size, config.hidden_size), False),
        "final_norm": draw((config.hidden_size,), True),
        "layers": layers,
    }
    if not config.tie_embeddings:
        params["lm_head"] = draw((config.hidden_size, config.vocab_size), False)
    return params


def param_bytes(params: Params) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(params))
