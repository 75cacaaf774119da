"""Issue 31 §2: TTFT through PD across a link as slow as a real one, against colocated.

P (and the bootstrap server, and a colocated worker: the baseline on the same cores) in network
namespace A, D, the proxy and the client in B, joined by a veth pair shaped with ``tc``'s ``tbf``
(``tests/integration/netns_support.py``: ``Hosts.shape``). Per prompt size and repetition, one
streamed request to the colocated worker (link unshaped) and one through the proxy per link rate,
the rate changed in place between requests (``tc qdisc replace``), the order of the links rotated
each repetition. Nothing is pinned: P and the colocated worker both have the machine's cores, and
only one request runs at a time.

Per size and link: TTFT(PD) and TTFT(colocated) p50/p99, their difference, the KV bytes D pulled
(D's ``/metrics``, read before and after each request), the transfer time those bytes imply at the
link's rate (unshaped: at the raw socket's measured rate on the veth), and the fraction of that
transfer hidden behind prefill, 1 - (TTFT(PD) - TTFT(colocated)) / transfer time. Also D's pull
rate (its ``kv_transfer_gbps``: bytes over the pull's own time) against a plain TCP stream on the
same link. Prints tables; asserts nothing. Needs root (namespaces, ``tc``).

    .venv/bin/python bench/bench_shaped_link.py                         # SmolLM2, 512 and 2,048
    .venv/bin/python bench/bench_shaped_link.py --sizes 512 --repeats 5 --json out.json
    .venv/bin/python bench/bench_shaped_link.py --model tiny --sizes 512 2048 8192

A size is the whole context (prompt + ``--max-tokens``), as in ``bench_handoff.py``: both models'
positions end at 8,192, so ``--sizes 8192`` is a prompt of 8,190 tokens (a SmolLM2 one took ~250
s per prefill on this 2-core machine, so it is not in the default run; the tiny model's KV is 512
bytes a token, 4 MB at 8,192).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.failure_support import cli  # noqa: E402
from tests.integration.netns_support import (  # noqa: E402
    NsFleet,
    ShapingUnavailable,
    namespaces_unavailable,
)

VOCAB = {"tiny": 256, "smollm2": 40000}
BOOT, P_PORT, P_SIDE, COLOC_PORT, D_PORT, PROXY_PORT = 8998, 30000, 31000, 30002, 30001, 8000
UNSHAPED = "unshaped"
COLOC = "colocated"
# D's samples read around each request (histogram sums: one request at a time, so each delta is
# that request's own value).
D_SUMS = {"pull_s": "pd_fsm_worker_kv_pull_seconds_sum",
          "pull_gbps": "pd_fsm_worker_kv_transfer_gigabytes_per_second_sum",
          "bytes": "pd_fsm_worker_kv_transfer_bytes_sum",
          "pulls": "pd_fsm_worker_kv_pull_seconds_count",
          "scatter_s": "pd_fsm_worker_kv_scatter_seconds_sum",
          "tail_s": "pd_fsm_worker_kv_tail_seconds_sum"}


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _link_bps(link: str) -> float | None:
    return None if link == UNSHAPED else float(link) * 1e9


def _spread(xs: list[float]) -> float:
    """The median absolute deviation, scaled to a normal's standard deviation (times 1.4826): one
    request slowed by another process's burst moves it little, unlike the standard deviation
    (a loaded machine gives a few such outliers in every run)."""
    mid = statistics.median(xs)
    return 1.4826 * statistics.median(abs(x - mid) for x in xs)


def _quantile(xs: list[float], q: float) -> float:
    """Linear interpolation between order statistics (p99 of a few samples is about the max)."""
    xs = sorted(xs)
    at = q * (len(xs) - 1)
    lo = int(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def _start(fleet: NsFleet, args: argparse.Namespace) -> dict[str, str]:
    hosts = fleet.hosts
    a, b = hosts.ip_a, hosts.ip_b
    longest = max(args.sizes)
    pages = 2 * (longest // args.page_size + 1) + 16
    model = ["--model", args.model, "--page-size", str(args.page_size), "--context-length",
             str(longest), "--num-pages", str(pages), "--max-running", "4",
             "--max-batched-tokens", str(args.chunk), "--warmup", "minimal",
             "--log-level", "WARNING"]
    pd = ["--disaggregation-bootstrap-host", a, "--disaggregation-bootstrap-port", str(BOOT)]
    urls = {"boot": f"http://{a}:{BOOT}", COLOC: f"http://{a}:{COLOC_PORT}",
            "d": f"http://{b}:{D_PORT}"}
    fleet.start("bootstrap", hosts.a, cli("bootstrap", "--host", a, "--port", str(BOOT)))
    # Every prompt is new, but the caches are off anyway: a hit would hide the prefill.
    # P's KV hold lease is long: with the production windows (30 s, +20 s a heartbeat) a
    # 2,048-token SmolLM2 room expired on P under load 5 (a prefill of 20+ s here) before D's
    # pull, which measures the loaded machine, not the link.
    lease = ["--disaggregation-lease-initial", "600", "--disaggregation-lease-extension", "600"]
    # One P per --stream-tokens setting (0: the KV after the whole prefill), each behind a proxy
    # of its own with static lists; one D takes them all.
    for i, stream in enumerate(args.stream_tokens):
        urls[f"p{i}"] = f"http://{a}:{P_PORT + 10 * i}"
        fleet.start(f"prefill{i}", hosts.a, cli(
            "serve", *model, "--disaggregation-mode", "prefill", "--host", a,
            "--port", str(P_PORT + 10 * i), "--disaggregation-side-channel-port",
            str(P_SIDE + i), "--disable-radix-cache", "--disaggregation-stream-tokens",
            str(stream), *lease, *pd))
    fleet.start(COLOC, hosts.a, cli("serve", *model, "--host", a, "--port", str(COLOC_PORT),
                                    "--disable-radix-cache"))
    fleet.start("decode", hosts.b, cli("serve", *model, "--disaggregation-mode", "decode",
                                       "--host", b, "--port", str(D_PORT), *pd))
    fleet.wait_ok([f"{u}/health" for k, u in urls.items() if k not in ("proxy", "p")])
    for i in range(len(args.stream_tokens)):
        urls[f"proxy{i}"] = f"http://{b}:{PROXY_PORT + i}"
        fleet.start(f"proxy{i}", hosts.b, cli(
            "proxy", "--host", b, "--port", str(PROXY_PORT + i), "--prefill", urls[f"p{i}"],
            str(P_SIDE + i), "--decode", urls["d"], "--log-level", "WARNING"))
    fleet.wait_ok([f"{urls[f'proxy{i}']}/health" for i in range(len(args.stream_tokens))])
    return urls


def _ttft(fleet: NsFleet, url: str, args: argparse.Namespace, size: int, seed: int) -> float:
    rng = random.Random(seed)  # a new prompt every request: nothing cached anywhere
    ids = [rng.randrange(1, VOCAB[args.model]) for _ in range(size - args.max_tokens)]
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": args.max_tokens, "temperature": 0,
                                "ignore_eos": True}}
    answer = fleet.client.call([{"method": "POST", "url": f"{url}/generate", "json": body,
                                 "timeout": 1800}])[0]
    if answer["status"] != 200 or answer.get("first") is None:
        raise RuntimeError(f"{url}: {answer['status']} {answer['body'][:500]}\n{fleet.tails()}")
    return float(answer["first"])


def measure(fleet: NsFleet, urls: dict[str, str], args: argparse.Namespace
            ) -> dict[str, Any]:
    hosts = fleet.hosts
    links = [str(x) for x in args.links]
    raw: dict[str, float] = {}
    for link in links:
        hosts.shape(_link_bps(link))
        nbytes = args.raw_mib << 20
        hosts.raw_socket_seconds(nbytes)  # unmeasured: the first connection warms both ends
        secs = statistics.median(hosts.raw_socket_seconds(nbytes) for _ in range(3))
        raw[link] = nbytes / secs
        print(f"raw TCP stream A -> B, {args.raw_mib} MiB, link {link}: "
              f"{raw[link] * 8 / 1e9:.2f} Gbit/s ({raw[link] / 1e9:.3f} GB/s)  "
              f"[load {loadavg()}]", flush=True)
    samples: dict[tuple[int, str], list[dict[str, float]]] = {}
    seed = 1
    for size in args.sizes:
        hosts.shape(None)
        # Unmeasured: each target's first request of this size compiles its shapes.
        proxies = [f"proxy{i}" for i in range(len(args.stream_tokens))]
        for target in (COLOC, *proxies):
            _ttft(fleet, urls[target], args, size, seed := seed + 1)
        runs = [(COLOC, -1)] + [(link, i) for link in links for i in range(len(proxies))]
        for rep in range(args.repeats):
            order = runs[rep % len(runs):] + runs[: rep % len(runs)]
            for link, i in order:
                hosts.shape(None if link == COLOC else _link_bps(link))
                before = fleet.client.metric_sums(urls["d"], D_SUMS)
                ttft = _ttft(fleet, urls[COLOC if link == COLOC else proxies[i]], args, size,
                             seed := seed + 1)
                after = fleet.client.metric_sums(urls["d"], D_SUMS)
                row = {"ttft": ttft, **{k: after[k] - before[k] for k in D_SUMS}}
                key = link if link == COLOC else _key(link, args.stream_tokens[i])
                samples.setdefault((size, key), []).append(row)
                print(f"  size {size} rep {rep} {key:>18}: TTFT {ttft * 1e3:8.1f} ms"
                      + (f", {row['pulls']:.0f} pulls {row['pull_s'] * 1e3:.1f} ms of "
                         f"{row['bytes'] / 1e6:.1f} MB, tail {row['tail_s'] * 1e3:.1f} ms"
                         if link != COLOC else "") + f"  [load {loadavg()}]", flush=True)
        # Each size's rows as soon as they are whole: a later size that fails keeps them.
        print(render(summarise({"raw": raw, "samples": samples}, args, [size])), flush=True)
    hosts.shape(None)
    return {"raw": raw, "samples": samples}


def _key(link: str, stream: int) -> str:
    return f"{link} stream {stream}" if stream else link


def summarise(measured: dict[str, Any], args: argparse.Namespace, sizes: list[int]
              ) -> list[dict[str, Any]]:
    raw, samples = measured["raw"], measured["samples"]
    rows = []
    streams = getattr(args, "stream_tokens", [0])
    for size in sizes:
        coloc = [s["ttft"] for s in samples[(size, COLOC)]]
        for link, stream in ((str(x), st) for x in args.links for st in streams):
            runs = samples[(size, _key(link, stream))]
            pd = [s["ttft"] for s in runs]
            kv_bytes = statistics.median(s["bytes"] for s in runs)
            bps = _link_bps(link) or raw[link] * 8  # unshaped: the veth's own measured rate
            transfer = kv_bytes * 8 / bps
            diff = statistics.median(pd) - statistics.median(coloc)
            hidden = 1 - diff / transfer
            # A sum over the request's pulls (its parts, then READY's): their mean rate.
            pull_gbps = statistics.median(s["pull_gbps"] / max(s["pulls"], 1) for s in runs)
            pull_s = statistics.median(s["pull_s"] for s in runs)
            tail = [s.get("tail_s", float("nan")) for s in runs]
            rows.append({
                "model": args.model, "size": size, "link": link, "stream": stream,
                "pulls": statistics.median(s["pulls"] for s in runs),
                # D's own clock: READY received -> the room in the decode batch, i.e. what of
                # the transfer P's prefill did not hide; against the link's transfer time.
                "tail_s_p50": statistics.median(tail),
                "hidden_by_tail": min(1.0, max(0.0, 1 - statistics.median(tail) / transfer)),
                "ttft_pd_p50": statistics.median(pd), "ttft_pd_p99": _quantile(pd, 0.99),
                "ttft_coloc_p50": statistics.median(coloc),
                "ttft_coloc_p99": _quantile(coloc, 0.99),
                "diff_p50": diff, "kv_bytes": kv_bytes, "transfer_s": transfer,
                # Run-to-run spread of the TTFTs: a difference inside it says nothing.
                "ttft_spread": max(_spread(pd), _spread(coloc)),
                "hidden_raw": hidden, "hidden": min(1.0, max(0.0, hidden)),
                # The same fraction from D's own clock: with streaming off the pull starts
                # at READY, after P's whole prefill, so all of it is on the TTFT path and the
                # part hidden is what the link's transfer time exceeds the pull by (none).
                "hidden_by_pull": min(1.0, max(0.0, 1 - pull_s / transfer)),
                "pull_s_p50": pull_s,
                "scatter_s_p50": statistics.median(s["scatter_s"] for s in runs),
                "pull_gbps": pull_gbps, "raw_gbps": raw[link] / 1e9,
                "pull_over_raw": pull_gbps / (raw[link] / 1e9),
                "repeats": len(runs),
            })
    return rows


def _reread(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``--json`` file, summarised again from its samples (by today's code)."""
    saved = json.loads(path.read_text())
    args = argparse.Namespace(**saved["args"])
    samples: dict[tuple[int, str], list[dict[str, float]]] = {}
    for x in saved["samples"]:
        samples.setdefault((x.pop("size"), x.pop("link")), []).append(x)
    return summarise({"raw": saved["raw_Bps"], "samples": samples}, args, args.sizes)


def render(rows: list[dict[str, Any]]) -> str:
    head = ("| model | context | link | streamed in parts of | pulls | KV MB "
            "| transfer at link rate ms | TTFT PD p50 / p99 ms "
            "| TTFT colocated p50 / p99 ms | PD - colocated p50 ms | hidden (TTFT) "
            "| D's tail ms p50 | hidden (D's tail) | pull ms p50 "
            "| pull GB/s | raw socket GB/s | pull / raw |")
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
                   "---:|---:|"]
    for r in rows:
        link = r["link"] if r["link"] == UNSHAPED else f"{r['link']} Gbit/s"
        hidden = f"{r['hidden'] * 100:.0f} %"
        if r["repeats"] < 2:
            hidden = "undetermined (one sample)"
        elif r["ttft_spread"] > r["transfer_s"]:
            hidden = (f"undetermined (TTFT spread {r['ttft_spread'] * 1e3:.0f} ms > the "
                      f"transfer)")
        elif r["hidden"] != r["hidden_raw"]:
            hidden += f" ({r['hidden_raw'] * 100:+.0f} % unclipped)"
        lines.append(
            f"| {r['model']} | {r['size']} | {link} "
            f"| {str(r.get('stream', 0)) + ' tokens' if r.get('stream') else 'off'} "
            f"| {r.get('pulls', 1):.0f} | {r['kv_bytes'] / 1e6:.1f} "
            f"| {r['transfer_s'] * 1e3:.0f} | {r['ttft_pd_p50'] * 1e3:.0f} / "
            f"{r['ttft_pd_p99'] * 1e3:.0f} | {r['ttft_coloc_p50'] * 1e3:.0f} / "
            f"{r['ttft_coloc_p99'] * 1e3:.0f} | {r['diff_p50'] * 1e3:+.0f} | {hidden} "
            f"| {r.get('tail_s_p50', float('nan')) * 1e3:.0f} "
            f"| {r.get('hidden_by_tail', float('nan')) * 100:.0f} % "
            f"| {r['pull_s_p50'] * 1e3:.0f} | {r['pull_gbps']:.3f} | {r['raw_gbps']:.3f} "
            f"| {r['pull_over_raw']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(VOCAB), default="smollm2")
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 2048],
                    help="contexts in tokens: prompt + --max-tokens")
    ap.add_argument("--links", nargs="+", default=[UNSHAPED, "10", "1"],
                    help=f"link rates in Gbit/s, or {UNSHAPED!r}")
    ap.add_argument("--repeats", type=int, default=3, help="measured requests per size and link")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=1024, help="--max-batched-tokens")
    ap.add_argument("--stream-tokens", type=int, nargs="+", default=[0, 256],
                    help="P's --disaggregation-stream-tokens: one P (and proxy) per value, "
                         "measured side by side (0: the whole KV after the prefill)")
    ap.add_argument("--raw-mib", type=int, default=64, help="bytes of the raw-socket stream")
    ap.add_argument("--json", type=Path, help="also write the rows and every sample here")
    ap.add_argument("--render", type=Path, metavar="JSON",
                    help="print the table of an earlier run's --json file and exit")
    args = ap.parse_args()
    if args.render is not None:
        print(render(_reread(args.render)))
        return 0
    why = namespaces_unavailable()
    if why is not None:
        raise SystemExit(f"needs network namespaces: {why}")
    print(f"start {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load {loadavg()}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        fleet = NsFleet(Path(tmp))
        try:
            netem = fleet.hosts.netem_missing()
            print(f"added latency: {netem or 'netem available (not used)'}", flush=True)
            try:
                fleet.hosts.shape(1e9)
            except ShapingUnavailable as exc:
                raise SystemExit(f"cannot shape the link: {exc}") from exc
            urls = _start(fleet, args)
            measured = measure(fleet, urls, args)
        finally:
            fleet.close()
    rows = summarise(measured, args, args.sizes)
    print(f"\nend {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {loadavg()}\n")
    print(render(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "netem": netem, "raw_Bps": measured["raw"], "rows": rows,
            "samples": [{"size": s, "link": ln, **x}
                        for (s, ln), xs in measured["samples"].items() for x in xs],
        }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
