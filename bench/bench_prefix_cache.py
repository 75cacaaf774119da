"""The prefix cache on a shared-prefix workload (SmolLM2-135M, the scheduler alone, warm):
one system prompt and many questions, and a multi-turn chat that resends its history; each
request alone (batch of one), with and without ``radix_cache``, alternated request by request
in one run so both see the same machine. Prints TTFT (submit to first token) p50/p99, prompt
tokens prefilled, and the cache's hit rate. Asserts nothing.

Run: ``.venv/bin/python bench/bench_prefix_cache.py``
"""

from __future__ import annotations

import argparse
import statistics
import time

import plots  # bench/, beside this script

from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Req, Scheduler, SchedulerArgs
from pd_fsm.schedulers.warm_up import warm_up

SYSTEM = ("<|im_start|>system\nYou are a museum guide in Paris. You answer visitors' questions "
          "about the collections, the opening hours, the tickets, the cafés and the gardens, "
          "briefly and politely, and you always suggest one painting worth seeing nearby. The "
          "museum opens at nine and closes at six, on Fridays at nine in the evening; tickets "
          "are seventeen euros, free for visitors under eighteen.<|im_end|>\n")
QUESTIONS = ["Where is the Mona Lisa?", "When do you close today?", "Is there a café?",
             "How much is a ticket?", "Can I bring a stroller?", "Where are the gardens?",
             "Do you have Vermeer?", "Is photography allowed?", "Where is the cloakroom?",
             "What should I see first?", "Are there guided tours?", "Where can I sit down?"]


def _ttft(sched: Scheduler, req: Req) -> float:
    t0 = time.perf_counter()
    sched.add_request(req)
    while not req.output_ids:
        sched.step()
    ttft = time.perf_counter() - t0
    sched.run_until_idle()
    return ttft


def _prompts(tok: object, kind: str) -> list[list[int]]:
    encode = tok.encode  # type: ignore[attr-defined]
    if kind == "system":
        return [encode(SYSTEM + f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
                for q in QUESTIONS]
    history, out = SYSTEM, []
    for q in QUESTIONS:  # each turn resends the whole conversation so far
        history += f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\nCertainly.<|im_end|>\n"
        out.append(encode(history + "<|im_start|>assistant\n"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()

    def scheduler(cache: bool) -> Scheduler:
        return Scheduler(SchedulerArgs(model="smollm2", num_pages=512, page_size=16,
                                       max_running=4, max_batched_tokens=512, radix_cache=cache))

    plain, cached = scheduler(False), scheduler(True)
    t0 = time.perf_counter()
    warm_up(plain)
    warm_up(cached)
    print(f"smollm2, both schedulers warmed up in {time.perf_counter() - t0:.1f} s")
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.tokens)
    for kind in ("system", "multi-turn"):
        prompts = _prompts(plain.tokenizer, kind)
        ttft: dict[str, list[float]] = {"off": [], "on": []}
        prefilled = {"off": 0, "on": 0}
        for i, ids in enumerate(prompts):
            for name, sched in (("off", plain), ("on", cached)):
                req = Req(f"{kind}-{name}-{i}", ids, sp)
                ttft[name].append(_ttft(sched, req))
                prefilled[name] += len(ids) - req.cached_tokens
        total = sum(len(p) for p in prompts)
        print(f"\n{kind}: {len(prompts)} requests, {total} prompt tokens "
              f"(mean {total / len(prompts):.0f}), one at a time")
        for name in ("off", "on"):
            t = sorted(ttft[name])
            p99 = t[min(len(t) - 1, round(0.99 * (len(t) - 1)))]
            print(f"  cache {name:3s}  TTFT p50 {1000 * statistics.median(t):7.1f} ms, "
                  f"p99 {1000 * p99:7.1f} ms; prompt tokens prefilled {prefilled[name]} "
                  f"({prefilled[name] / total:.0%})")
        speedup = statistics.median(ttft["off"]) / statistics.median(ttft["on"])
        print(f"  TTFT p50 with the cache: {speedup:.2f}x better")
        plots.latency_cdf(f"prefix_cache_{kind}", f"Prefix cache, {kind} prompts one at a time",
                          {f"cache {name}": ttft[name] for name in ("off", "on")}, "TTFT")
    cache = cached.page_budget.cache
    assert cache is not None
    print(f"\ncache: {cache.hits} pages handed out, {cache.pages} cached, "
          f"{cache.evicted} evicted")


if __name__ == "__main__":
    main()
