"""pd_fsm's loader and forward against transformers itself, for every supported ``model_type``.

The fixtures (``tests/fixtures/hf/<type>/``) are tiny random checkpoints that transformers built
and saved, with transformers' logits at every position of a few prompts and its greedy
continuations (``tests/fixtures/make_hf_references.py``, run once by hand in its own venv: this
environment has no torch). Here: each checkpoint loads, every position's logits are within 1e-4
of transformers', greedy tokens are equal through the colocated scheduler and through a prefill
and a decode scheduler with real transfers, and a model_type the loader does not know is refused
with the list of those it knows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from pd_fsm.jax_engine.model import load_model, new_kv_pool, prefill, table_width
from pd_fsm.jax_engine.model.hf_loader import SUPPORTED_MODEL_TYPES
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Req, Scheduler, SchedulerArgs
from pd_fsm.schedulers.disaggregation import DisaggregationArgs
from tests.support.pd_pair import PDPair, collect, serve_through

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
TYPES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").exists())
PAGE = 4


def _reference(model_type: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    d = FIXTURES / model_type
    ref = json.loads((d / "reference.json").read_text())
    with np.load(d / "logits.npz") as z:
        return ref, {k: z[k] for k in z.files}


def test_every_supported_type_has_a_fixture() -> None:
    assert sorted(SUPPORTED_MODEL_TYPES) == TYPES


def _args(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "num_pages": 64, "page_size": PAGE, "max_running": 4,
            "max_batched_tokens": 64, **kw}


@pytest.mark.parametrize("model_type", TYPES)
def test_logits_and_greedy_tokens_equal_transformers(model_type: str) -> None:
    ref, logits = _reference(model_type)
    path = str(FIXTURES / model_type)
    model = load_model(path)
    assert model.config.model_type == model_type

    # Every position's logits (the head over each position, as for prompt log-probs).
    for i, ids in enumerate(ref["prompts"]):
        n_pages = -(-len(ids) // PAGE)
        pages = np.zeros(table_width(n_pages, PAGE), np.int32)
        pages[:n_pages] = np.arange(1, 1 + n_pages)
        got, _ = prefill(model.params, new_kv_pool(model.config.kv_pool_config(16, PAGE)),
                         jnp.asarray(ids, jnp.int32), len(ids), jnp.asarray(pages),
                         config=model.config, all_logits=True)
        np.testing.assert_allclose(np.asarray(got)[: len(ids)], logits[f"prompt{i}"],
                                   atol=1e-4, rtol=0, err_msg=f"{model_type} prompt {i}")

    greedy = SamplingParams(temperature=0.0, max_new_tokens=ref["new_tokens"], ignore_eos=True)
    colo = Scheduler(SchedulerArgs(**_args(path)), model=model)
    for i, ids in enumerate(ref["prompts"]):
        colo.add_request(Req(f"r{i}", ids, greedy))
    got_colo = collect(colo.run_until_idle())
    pair = PDPair(model, DisaggregationArgs(**_args(path, disaggregation_mode="prefill",
                                                   instance_id="prefill-0")),
                  DisaggregationArgs(**_args(path, disaggregation_mode="decode",
                                             instance_id="decode-0")))
    got_pd = serve_through(pair, ref["prompts"], greedy, 100)
    for i, expected in enumerate(ref["greedy"]):
        assert got_colo[f"r{i}"]["ids"] == expected, (model_type, i)
        assert got_pd[f"r{i}"]["ids"] == expected, (model_type, i)


def test_an_unknown_model_type_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "llama", tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt_neox'; known:") as info:
        load_model(str(tmp_path / "m"))
    for known in SUPPORTED_MODEL_TYPES:
        assert known in str(info.value)
