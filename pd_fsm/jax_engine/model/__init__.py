"""A Llama-architecture decoder in JAX over the paged KV pool, and its weights."""

from pd_fsm.jax_engine.model.config import SMOLLM2_135M, TINY, ModelConfig
from pd_fsm.jax_engine.model.forward import (
    KV,
    Params,
    compile_forward,
    decode,
    extend,
    prefill,
    table_width,
    write_kv,
)
from pd_fsm.jax_engine.model.params import new_kv_pool, random_params
from pd_fsm.jax_engine.model.registry import MODEL_NAMES, LoadedModel, load_hf, load_model

__all__ = [
    "KV",
    "MODEL_NAMES",
    "SMOLLM2_135M",
    "TINY",
    "LoadedModel",
    "ModelConfig",
    "Params",
    "compile_forward",
    "decode",
    "extend",
    "load_hf",
    "load_model",
    "new_kv_pool",
    "prefill",
    "random_params",
    "table_width",
    "write_kv",
]
