"""The Qwen3-MoE reference checkpoint (``tests/fixtures/hf/qwen3_moe``) at tp 2 and 4 equals tp 1
and transformers: attention sharded by kv-head as for dense models, every expert cut along its
intermediate dimension (gate/up by columns, down by rows, summed by an all-reduce), the router
replicated; P and D of different tp serve it as transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pd_fsm.jax_engine.model import load_model
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Req, Scheduler, SchedulerArgs
from pd_fsm.schedulers.disaggregation import DisaggregationArgs
from tests.support.pd_pair import PDPair, serve_through

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "hf" / "qwen3_moe"


def _greedy(tp: int) -> dict[str, list[int]]:
    return _run(tp)[1]


def _run(tp: int) -> tuple[Scheduler, dict[str, list[int]]]:
    ref = json.loads((FIXTURE / "reference.json").read_text())
    sched = Scheduler(SchedulerArgs(model=str(FIXTURE), num_pages=64, page_size=4, max_running=4,
                                    max_batched_tokens=64, tp_size=tp))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=ref["new_tokens"], ignore_eos=True)
    for i, ids in enumerate(ref["prompts"]):
        sched.add_request(Req(f"r{i}", ids, sampling))
    out: dict[str, list[int]] = {}
    for o in sched.run_until_idle():
        out.setdefault(o.rid, []).extend(o.new_token_ids)
    return sched, out


def test_moe_at_tp2_and_tp4_equals_tp1_and_transformers() -> None:
    ref = json.loads((FIXTURE / "reference.json").read_text())
    expected = {f"r{i}": g for i, g in enumerate(ref["greedy"])}
    assert _greedy(1) == expected
    for tp in (2, 4):
        sched, got = _run(tp)
        assert got == expected, tp
        layer = sched.runner.params["layers"][0]
        assert tuple(layer["e_gate"].sharding.spec) == (None, None, "tp")
        assert tuple(layer["e_down"].sharding.spec) == (None, "tp", None)
        assert layer["router"].sharding.is_fully_replicated


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_moe_pd_between_tp_sizes_equals_transformers(p_tp: int, d_tp: int) -> None:
    """P and D of different tp: D regroups P's KV shards (the MoE does not change the KV)."""
    ref = json.loads((FIXTURE / "reference.json").read_text())
    model = load_model(str(FIXTURE))

    def args(mode: str, tp: int) -> DisaggregationArgs:
        return DisaggregationArgs(model=str(FIXTURE), num_pages=64, page_size=4, max_running=4,
                                  max_batched_tokens=64, tp_size=tp, disaggregation_mode=mode,
                                  instance_id=f"{mode}-0")

    sampling = SamplingParams(temperature=0.0, max_new_tokens=ref["new_tokens"], ignore_eos=True)
    got = serve_through(PDPair(model, args("prefill", p_tp), args("decode", d_tp)),
                        ref["prompts"], sampling, 200)
    assert {rid: v["ids"] for rid, v in got.items()} == {
        f"r{i}": g for i, g in enumerate(ref["greedy"])}
