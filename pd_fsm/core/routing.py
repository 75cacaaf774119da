"""Where the proxy sends a room: which P, which D, and whether D prefills it alone.

Pure: the router hands in the workers, the prompt, its own count of live rooms per worker and the
loads last polled from the workers' ``/get_load``; a :class:`Route` comes out with the reason of
each choice, and every reason is counted in :attr:`RoutePlanner.decisions` (the proxy's metrics).

Policies, per leg (``--prefill-policy`` / ``--decode-policy``):

* ``round_robin`` — the next worker in turn.
* ``power_of_two`` — two workers drawn at random, the less loaded one (Mitzenmacher); a worker's
  load is the larger of the rooms this router has live on it and its last polled ``num_reqs``
  (the polled figure sees other routers' traffic, the live count what the poll has not yet).
* ``cache_aware`` — sglang-router's policy over an approximate index of the prompts routed to each
  worker: when the loads are out of balance (spread above ``balance_abs`` *and* the largest above
  ``balance_rel`` times the smallest) the least loaded worker; otherwise the worker whose index
  holds the longest prefix of the prompt if that covers ``cache_threshold`` of it, else the worker
  whose index is smallest (the most room to cache something new).

The index is a chain of hashed blocks of ``BLOCK_CHARS`` characters per worker: a block's digest
covers its text and every block before it, so the digests a worker holds form a radix tree of
whole blocks, and the length of a matched prefix is the count of leading digests it holds. Each
worker keeps at most ``index_blocks`` digests, least recently routed first out (a chain is
touched deepest block first, so a prefix outlives its continuations). It is approximate: it
records what was routed, not what the worker still caches.

Colocated workers (role ``null``): a worker that serves whole requests is a pool of
its own. A room goes to the colocated worker with the fewest requests (the same load as above),
ties taken in turn, when that is fewer than the D the decode policy chose has (a PD room holds
its D for its whole answer, as a colocated one holds its worker; P's part is short), or when the
prompt has no P or no D to go to. Colocated workers keep no prefix index.

Conditional disaggregation: D prefills a room alone (no P leg, no transfer) when the prompt's
uncached part is at most ``local_prefill_tokens`` — uncached on the chosen D by its index when
the decode policy is ``cache_aware``, else the whole prompt — or when every P's load is at least
``local_prefill_queue``, or (Dynamo's cached-to-raw threshold) when the chosen D's index holds
at least ``local_prefill_cached_ratio`` of the prompt, so what is left to compute is small next
to what would move. Each is off at 0. With ``local_prefill_without_prefill`` D also prefills
alone while no P is listed at all (the planner's colocated worker draining to become P again
beside a standby D, where every request would otherwise be answered 503). The decode-busy
guard: no local prefill at all while the chosen D has ``local_prefill_decode_guard`` or more
requests (D's own decode batch would wait behind the prefill); off at 0.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence

import attrs

POLICIES = ("round_robin", "cache_aware", "power_of_two")
_GE0_INT = attrs.validators.ge(0)
_GE0 = attrs.validators.ge(0.0)
BLOCK_CHARS = 64  # ~16 tokens of English text: one KV page at the default page size


def _policy(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in POLICIES:
        raise ValueError(f"{attribute.name} must be one of {', '.join(POLICIES)}, got {value!r}")


@attrs.frozen
class RoutingConfig:
    prefill_policy: str = attrs.field(default="round_robin", validator=_policy)
    decode_policy: str = attrs.field(default="round_robin", validator=_policy)
    # cache_aware: sglang-router's defaults (cache_threshold 0.5, balance 32 / 1.5).
    cache_threshold: float = attrs.field(default=0.5, validator=_GE0)
    balance_abs: int = attrs.field(default=32, validator=_GE0_INT)
    balance_rel: float = attrs.field(default=1.5, validator=_GE0)
    index_blocks: int = attrs.field(default=1 << 16, validator=_GE0_INT)  # per worker
    local_prefill_tokens: int = attrs.field(default=0, validator=_GE0_INT)
    local_prefill_queue: int = attrs.field(default=0, validator=_GE0_INT)
    local_prefill_cached_ratio: float = attrs.field(default=0.0, validator=[
        _GE0, attrs.validators.le(1.0)])
    local_prefill_decode_guard: int = attrs.field(default=0, validator=_GE0_INT)
    # No P routable (every P draining for a role switch, say, or gone) and no colocated
    # worker: D prefills alone instead of the room's 503 (the decode-busy guard aside: the
    # other answer is a refusal). Off by default; ``pd-fsm cluster --planner`` turns it on.
    local_prefill_without_prefill: bool = False
    # Load shedding: when every routable worker of a role has at least this many
    # requests (the proxy's own live rooms, or its last polled /get_load if higher), a new
    # request is answered 429 with Retry-After at once instead of queueing; 0: never.
    max_queue: int = attrs.field(default=0, validator=_GE0_INT)


@attrs.frozen(slots=True)
class Prompt:
    """What the router knows of a request's prompt: its text (or token ids written out) for the
    index, and its length in tokens (exact for token ids, estimated by the adapter for text)."""

    text: str = ""
    tokens: int = 0


@attrs.frozen(slots=True)
class Attempts:
    """What a request's earlier rooms used up, handed back to the router with its next room (a
    retry or a migration): the router keeps nothing of a request between its rooms, so nothing
    of it can leak when a client leaves during a backoff."""

    retries: int = 0
    migrations: int = 0
    handoffs: int = 0  # streams a draining D handed off (they use up no migration)
    avoid: tuple[str, ...] = ()  # workers that failed it: routed around while others are up
    deadline: float | None = None  # a retried room keeps its request's first deadline
    # The D whose drain handed the stream off last: its hand-off room's leg never goes there
    # (a draining D takes no new leg).
    handed_off_by: str = ""


@attrs.frozen(slots=True)
class Route:
    prefill: str | None  # None: D (or a colocated worker) prefills the room alone
    decode: str  # the worker whose answer the client gets
    prefill_reason: str  # e.g. "cache_hit"; for a local room why D prefills alone
    decode_reason: str
    # The role the answering worker is addressed as (its leg's X-PD-Role): "decode", or "null"
    # for a colocated worker serving the whole request.
    role: str = "decode"


def block_chain(text: str) -> list[bytes]:
    """The digests of ``text``'s whole blocks, each covering every block before it."""
    chain: list[bytes] = []
    digest = b""
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        block = text[start : start + BLOCK_CHARS].encode("utf-8", "surrogatepass")
        digest = hashlib.blake2b(digest + block, digest_size=8).digest()
        chain.append(digest)
    return chain


class PrefixIndex:
    """Per worker, the block digests of the prompts routed to it, least recently routed first."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def matched(self, worker: str, chain: Sequence[bytes]) -> int:
        """How many leading blocks of ``chain`` the worker's index holds."""
        held = self._blocks.get(worker)
        if held is None:
            return 0
        n = 0
        for digest in chain:
            if digest not in held:
                break
            n += 1
        return n

    def size(self, worker: str) -> int:
        return len(self._blocks.get(worker, ()))

    def insert(self, worker: str, chain: Sequence[bytes]) -> None:
        held = self._blocks.setdefault(worker, OrderedDict())
        for digest in reversed(chain):  # the deepest first: the prefix ends the most recent
            held[digest] = None
            held.move_to_end(digest)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def keep(self, workers: Sequence[str]) -> None:
        """Forget the workers no longer routed to."""
        for worker in set(self._blocks) - set(workers):
            del self._blocks[worker]


class RoutePlanner:
    def __init__(self, config: RoutingConfig, rng: random.Random) -> None:
        self.config = config
        self._rng = rng
        self._turn: Counter[str] = Counter()  # round_robin position per leg
        self._index = {leg: PrefixIndex(config.index_blocks) for leg in ("prefill", "decode")}
        self._polled: dict[str, int] = {}
        # "prefill:cache_hit" -> rooms; "local:short_prompt" for rooms D prefills alone.
        self.decisions: Counter[str] = Counter()

    @property
    def wants_loads(self) -> bool:
        """Whether the adapter should poll the workers' /get_load for this planner."""
        c = self.config
        return (c.local_prefill_queue > 0 or c.max_queue > 0 or c.local_prefill_decode_guard > 0
                or any(p != "round_robin" for p in (c.prefill_policy, c.decode_policy)))

    def set_loads(self, loads: Mapping[str, int]) -> None:
        """The workers' last polled loads (``num_reqs``); a worker not named keeps none."""
        self._polled = dict(loads)

    def keep(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self._index["prefill"].keep(prefill)
        self._index["decode"].keep(decode)

    def overloaded(self, prefill: Sequence[str], decode: Sequence[str],
                   live: Mapping[str, int], colocated: Sequence[str] = ()) -> str | None:
        """The role every one of whose workers is at ``max_queue`` (shed the request), if
        any. A colocated worker under the bound takes the request whatever P and D have
        (``plan`` sends it there: its load is below the chosen D's); with colocated workers
        only, "colocated" when every one is full."""
        bound = self.config.max_queue
        if not bound:
            return None
        if colocated:
            if any(self._load(w, live) < bound for w in colocated):
                return None
            if not (prefill and decode):
                return "colocated"
        for role, workers in (("decode", decode), ("prefill", prefill)):
            # A role with no worker listed is not full (a hand-off room lists no P).
            if workers and all(self._load(w, live) >= bound for w in workers):
                return role
        return None

    def plan(self, prefill: Sequence[str], decode: Sequence[str], prompt: Prompt,
             live: Mapping[str, int], colocated: Sequence[str] = ()) -> Route:
        """Choose D, then whether a colocated worker takes the room, then whether D prefills
        alone, then P. Both P and D lists are non-empty, or ``colocated`` is, or D's is with
        ``local_prefill_without_prefill``."""
        if colocated and not (prefill and decode):
            return self._colocated(colocated, live, "no_prefill" if not prefill else "no_decode")
        chain = block_chain(prompt.text) if self._indexed() else []
        d, d_reason, d_matched = self._choose("decode", decode, prompt, chain, live)
        if colocated and min(self._load(w, live) for w in colocated) < self._load(d, live):
            return self._colocated(colocated, live, "fewer_in_flight")
        if not prefill:  # only with local_prefill_without_prefill (the router's NoWorkers)
            self._record("decode", d, d_reason, chain)
            self.decisions["local:no_prefill"] += 1
            return Route(None, d, "no_prefill", d_reason)
        local = self._local_reason(prefill, d, prompt, d_matched, live)
        if local is not None:
            self._record("decode", d, d_reason, chain)
            self.decisions[f"local:{local}"] += 1
            return Route(None, d, local, d_reason)
        p, p_reason, _ = self._choose("prefill", prefill, prompt, chain, live)
        self._record("decode", d, d_reason, chain)
        self._record("prefill", p, p_reason, chain)
        return Route(p, d, p_reason, d_reason)

    # -- internals ----------------------------------------------------------------------------

    def _colocated(self, workers: Sequence[str], live: Mapping[str, int], reason: str) -> Route:
        """The least loaded colocated worker, ties taken in turn (idle workers share the
        rooms rather than the first one getting every one)."""
        start = self._turn["colocated"] % len(workers)
        turned = [*workers[start:], *workers[:start]]
        worker = min(turned, key=lambda w: self._load(w, live))
        self._turn["colocated"] = start + 1
        self.decisions[f"colocated:{reason}"] += 1
        return Route(None, worker, reason, "colocated", role="null")

    def _indexed(self) -> bool:
        return "cache_aware" in (self.config.prefill_policy, self.config.decode_policy)

    def _policy(self, leg: str) -> str:
        return self.config.prefill_policy if leg == "prefill" else self.config.decode_policy

    def _load(self, worker: str, live: Mapping[str, int]) -> int:
        return max(live.get(worker, 0), self._polled.get(worker, 0))

    def _record(self, leg: str, worker: str, reason: str, chain: Sequence[bytes]) -> None:
        self.decisions[f"{leg}:{reason}"] += 1
        if self._policy(leg) == "cache_aware":
            self._index[leg].insert(worker, chain)

    def _choose(self, leg: str, workers: Sequence[str], prompt: Prompt, chain: Sequence[bytes],
                live: Mapping[str, int]) -> tuple[str, str, int]:
        """The worker, the reason, and the prompt characters its index matched."""
        policy = self._policy(leg)
        if policy == "round_robin":
            turn = self._turn[leg] % len(workers)
            self._turn[leg] = turn + 1
            return workers[turn], "round_robin", 0
        loads = {w: self._load(w, live) for w in workers}
        if policy == "power_of_two":
            if len(workers) == 1:
                return workers[0], "power_of_two", 0
            a, b = self._rng.sample(list(workers), 2)
            return (b if loads[b] < loads[a] else a), "power_of_two", 0
        c = self.config
        low, high = min(loads.values()), max(loads.values())
        if high - low > c.balance_abs and high > c.balance_rel * low:
            return min(workers, key=loads.__getitem__), "load_balance", 0
        index = self._index[leg]
        matched = {w: index.matched(w, chain) for w in workers}
        best = max(workers, key=lambda w: (matched[w], -loads[w]))
        chars = matched[best] * BLOCK_CHARS
        if prompt.text and chars >= c.cache_threshold * len(prompt.text):
            return best, "cache_hit", chars
        fresh = min(workers, key=lambda w: (index.size(w), loads[w]))
        return fresh, "cache_miss", matched[fresh] * BLOCK_CHARS

    def _local_reason(self, prefill: Sequence[str], d: str, prompt: Prompt, d_matched: int,
                      live: Mapping[str, int]) -> str | None:
        c = self.config
        if c.local_prefill_decode_guard and self._load(d, live) >= c.local_prefill_decode_guard:
            if self._local_reason_unguarded(prefill, prompt, d_matched, live) is not None:
                self.decisions["local_refused:decode_busy"] += 1
            return None
        return self._local_reason_unguarded(prefill, prompt, d_matched, live)

    def _local_reason_unguarded(self, prefill: Sequence[str], prompt: Prompt, d_matched: int,
                                live: Mapping[str, int]) -> str | None:
        c = self.config
        share = 1.0 - min(d_matched / len(prompt.text), 1.0) if prompt.text else 1.0
        # prompt.tokens 0: the adapter could not tell.
        if c.local_prefill_tokens and prompt.tokens > 0 and (
                prompt.tokens * share <= c.local_prefill_tokens):
            return "short_prompt"
        if c.local_prefill_cached_ratio and prompt.text and (
                1.0 - share >= c.local_prefill_cached_ratio):
            return "cached_on_decode"
        if c.local_prefill_queue and all(
            self._load(p, live) >= c.local_prefill_queue for p in prefill
        ):
            return "prefill_busy"
        return None
