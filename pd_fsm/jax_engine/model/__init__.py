"""A Llama-architecture decoder in JAX over the paged KV pool, and its weights."""

from pd_fsm.jax_engine.model.config import SMOLLM2_135M, TINY, ModelConfig
from pd_fsm.jax_engine.model.forward import KV, Params, decode, extend, prefill
from pd_fsm.jax_engine.model.params import new_kv_pool, random_params

__all__ = [
    "KV",
    "SMOLLM2_135M",
    "TINY",
    "ModelConfig",
    "Params",
    "decode",
    "extend",
    "new_kv_pool",
    "prefill",
    "random_params",
]
