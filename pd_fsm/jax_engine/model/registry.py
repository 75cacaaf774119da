"""Named models: weights on device, config and tokenizer, loaded once per process."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import attrs

from pd_fsm.jax_engine.model.config import TINY, ModelConfig
from pd_fsm.jax_engine.model.forward import Params
from pd_fsm.jax_engine.model.params import random_params_np, to_device
from pd_fsm.text.tokenizer import CharTokenizer, HFTokenizer, Tokenizer

MODEL_NAMES = ("smollm2", "tiny")
# How weights are loaded: from the model's files, or random at its shape (``dummy.py``).
LOAD_FORMATS = ("auto", "dummy")


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
    eos_token, bos_token = _token_string(tok_cfg, "eos_token"), _token_string(tok_cfg, "bos_token")
    if eos is None:
        from tokenizers import Tokenizer as _HF

        eos = _HF.from_str(tokenizer_json).token_to_id(eos_token) if eos_token else None
    if eos is None:
        raise ValueError(f"{path}: no eos_token_id in config.json or tokenizer_config.json")
    tokenizer = HFTokenizer(
        tokenizer_json,
        eos_token_id=eos,
        chat_template=_hf_chat_template(path, tok_cfg),
        bos_token_id=raw_cfg.get("bos_token_id"),
        add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
        bos_token=bos_token,
        eos_token=eos_token,
    )
    return LoadedModel(str(path), config, to_device(params_np, dtype), tokenizer)


def _token_string(tok_cfg: dict[str, Any], key: str) -> str | None:
    """``tokenizer_config.json`` spells a special token as a string or an AddedToken dict."""
    value = tok_cfg.get(key)
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def _hf_chat_template(path: Path, tok_cfg: dict[str, Any]) -> str | None:
    """The template as transformers finds it: ``tokenizer_config.json``'s ``chat_template`` (a
    string, or a list of named templates of which we serve ``default``), else the
    ``chat_template.jinja`` file that newer checkpoints ship beside it."""
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    return template if isinstance(template, str) else None


def load_dummy(name: str, dtype: str, seed: int = 0) -> LoadedModel:
    """Random weights at ``name``'s shape (a shape in ``configs/``, SmolLM2's, or a checkpoint
    directory's ``config.json``), a byte tokenizer."""
    from pd_fsm.jax_engine.model.config import SMOLLM2_135M
    from pd_fsm.jax_engine.model.dummy import dummy_params, shape_config

    if name in ("smollm2", "tiny"):
        config = SMOLLM2_135M if name == "smollm2" else TINY
        eos = 0
    else:
        config, raw = shape_config(name)
        eos_id = raw.get("eos_token_id", 0)
        eos = int(eos_id[0] if isinstance(eos_id, list) else eos_id)
    config = attrs.evolve(config, dtype=dtype)
    return LoadedModel(f"{name} (dummy weights)", config, dummy_params(config, dtype, seed),
                       CharTokenizer(config.vocab_size, eos_token_id=eos))


@functools.cache
def load_model(name: str, dtype: str = "float32", seed: int = 0,
               load_format: str = "auto") -> LoadedModel:
    """The named model, memoised: schedulers in one process share one copy of the weights.

    ``name`` is ``"smollm2"``, ``"tiny"`` (random weights from ``seed``) or the path of a local HF
    Llama / Qwen2 checkpoint directory; with ``load_format="dummy"`` also a shape of
    ``configs/`` (``dummy.SHAPE_NAMES``), with random weights at its shape.
    """
    if load_format == "dummy":
        return load_dummy(name, dtype, seed)
    if load_format != "auto":
        raise ValueError(f"unknown load format {load_format!r}; known: {', '.join(LOAD_FORMATS)}")
    if name == "smollm2":
        return load_smollm2(dtype)
    if name == "tiny":
        return load_tiny(seed, dtype)
    if Path(name).is_dir():
        return load_hf(name, dtype)
    from pd_fsm.jax_engine.model.dummy import SHAPE_NAMES

    if name in SHAPE_NAMES:
        raise ValueError(f"model {name!r} is a shape without weights here: pass "
                         "--load-format dummy for random weights at its shape")
    raise ValueError(
        f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)} or an HF checkpoint directory"
        f" (with --load-format dummy also {', '.join(SHAPE_NAMES)})"
    )
