"""`pd-fsm bench`: a serving benchmark in the manner of sglang's bench_serving.

A fixed-seed prompt set (short, long or mixed), sent at a request rate (Poisson arrivals) or up
to a concurrency, all streamed, so that each request gives its time to first token (TTFT), its
inter-token latencies (ITL, the gaps between streamed chunks), and its end-to-end latency.
``--compare URL`` runs the same load against a second server (typically a colocated worker) and
prints the ratio next to each figure: the machines are shared and noisy, ratios from one run are
what compare.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import httpx
import trio

from pd_fsm.io_trio.api_key import bearer

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her they this which be or "
    "had are not but have an were one all their there been has when who will more no if out "
    "so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did "
    "many before must through back years where much your way well down should because each "
    "just those people how too little state good very make world still own see men work long "
    "get here between both life being under never day same another know while last might us "
    "great old year off come since against go came right used take three river capital city "
    "mountain history science music language garden ocean winter summer bridge market"
)
WORDS = tuple(_WORD_TEXT.split())

DATASETS = {"short": (8, 32), "long": (200, 400)}


@attrs.frozen
class Prompt:
    text: str
    words: int


def make_prompts(dataset: str, n: int, seed: int) -> list[Prompt]:
    """``n`` prompts drawn from a fixed word list: the same for a given (dataset, n, seed)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        kind = dataset if dataset != "mixed" else ("short" if i % 2 == 0 else "long")
        lo, hi = DATASETS[kind]
        k = rng.randint(lo, hi)
        prompts.append(Prompt(" ".join(rng.choice(WORDS) for _ in range(k)), k))
    return prompts


@attrs.define
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = math.nan
    itl: list[float] = attrs.field(factory=list)
    e2e: float = math.nan
    output_tokens: int = 0


def _body(endpoint: str, prompt: Prompt, max_tokens: int, model: str | None) -> dict[str, Any]:
    if endpoint == "generate":
        return {"text": prompt.text, "stream": True,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                    "ignore_eos": True}}
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    return body


PATHS = {"generate": "/generate", "completions": "/v1/completions",
         "chat": "/v1/chat/completions"}


def _has_text(endpoint: str, event: dict[str, Any], previous_text: str) -> bool:
    if endpoint == "generate":
        return bool(event.get("output_ids")) or len(event.get("text", "")) > len(previous_text)
    choices = event.get("choices") or []
    if not choices:
        return False
    c = choices[0]
    return bool(c.get("text") or (c.get("delta") or {}).get("content"))


async def one_request(http: httpx.AsyncClient, url: str, endpoint: str, body: dict[str, Any]
                      ) -> Result:
    res = Result()
    start = trio.current_time()
    last: float | None = None
    text = ""
    try:
        async with http.stream("POST", url + PATHS[endpoint], json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                now = trio.current_time()
                if "error" in event:
                    res.error = str(event["error"])
                    return res
                if _has_text(endpoint, event, text):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if endpoint == "generate":
                    text = event.get("text", text)
                    res.output_tokens = event.get("meta_info", {}).get("completion_tokens", 0)
                elif event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
    except (httpx.HTTPError, ValueError) as exc:
        res.error = repr(exc)
        return res
    res.e2e = trio.current_time() - start
    res.ok = last is not None
    if not res.ok:
        res.error = "no output"
    return res


@attrs.frozen
class Summary:
    results: list[Result]
    duration: float

    def _pct(self, values: list[float], q: float) -> float:
        if not values:
            return math.nan
        s = sorted(values)
        return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]

    def rows(self) -> dict[str, float]:
        ok = [r for r in self.results if r.ok]
        ttft = [r.ttft for r in ok]
        itl = [x for r in ok for x in r.itl]
        e2e = [r.e2e for r in ok]
        tokens = sum(r.output_tokens for r in ok)
        out: dict[str, float] = {
            "completed": len(ok),
            "failed": len(self.results) - len(ok),
            "duration s": self.duration,
            "requests/s": len(ok) / self.duration if self.duration else math.nan,
            "output tokens/s": tokens / self.duration if self.duration else math.nan,
        }
        for name, values in (("TTFT", ttft), ("ITL", itl), ("E2E", e2e)):
            for q in (50, 90, 99):
                out[f"{name} p{q} ms"] = self._pct(values, q) * 1000
        return out


async def run_load(url: str, args: argparse.Namespace, prompts: list[Prompt]) -> Summary:
    rng = random.Random(args.seed + 1)  # arrivals: the same schedule for both servers
    results: list[Result] = [Result() for _ in prompts]
    limiter = trio.CapacityLimiter(args.max_concurrency or len(prompts) or 1)
    limits = httpx.Limits(max_connections=max(limiter.total_tokens, 1) + 4)
    headers = bearer(args.api_key) if getattr(args, "api_key", None) else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits,
                                 headers=headers) as http:
        start = trio.current_time()

        async def send(i: int, prompt: Prompt) -> None:
            async with limiter:
                body = _body(args.endpoint, prompt, args.max_tokens, args.model)
                results[i] = await one_request(http, url.rstrip("/"), args.endpoint, body)

        async with trio.open_nursery() as nursery:
            for i, prompt in enumerate(prompts):
                nursery.start_soon(send, i, prompt)
                if math.isfinite(args.request_rate):
                    await trio.sleep(rng.expovariate(args.request_rate))
        return Summary(results, trio.current_time() - start)


def render(target: Summary, compare: Summary | None, url: str, compare_url: str | None) -> str:
    rows = target.rows()
    other = compare.rows() if compare else None
    head = f"{'metric':<18}{'target':>14}"
    if other is not None:
        head += f"{'compare':>14}{'target/compare':>16}"
    lines = [f"target:  {url}"] + ([f"compare: {compare_url}"] if compare_url else [])
    lines += [head, "-" * len(head)]
    for key, value in rows.items():
        line = f"{key:<18}{value:>14.2f}"
        if other is not None:
            o = other[key]
            ratio = value / o if o and math.isfinite(o) and math.isfinite(value) else math.nan
            line += f"{o:>14.2f}{ratio:>16.2f}"
        lines.append(line)
    errors = [r.error for r in target.results if not r.ok]
    if errors:
        lines.append(f"first failure: {errors[0]}")
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> int:
    prompts = make_prompts(args.dataset, args.num_prompts, args.seed)
    if args.warmup:
        # One request per server first: compiles and caches warm outside the measurement.
        warm = argparse.Namespace(**{**vars(args), "request_rate": math.inf})
        for url in filter(None, (args.url, args.compare)):
            await run_load(url, warm, prompts[:1])
    target = await run_load(args.url, args, prompts)
    compare = await run_load(args.compare, args, prompts) if args.compare else None
    print(render(target, compare, args.url, args.compare), flush=True)
    return 0 if all(r.ok for r in target.results) else 1


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="benchmark a server: TTFT, ITL, E2E, throughput")
    p.add_argument("--url", required=True, help="server (proxy or worker) base URL")
    p.add_argument("--compare", default=None, help="run the same load against this URL too")
    p.add_argument("--endpoint", choices=tuple(PATHS), default="completions")
    p.add_argument("--dataset", choices=("short", "long", "mixed"), default="mixed")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default=None, help="the model field of OpenAI bodies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.num_prompts <= 0 or args.max_tokens <= 0 or args.request_rate <= 0:
        print("pd-fsm bench: --num-prompts, --max-tokens, --request-rate must be > 0",
              file=sys.stderr)
        return 2
    return trio.run(_main, args)


def run(argv: Sequence[str]) -> int:
    from pd_fsm.cli import main as cli_main

    return cli_main(["bench", *argv])
