"""`pd-fsm bench`: a serving benchmark in the manner of sglang's bench_serving.

A fixed-seed prompt set (short, long or mixed), sent at a request rate (Poisson arrivals) or up
to a concurrency, all streamed, so that each request gives its time to first token (TTFT), its
inter-token latencies (ITL, the gaps between streamed chunks), and its end-to-end latency.
``--compare URL`` runs the same load against a second server (typically a colocated worker) and
prints the ratio next to each figure: the machines are shared and noisy, ratios from one run are
what compare.

Then where the target's TTFT went: the ``/metrics`` of the target, of the workers a pd-fsm proxy
names at ``GET /workers``, and of every ``--metrics-url`` are scraped before and after the run;
the bucket deltas of each phase histogram (``pd_fsm.io_trio.phases``) give its p50/p99
this run, interpolated in the buckets as Prometheus' ``histogram_quantile`` does.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from pd_fsm.io_trio.api_key import bearer
from pd_fsm.io_trio.phases import PHASE_BY_KEY, PHASES, TTFT_NAME
from pd_fsm.io_trio.unix_sockets import display, service_url, unix_mounts

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


# The random dataset's token ids: within every vocabulary pd_fsm serves (SmolLM2's 49,152 is
# the smallest), clear of the low ids where tokenizers keep their special tokens.
RANDOM_IDS = (1_000, 32_000)


@attrs.frozen
class BenchPrompt:
    text: str
    words: int
    max_tokens: int | None = None  # this prompt's answer length; None: the load's max_tokens
    ids: tuple[int, ...] | None = None  # token ids sent as they are (the random dataset)


def random_prompts(n: int, seed: int, input_len: int, output_len: int, range_ratio: float = 1.0,
                   ids: tuple[int, int] = RANDOM_IDS) -> list[BenchPrompt]:
    """sglang's ``--dataset-name random``: ``n`` prompts of token ids drawn uniformly, each of
    ``input_len`` tokens and asking ``output_len`` (both drawn from ``[ratio * len, len]``), so
    a load is the same number of tokens on every tokenizer; ids in ``[ids[0], ids[1])``."""
    rng = random.Random(seed)

    def length(top: int) -> int:
        return rng.randint(max(1, int(top * range_ratio)), top)

    prompts = []
    for _ in range(n):
        k = length(input_len)
        prompts.append(BenchPrompt("", k, length(output_len),
                              tuple(rng.randrange(*ids) for _ in range(k))))
    return prompts


SHARED = ("shared-prefix", "multi-turn")  # datasets whose prompts share prefixes


def _words(rng: random.Random, k: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(k))


def make_prompts(dataset: str, n: int, seed: int, groups: int = 4,
                 prefix_words: int = 300) -> list[BenchPrompt]:
    """``n`` prompts drawn from a fixed word list: the same for given arguments.

    ``shared-prefix``: ``groups`` system prompts of ``prefix_words`` words, prompt i the
    (i mod groups)-th one and a question of 8 to 32 words. ``multi-turn``: ``groups``
    conversations, prompt i the next turn of conversation i mod groups: a system prompt of
    ``prefix_words`` words, every earlier turn (question and a 16-word answer) and a new
    question of 8 to 16 words, so each turn resends the history."""
    rng = random.Random(seed)
    if dataset in SHARED:
        systems = [_words(rng, prefix_words) for _ in range(groups)]
        history = list(systems)
        prompts = []
        for i in range(n):
            g = i % groups
            if dataset == "shared-prefix":
                text = f"{systems[g]} Question: {_words(rng, rng.randint(8, 32))}"
            else:
                text = f"{history[g]} Question: {_words(rng, rng.randint(8, 16))}"
                history[g] = f"{text} Answer: {_words(rng, 16)}"
            prompts.append(BenchPrompt(text, len(text.split())))
        return prompts
    prompts = []
    for i in range(n):
        kind = dataset if dataset != "mixed" else ("short" if i % 2 == 0 else "long")
        lo, hi = DATASETS[kind]
        k = rng.randint(lo, hi)
        prompts.append(BenchPrompt(_words(rng, k), k))
    return prompts


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items ``a`` and ``b`` share (characters of strings, token ids)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prefix_reuse(prompts: Sequence[BenchPrompt]) -> float:
    """The share of the prompts' characters that begin like an earlier prompt (the longest
    common prefix with any earlier one): what a perfect prefix cache could skip."""
    earlier: list[str] = []  # sorted: the longest common prefix is with a neighbour
    total = shared = 0
    for p in prompts:
        total += len(p.text)
        at = bisect.bisect_left(earlier, p.text)
        shared += max((common_prefix(p.text, q) for q in earlier[max(at - 1, 0) : at + 1]),
                      default=0)
        earlier.insert(at, p.text)
    return shared / total if total else 0.0


@attrs.define
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = math.nan
    itl: list[float] = attrs.field(factory=list)
    e2e: float = math.nan
    output_tokens: int = 0


def _body(endpoint: str, prompt: BenchPrompt, max_tokens: int, model: str | None) -> dict[str, Any]:
    if endpoint == "generate":
        given = {"text": prompt.text} if prompt.ids is None else {"input_ids": list(prompt.ids)}
        return {**given, "stream": True,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                    "ignore_eos": True}}
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text if prompt.ids is None else list(prompt.ids)
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
    duration: float  # the first request's send to the last answer's end
    # The first send to the end of the arrival schedule (the last Poisson gap included): the
    # rate the requests really arrived at is len(results) / arrivals (nan: not recorded).
    arrivals: float = math.nan

    def arrival_rate(self) -> float:
        """Requests per second as they arrived: a sample of a few Poisson arrivals strays far
        from its nominal rate (16 at a seeded 1 req/s came 17 % faster)."""
        return len(self.results) / self.arrivals if self.arrivals > 0 else math.nan

    def goodput(self, ttft_s: float, tpot_s: float) -> tuple[int, float]:
        """Requests (and requests per second of the run) that met both targets: TTFT, and the
        mean gap between their output tokens (DistServe's TPOT)."""
        met = [r for r in self.results if r.ok and r.ttft <= ttft_s
               and (sum(r.itl) / len(r.itl) if r.itl else 0.0) <= tpot_s]
        return len(met), len(met) / self.duration if self.duration else math.nan

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


async def run_load(url: str, args: argparse.Namespace, prompts: list[BenchPrompt],
                   arrivals: Sequence[float] | None = None) -> Summary:
    """Every prompt, streamed, at Poisson arrivals of ``args.request_rate`` (all at once when
    infinite) or, with ``arrivals``, prompt i sent ``arrivals[i]`` seconds after the start: a
    schedule drawn beforehand (a workload whose phases shift), kept to whatever the server does.
    """
    rng = random.Random(args.seed + 1)  # arrivals: the same schedule for both servers
    results: list[Result] = [Result() for _ in prompts]
    capacity: int = args.max_concurrency or len(prompts) or 1  # --max-concurrency: an int
    limiter = trio.CapacityLimiter(capacity)
    limits = httpx.Limits(max_connections=max(capacity, 1) + 4)
    headers = bearer(args.api_key) if getattr(args, "api_key", None) else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits,
                                 headers=headers, mounts=unix_mounts(limits)) as http:
        start = trio.current_time()

        async def send(i: int, prompt: BenchPrompt) -> None:
            async with limiter:
                body = _body(args.endpoint, prompt, prompt.max_tokens or args.max_tokens,
                             args.model)
                results[i] = await one_request(http, url.rstrip("/"), args.endpoint, body)

        async with trio.open_nursery() as nursery:
            for i, prompt in enumerate(prompts):
                if arrivals is not None:
                    await trio.sleep_until(start + arrivals[i])
                nursery.start_soon(send, i, prompt)
                if arrivals is None and math.isfinite(args.request_rate):
                    await trio.sleep(rng.expovariate(args.request_rate))
            arrived = trio.current_time() - start
        return Summary(results, trio.current_time() - start, arrived)


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


# ----------------------------------------------------------------------------- phases

Buckets = dict[float, float]  # upper bound (inf for +Inf) -> cumulative count
Histograms = dict[str, Buckets]  # metric name -> its buckets (label sets summed)


def histogram_quantile(q: float, buckets: Buckets) -> float:
    """The ``q`` quantile (0..1) of a histogram's cumulative bucket counts, interpolated
    linearly inside the bucket it falls in, as Prometheus' ``histogram_quantile`` does: the
    first bucket starts at 0, a rank in the +Inf bucket answers the highest finite bound; NaN
    without observations."""
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        return math.nan
    total = buckets[bounds[-1]]
    if total <= 0:
        return math.nan
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for i, bound in enumerate(bounds):
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return bounds[i - 1] if i > 0 else math.nan
            if i == 0 and bound <= 0:
                return bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return math.nan


def parse_histograms(text: str) -> Histograms:
    """Every histogram in a Prometheus text exposition, its label sets summed per bound."""
    out: Histograms = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        buckets = out.setdefault(family.name, {})
        for sample in family.samples:
            if sample.name.endswith("_bucket") and "le" in sample.labels:
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return out


def diff_histograms(before: Histograms, after: Histograms) -> Histograms:
    """``after - before`` per bucket: what a run added (a process that restarted in between
    counts from zero)."""
    out: Histograms = {}
    for name, buckets in after.items():
        old = before.get(name, {})
        delta = {le: n - old.get(le, 0.0) for le, n in buckets.items()}
        out[name] = buckets if any(v < 0 for v in delta.values()) else delta
    return out


def side_of(hists: Histograms) -> str:
    """Who exposed these histograms: "proxy", "P", "D" or "worker" (colocated, or unknown)."""
    names = set(hists)
    roles = {p.role for p in PHASES if p.name in names}
    if "proxy" in roles or any(n.startswith("pd_fsm_proxy_") for n in names):
        return "proxy"
    if "prefill" in roles:
        return "P"
    if "decode" in roles:
        return "D"
    return "worker"


_SIDES = ("D", "P", "worker", "proxy")
# Rows in the order a PD request meets them; the workers' TTFT after their own phases.
_ROWS = ([p.name for p in PHASES if p.role != "proxy"] + [TTFT_NAME]
         + [p.name for p in PHASES if p.role == "proxy"])
_LABEL = {p.name: p.key.removeprefix("proxy_") for p in PHASES} | {TTFT_NAME: "time_to_first_token"}


def _fmt(value: float, name: str) -> str:
    if not math.isfinite(value):
        return "-"
    if name.endswith("_seconds"):
        return f"{value * 1000:.1f} ms"
    if name.endswith("_bytes"):
        return f"{value / 1e6:.2f} MB"
    if name == PHASE_BY_KEY["kv_transfer_gbps"].name:
        return f"{value:.3f} GB/s"
    return f"{value:.3g}"


@attrs.frozen
class PhaseRow:
    """One (side, phase) of a run: p50, p99 (in the metric's unit) and the observations."""

    side: str  # "P", "D", "worker" or "proxy"
    name: str  # the metric
    label: str  # the phase's short name
    p50: float
    p99: float
    count: float


def phase_rows(before: dict[str, Histograms], after: dict[str, Histograms]) -> list[PhaseRow]:
    """The phases of one run from ``/metrics`` scrapes (URL -> histograms) taken before and
    after it: p50, p99 and count per (side, phase), summed over a side's workers, in the order a
    PD request meets them."""
    merged: dict[tuple[str, str], Buckets] = {}
    for url, hists in after.items():
        side = side_of(hists)
        for name, buckets in diff_histograms(before.get(url, {}), hists).items():
            if name not in _LABEL:
                continue
            into = merged.setdefault((side, name), {})
            for le, n in buckets.items():
                into[le] = into.get(le, 0.0) + n
    return [PhaseRow(side, name, _LABEL[name], histogram_quantile(0.5, row),
                     histogram_quantile(0.99, row), row.get(math.inf, 0.0))
            for name in _ROWS for side in _SIDES
            if (row := merged.get((side, name))) is not None]


def phase_table(before: dict[str, Histograms], after: dict[str, Histograms]) -> str:
    """:func:`phase_rows` as the table the benchmarks print."""
    head = f"{'side':<8}{'phase':<24}{'p50':>14}{'p99':>14}{'count':>8}"
    lines = ["where the time went (p50/p99 interpolated in /metrics histogram buckets, this run)",
             head, "-" * len(head)]
    for r in phase_rows(before, after):
        lines.append(f"{r.side:<8}{r.label:<24}{_fmt(r.p50, r.name):>14}"
                     f"{_fmt(r.p99, r.name):>14}{r.count:>8.0f}")
    if len(lines) == 3:
        lines.append(f"no phase histograms at {', '.join(after) or 'any metrics URL'}")
    return "\n".join(lines)


async def metrics_urls(http: httpx.AsyncClient, url: str, extra: Sequence[str] = ()) -> list[str]:
    """The target, the workers a pd-fsm proxy names at ``/workers`` (nothing for a worker or
    another router), and ``extra``; each once."""
    urls = [url.rstrip("/")]
    try:
        r = await http.get(f"{urls[0]}/workers")
        body = r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        body = {}
    if isinstance(body, dict):
        for role in ("prefill", "decode"):
            listed = body.get(role)
            if isinstance(listed, list):
                urls += [u.rstrip("/") for u in listed if isinstance(u, str)]
    urls += [u.rstrip("/") for u in extra]
    return list(dict.fromkeys(urls))


async def scrape(http: httpx.AsyncClient, urls: Sequence[str]) -> dict[str, Histograms]:
    """Each URL's ``/metrics`` histograms; a URL that does not answer is left out."""
    out: dict[str, Histograms] = {}
    for url in urls:
        try:
            r = await http.get(f"{url}/metrics")
            if r.status_code == 200:
                out[url] = parse_histograms(r.text)
        except (httpx.HTTPError, ValueError):
            continue
    return out


# Samples summed per side for the cache and transfer lines (counters and a histogram's sum).
_TOTALS = {
    "kv_bytes": "pd_fsm_worker_kv_transfer_bytes_sum",
    "prompt_tokens": "pd_fsm_worker_backend_prompt_tokens_total",
    "cached_tokens": "pd_fsm_worker_backend_prefix_cache_hit_tokens_total",
    "route": "pd_fsm_proxy_route_decisions_total",
}


async def scrape_totals(http: httpx.AsyncClient, urls: Sequence[str]
                        ) -> dict[str, dict[str, float]]:
    """Each URL's ``_TOTALS`` samples (a labelled one as ``what:label``)."""
    wanted = {v: k for k, v in _TOTALS.items()}
    out: dict[str, dict[str, float]] = {}
    for url in urls:
        try:
            r = await http.get(f"{url}/metrics")
        except httpx.HTTPError:
            continue
        if r.status_code != 200:
            continue
        row = out.setdefault(url, {})
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                what = wanted.get(sample.name)
                if what is not None:
                    key = ":".join([what, *sample.labels.values()])
                    row[key] = row.get(key, 0.0) + sample.value
    return out


def cache_lines(prompts: Sequence[BenchPrompt], completed: int, sides: dict[str, str],
                before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
                ) -> str:
    """Prefix reuse of the prompt set, and what this run's caches, transfers and routing did:
    KV bytes D pulled per completed request, prompt tokens each side's prefix cache served,
    the proxy's routing decisions."""
    delta: dict[str, dict[str, float]] = {}
    for url, row in after.items():
        totals = delta.setdefault(sides.get(url, "worker"), {})
        for key, value in row.items():
            totals[key] = totals.get(key, 0.0) + value - before.get(url, {}).get(key, 0.0)
    lines = [f"prefix reuse of the prompt set: {100 * prefix_reuse(prompts):.1f} % "
             "(characters that begin like an earlier prompt)"]
    pulled = delta.get("D", {}).get("kv_bytes", 0.0)
    lines.append(f"KV bytes pulled per request: {pulled / max(completed, 1) / 1e6:.3f} MB "
                 f"({pulled / 1e6:.1f} MB in all)")
    for side in ("P", "D", "worker"):
        d = delta.get(side, {})
        if d.get("prompt_tokens"):
            lines.append(f"{side}: prompt tokens from its prefix cache "
                         f"{100 * d.get('cached_tokens', 0.0) / d['prompt_tokens']:.1f} % "
                         f"({d.get('cached_tokens', 0.0):.0f} of {d['prompt_tokens']:.0f})")
    routes = {k.removeprefix("route:"): v for k, v in delta.get("proxy", {}).items()
              if k.startswith("route:") and v}
    if routes:
        lines.append("routing: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(routes.items())))
    return "\n".join(lines)


def parse_ids(spec: str) -> tuple[int, int]:
    """``--random-ids LO-HI``: the token ids drawn, LO to HI exclusive."""
    lo, _, hi = spec.partition("-")
    try:
        ids = int(lo), int(hi)
    except ValueError:
        raise ValueError(f"--random-ids {spec!r}: LO-HI (1000-32000)") from None
    if not 0 <= ids[0] < ids[1]:
        raise ValueError(f"--random-ids {spec!r}: 0 <= LO < HI")
    return ids


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """``--goodput ttft:MS tpot:MS`` (vLLM's bench_serving form) as seconds by key."""
    out: dict[str, float] = {}
    for spec in specs:
        key, _, ms = spec.partition(":")
        if key not in ("ttft", "tpot"):
            raise ValueError(f"--goodput {spec!r}: the keys are ttft and tpot (ttft:1000)")
        try:
            out[key] = float(ms) / 1000
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: milliseconds after the colon") from None
        if not out[key] > 0:
            raise ValueError(f"--goodput {spec!r}: milliseconds must be > 0")
    return out


def record(args: argparse.Namespace, target: Summary, slo: dict[str, float]) -> dict[str, Any]:
    """What ``--json`` writes: the load, its figures, its goodput, and each request's TTFT in
    the order sent (None: failed), so that one slow request shows where a percentile hides it."""
    met, rps = target.goodput(slo.get("ttft", math.inf), slo.get("tpot", math.inf))
    load = {k: getattr(args, k) for k in ("url", "endpoint", "dataset", "num_prompts",
                                            "request_rate", "max_concurrency", "max_tokens",
                                            "random_input_len", "random_output_len", "seed")}
    return {"load": {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                     for k, v in load.items()},
            "figures": {k: (None if math.isnan(v) else v) for k, v in target.rows().items()},
            "arrival_rate": target.arrival_rate(), "slo_s": slo,
            "goodput": {"met": met, "requests/s": rps},
            "ttft_ms": [round(r.ttft * 1000, 2) if r.ok else None for r in target.results],
            "errors": sorted({r.error for r in target.results if not r.ok})[:5]}


def dataset(args: argparse.Namespace, n: int, seed: int) -> list[BenchPrompt]:
    """``n`` prompts of the run's dataset from ``seed``."""
    if args.dataset == "random":
        return random_prompts(n, seed, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, parse_ids(args.random_ids))
    return make_prompts(args.dataset, n, seed, args.num_prefixes, args.prefix_words)


async def _main(args: argparse.Namespace) -> int:
    slo = parse_goodput(args.goodput)
    prompts = dataset(args, args.num_prompts, args.seed)
    if args.warmup:
        # One request per server first: compiles and caches warm outside the measurement. Its
        # prompt is none of the measured ones, which a prefix cache would then serve.
        warm = argparse.Namespace(**{**vars(args), "request_rate": math.inf})
        for url in filter(None, (args.url, args.compare)):
            await run_load(url, warm, dataset(args, 1, args.seed + 7919))
    headers = bearer(args.api_key) if args.api_key else {}
    async with httpx.AsyncClient(timeout=10, headers=headers, mounts=unix_mounts()) as http:
        urls = await metrics_urls(http, args.url, args.metrics_url)
        before = await scrape(http, urls)
        totals_before = await scrape_totals(http, urls)
        target = await run_load(args.url, args, prompts)
        after = await scrape(http, urls)
        totals_after = await scrape_totals(http, urls)
    compare = await run_load(args.compare, args, prompts) if args.compare else None
    print(render(target, compare, display(args.url), args.compare and display(args.compare)),
          flush=True)
    if slo:
        met, rps = target.goodput(slo.get("ttft", math.inf), slo.get("tpot", math.inf))
        print(f"goodput           {rps:>14.2f} requests/s ({met} of {len(target.results)} within "
              + ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in slo.items()) + ")", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record(args, target, slo), f, indent=1)
    print(phase_table(before, after), flush=True)
    sides = {url: side_of(hists) for url, hists in after.items()}
    completed = sum(r.ok for r in target.results)
    print(cache_lines(prompts, completed, sides, totals_before, totals_after), flush=True)
    return 0 if all(r.ok for r in target.results) else 1


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="benchmark a server: TTFT, ITL, E2E, throughput")
    p.add_argument("--url", required=True,
                   help="server (proxy or worker) base URL, or unix:PATH (its unix socket)")
    p.add_argument("--compare", default=None, help="run the same load against this URL too")
    p.add_argument("--endpoint", choices=tuple(PATHS), default="completions")
    p.add_argument("--dataset", choices=("short", "long", "mixed", *SHARED, "random"),
                   default="mixed",
                   help="short / long / mixed random prompts; shared-prefix: system prompts "
                        "and questions; multi-turn: conversations resending their history; "
                        "random: token ids (--random-input-len, --random-output-len)")
    p.add_argument("--random-input-len", type=int, default=1024,
                   help="random: prompt tokens (1024)")
    p.add_argument("--random-output-len", type=int, default=256,
                   help="random: output tokens asked, EOS ignored (256)")
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="random: lengths drawn from [ratio * len, len] (1.0: exactly len)")
    p.add_argument("--random-ids", default=f"{RANDOM_IDS[0]}-{RANDOM_IDS[1]}", metavar="LO-HI",
                   help="random: the token ids drawn (%(default)s: within every vocabulary "
                        "pd_fsm serves)")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="count the requests within targets: ttft:MS and/or tpot:MS (a "
                        "request's mean gap between output tokens)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the load, its figures, its goodput and each request's TTFT to PATH")
    p.add_argument("--num-prefixes", type=int, default=4,
                   help="shared-prefix / multi-turn: system prompts or conversations (4)")
    p.add_argument("--prefix-words", type=int, default=300,
                   help="shared-prefix / multi-turn: words in each system prompt (300)")
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
    p.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                   help="also scrape URL/metrics for the phase table (repeatable); a pd-fsm "
                        "proxy's workers are found without it")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if (args.num_prompts <= 0 or args.max_tokens <= 0 or args.request_rate <= 0
            or args.num_prefixes <= 0 or args.prefix_words < 0 or args.random_input_len <= 0
            or args.random_output_len <= 0 or not 0 < args.random_range_ratio <= 1):
        print("pd-fsm bench: --num-prompts, --max-tokens, --request-rate, --num-prefixes, "
              "--random-input-len, --random-output-len must be > 0 (--prefix-words >= 0, "
              "--random-range-ratio in (0, 1])",
              file=sys.stderr)
        return 2
    if args.dataset == "random" and args.endpoint == "chat":
        print("pd-fsm bench: --dataset random sends token ids: --endpoint generate or "
              "completions", file=sys.stderr)
        return 2
    try:  # unix:PATH as http://unix:PATH: (unix_sockets.py), the others as given
        parse_goodput(args.goodput)
        parse_ids(args.random_ids)
        args.url = service_url(args.url, "--url")
        args.compare = args.compare and service_url(args.compare, "--compare")
        args.metrics_url = [service_url(u, "--metrics-url") for u in args.metrics_url]
    except ValueError as exc:
        print(f"pd-fsm bench: {exc}", file=sys.stderr)
        return 2
    return trio.run(_main, args)
