"""What the API features cost in the scheduler (SmolLM2-135M, warm, batch of one unless said):

* decode ms/token with a JSON-schema constraint (grammar bitmask filled per step, applied in
  the jitted sampler) and with top-5 log-probs, against the plain request — interleaved rounds
  in one run, medians;
* n=4 sequences of one prompt (one prefill, forked pages) against 4 separate requests of the
  same prompt (4 prefills), submitted at once: wall time to the last token, prompt tokens
  prefilled and peak pages held.

Prints figures; asserts nothing. Run: ``.venv/bin/python bench/bench_api.py``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from pd_fsm.jax_engine.sampling.grammar import Constraint
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Req, Scheduler, SchedulerArgs
from pd_fsm.schedulers.request import LogprobSpec
from pd_fsm.schedulers.warm_up import warm_up

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "facts"],
          "properties": {"city": {"type": "string", "maxLength": 40},
                         "facts": {"type": "array", "items": {"type": "string"}}}}
PROMPT = ("<|im_start|>user\nDescribe Paris as JSON with a city name and a list of facts."
          "<|im_end|>\n<|im_start|>assistant\n")


def _decode_ms_per_token(sched: Scheduler, make: Callable[[int], Req], rounds: int,
                         cases: dict[str, Callable[[int], Req]]) -> dict[str, list[float]]:
    """Per case, per round: the mean wall ms of the decode steps of one request."""
    out: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        for name, build in cases.items():
            req = build(r)
            sched.add_request(req)
            sched.step()  # the prefill (and the first token)
            steps, t0 = 0, time.perf_counter()
            while sched.has_work():
                sched.step()
                steps += 1
            if steps:
                out[name].append(1000 * (time.perf_counter() - t0) / steps)
    return out


def _n_against_separate(sched: Scheduler, prompt: list[int], n: int, tokens: int,
                        rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"n": [], "separate": [], "n_pages": [], "separate_pages": []}
    for r in range(rounds):
        for name in ("n", "separate"):
            if name == "n":
                reqs = [Req(f"n{r}", prompt, SamplingParams(
                    temperature=1.0, max_new_tokens=tokens, ignore_eos=True, seed=r, n=n))]
            else:
                reqs = [Req(f"s{r}-{i}", prompt, SamplingParams(
                    temperature=1.0, max_new_tokens=tokens, ignore_eos=True, seed=r + i))
                    for i in range(n)]
            total = sched.page_budget.allocator.total
            peak = 0
            t0 = time.perf_counter()
            for req in reqs:
                sched.add_request(req)
            while sched.has_work():
                sched.step()
                peak = max(peak, total - sched.page_budget.allocator.num_free)
            out[name].append(1000 * (time.perf_counter() - t0))
            out[f"{name}_pages"].append(peak)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    args = ap.parse_args()

    sched = Scheduler(SchedulerArgs(model="smollm2", num_pages=512, page_size=16,
                                    max_running=8, max_batched_tokens=512))
    t0 = time.perf_counter()
    warm_up(sched)
    print(f"smollm2, warmed up in {time.perf_counter() - t0:.1f} s")
    prompt = sched.tokenizer.encode(PROMPT)
    constraint = Constraint("json_schema", json.dumps(SCHEMA))

    def plain(r: int) -> Req:
        return Req(f"p{r}", prompt, SamplingParams(temperature=0.0, max_new_tokens=args.tokens,
                                                   ignore_eos=True))

    def schema(r: int) -> Req:
        return Req(f"j{r}", prompt, SamplingParams(temperature=0.0, max_new_tokens=args.tokens,
                                                   ignore_eos=True, constraint=constraint))

    def top5(r: int) -> Req:
        return Req(f"t{r}", prompt, SamplingParams(temperature=0.0, max_new_tokens=args.tokens,
                                                   ignore_eos=True), logprobs=LogprobSpec(top=5))

    cases = {"plain": plain, "json_schema": schema, "top_logprobs=5": top5}
    _decode_ms_per_token(sched, plain, 1, cases)  # the grammar engine's tokenizer, first masks
    figures = _decode_ms_per_token(sched, plain, args.rounds, cases)
    base = statistics.median(figures["plain"])
    print(f"\ndecode ms/token, batch 1, {args.tokens} tokens, {args.rounds} interleaved rounds:")
    for name, values in figures.items():
        med = statistics.median(values)
        print(f"  {name:16s} {med:7.2f} ms/token  ({med / base:.2f}x plain; "
              f"min {min(values):.2f}, max {max(values):.2f})")

    long_prompt = (prompt * (args.prompt_tokens // len(prompt) + 1))[: args.prompt_tokens]
    nsep = _n_against_separate(sched, long_prompt, 4, args.tokens, args.rounds)
    n_ms, sep_ms = statistics.median(nsep["n"]), statistics.median(nsep["separate"])
    print(f"\nn=4 against 4 separate requests, {args.prompt_tokens}-token prompt, "
          f"{args.tokens} tokens each, {args.rounds} interleaved rounds:")
    print(f"  n=4         {n_ms:8.1f} ms to the last token; prompt tokens prefilled "
          f"{args.prompt_tokens}; peak pages {max(nsep['n_pages']):.0f}")
    print(f"  4 separate  {sep_ms:8.1f} ms to the last token; prompt tokens prefilled "
          f"{4 * args.prompt_tokens}; peak pages {max(nsep['separate_pages']):.0f}")
    print(f"  n=4 takes {n_ms / sep_ms:.2f}x the time of 4 separate requests")


if __name__ == "__main__":
    main()
