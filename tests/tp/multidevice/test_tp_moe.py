"""The Qwen3-MoE reference checkpoint (``tests/fixtures/hf/qwen3_moe``) at tp 2 equals tp 1 and
transformers: attention sharded by kv-head as for dense models, every expert cut in two along its
intermediate dimension (gate/up by columns, down by rows, summed by an all-reduce), the router
replicated."""

from __future__ import annotations

import json
from pathlib import Path

from pd_fsm.jax_engine.sampling_params import SamplingParams
from pd_fsm.schedulers import Req, Scheduler, SchedulerArgs

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


def test_moe_at_tp2_equals_tp1_and_transformers() -> None:
    ref = json.loads((FIXTURE / "reference.json").read_text())
    expected = {f"r{i}": g for i, g in enumerate(ref["greedy"])}
    assert _greedy(1) == expected
    sched, got = _run(2)
    assert got == expected
    layer = sched.params["layers"][0]
    assert tuple(layer["e_gate"].sharding.spec) == (None, None, "tp")
    assert tuple(layer["e_down"].sharding.spec) == (None, "tp", None)
    assert layer["router"].sharding.is_fully_replicated
