"""Named models: weights on device, config and tokenizer, loaded once per process."""

from __future__ import annotations

import functools

import attrs

from pd_fsm.jax_engine.model.config import TINY, ModelConfig
from pd_fsm.jax_engine.model.forward import Params
from pd_fsm.jax_engine.model.params import random_params_np, to_device
from pd_fsm.jax_engine.tokenizer import CharTokenizer, HFTokenizer, Tokenizer

MODEL_NAMES = ("smollm2", "tiny")


@attrs.frozen(eq=False)
class LoadedModel:
    name: str
    config: ModelConfig
    params: Params
    tokenizer: Tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.tokenizer.eos_token_ids


def load_smollm2(dtype: str = "float32") -> LoadedModel:
    from pd_fsm.jax_engine.model.gguf_loader import find_smollm2_gguf, load_gguf

    config, params_np, spec = load_gguf(find_smollm2_gguf())
    config = attrs.evolve(config, dtype=dtype)
    tokenizer = HFTokenizer(
        spec.tokenizer_json,
        eos_token_id=spec.eos_token_id,
        chat_template=spec.chat_template,
        bos_token_id=spec.bos_token_id,
        add_bos_token=spec.add_bos_token,
    )
    return LoadedModel("smollm2", config, to_device(params_np, dtype), tokenizer)


def load_tiny(seed: int = 0, dtype: str = "float32") -> LoadedModel:
    config = attrs.evolve(TINY, dtype=dtype)
    params = to_device(random_params_np(config, seed), dtype)
    return LoadedModel("tiny", config, params, CharTokenizer(config.vocab_size, eos_token_id=0))


@functools.cache
def load_model(name: str, dtype: str = "float32", seed: int = 0) -> LoadedModel:
    """The named model, memoised: schedulers in one process share one copy of the weights.

    ``seed`` only affects the random-weight ``tiny`` model.
    """
    if name == "smollm2":
        return load_smollm2(dtype)
    if name == "tiny":
        return load_tiny(seed, dtype)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
