"""Named models: weights on device, config and tokenizer, loaded once per process."""

from __future__ import annotations

import functools
import json
from pathlib import Path

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


def load_hf(directory: str | Path, dtype: str = "float32") -> LoadedModel:
    """A local HF Llama / Qwen2 checkpoint directory (config.json, *.safetensors,
    tokenizer.json, optionally tokenizer_config.json for the chat template and EOS)."""
    from pd_fsm.jax_engine.model.hf_loader import load_hf_checkpoint

    path = Path(directory)
    config, params_np, raw_cfg = load_hf_checkpoint(path)
    config = attrs.evolve(config, dtype=dtype)
    tok_cfg_path = path / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
    tokenizer_json = (path / "tokenizer.json").read_text()
    eos = raw_cfg.get("eos_token_id")
    if eos is None:
        from tokenizers import Tokenizer as _HF

        eos_token = tok_cfg.get("eos_token")
        eos_token = eos_token.get("content") if isinstance(eos_token, dict) else eos_token
        eos = _HF.from_str(tokenizer_json).token_to_id(eos_token) if eos_token else None
    if eos is None:
        raise ValueError(f"{path}: no eos_token_id in config.json or tokenizer_config.json")
    tokenizer = HFTokenizer(
        tokenizer_json,
        eos_token_id=eos,
        chat_template=tok_cfg.get("chat_template"),
        bos_token_id=raw_cfg.get("bos_token_id"),
        add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
    )
    return LoadedModel(str(path), config, to_device(params_np, dtype), tokenizer)


@functools.cache
def load_model(name: str, dtype: str = "float32", seed: int = 0) -> LoadedModel:
    """The named model, memoised: schedulers in one process share one copy of the weights.

    ``name`` is ``"smollm2"``, ``"tiny"`` (random weights from ``seed``) or the path of a local HF
    Llama / Qwen2 checkpoint directory.
    """
    if name == "smollm2":
        return load_smollm2(dtype)
    if name == "tiny":
        return load_tiny(seed, dtype)
    if Path(name).is_dir():
        return load_hf(name, dtype)
    raise ValueError(
        f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)} or an HF checkpoint directory"
    )
