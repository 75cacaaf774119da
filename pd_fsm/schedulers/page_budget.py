"""The KV pool's pages as a scheduler spends them: the allocator, the prefix cache, and the page
arithmetic of a request ("plan apart from run").

A scheduler decides which requests run; this decides whether their pages exist. Pages are
reserved for ``prompt + max_new_tokens`` tokens (and each fork's own, with sampling n > 1) when a
request is admitted, so a running request never needs pages mid-decode, and they go back exactly
once, into the prefix cache when there is one. It knows nothing of queues, forwards or outputs:
the scheduler asks it (``reserve``, ``release``) and it answers with data.

One thread uses it: the scheduler's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

from pd_fsm.jax_engine.kv.pool import KVPoolConfig, PageAllocator
from pd_fsm.schedulers.radix_cache import RadixCache
from pd_fsm.schedulers.request import Req


def _forks_here(req: Req) -> bool:
    return True


@attrs.frozen
class ForkPages:
    """How ``PageBudget.fork`` split a prefilled request's pages among its n sequences."""

    copied: int  # index (in every sequence's pages) of the page each fork copies: the prompt's last
    forks: tuple[list[int], ...]  # sequences 1..n-1: each one's pages


class PageBudget:
    """The allocator, the radix cache and what a request's pages come to.

    ``forks_here(req)``: whether this worker runs ``req``'s n sequences itself, and so reserves
    pages for its forks (a prefill worker hands a room's sequences to D, which forks them there)."""

    def __init__(
        self,
        pool_config: KVPoolConfig,
        num_pages: int,
        context_length: int,
        *,
        radix_cache: bool,
        forks_here: Callable[[Req], bool] = _forks_here,
    ) -> None:
        self.pool_config = pool_config
        self.page_size = pool_config.page_size
        self.context_length = context_length
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(self.allocator, self.page_size) if radix_cache else None
        self.cache_hit_tokens = 0  # counted once per request that got its pages
        self.forks_here = forks_here

    # ----------------------------------------------------------------- what a request needs

    def pages_needed(self, req: Req) -> int:
        """The sequence's pages, and with sampling n > 1 each fork's own (reserved with the
        request, so a fork never waits for pages; ``fork`` hands them out)."""
        return self.sequence_pages(req) + (req.sampling.n - 1) * self.fork_pages(req)

    def sequence_pages(self, req: Req) -> int:
        tokens = min(len(req.input_ids) + req.sampling.max_new_tokens, self.context_length)
        return self.pool_config.pages_for(tokens)

    def fork_pages(self, req: Req) -> int:
        """A fork's own pages: from the page holding the prompt's last token (the fork rewrites
        that position) to the end of its sequence; those before it are shared."""
        if not self.forks_here(req):
            return 0
        return self.sequence_pages(req) - (len(req.input_ids) - 1) // self.page_size

    def check_fits(self, req: Req) -> None:
        """Raise ``ValueError`` for a request the whole pool could never hold."""
        if self.pages_needed(req) > self.allocator.total:
            raise ValueError(
                f"request needs {self.pages_needed(req)} pages, the pool has "
                f"{self.allocator.total}"
            )

    # ----------------------------------------------------------------- reserve and release

    def reserve(self, req: Req) -> bool:
        """The request's pages: with the prefix cache, those of its prompt's longest cached
        prefix (shared; at least its last token is left to prefill, for its logits) and new
        ones for the rest, evicting cached pages nobody uses when too few are free. False (and
        nothing held) when they are not there yet.

        PD rooms too. P prefills only the uncached suffix and gathers the
        whole prompt's pages; D's cached pages are the room's, pinned by it, and P sends only
        the rest. Shared pages are counted per holder, so a room's DONE, abort or lease expiry
        gives up its share only, and P's registration holds a gathered copy that no eviction
        can touch."""
        if req.pages is not None:
            return True
        cached: list[int] = []
        if self.cache is not None:
            # Prompt log-probs from position p need the logits of p - 1: computed, not cached.
            limit = len(req.input_ids) - 1
            if req.logprobs.prompt:
                limit = min(limit, max(req.logprobs.prompt_from - 1, 0))
            cached = self.cache.match(req.input_ids[:limit])
        wanted = self.pages_needed(req) - len(cached)
        pages = self.allocator.allocate(wanted)
        if pages is None and self.cache is not None:
            self.cache.evict(wanted - self.allocator.num_free)
            pages = self.allocator.allocate(wanted)
        if pages is None:
            if cached:
                self.allocator.free(cached)  # our shares back: the pages stay in the cache
            return False
        req.pages = cached + pages
        req.prefilled = req.cached_tokens = len(cached) * self.page_size
        self.cache_hit_tokens += req.cached_tokens
        return True

    def release(self, req: Req) -> None:
        """Give back ``req``'s pages (their KV to the prefix cache first); a second call is a
        no-op: ``req.pages`` is cleared before anything else, so pages go back exactly once."""
        pages, req.pages = req.pages, None
        if pages and self.cache is not None:
            self.cache.insert(self.tokens_with_kv(req), pages)
        if pages:
            self.allocator.free(pages)

    def free(self, pages: Iterable[int]) -> None:
        """Give back pages no request holds any more (a PD room's, held past its request)."""
        self.allocator.free(pages)

    def cache_prompt(self, req: Req) -> None:
        """Offer ``req``'s prompt pages to the prefix cache now, while the request still holds
        them (P, once a room's leg is answered: the rooms after it share them)."""
        if self.cache is not None:
            assert req.pages is not None
            self.cache.insert(req.input_ids, req.pages)

    @staticmethod
    def tokens_with_kv(req: Req) -> list[int]:
        """The tokens whose KV is in the request's pages: the prompt as far as it was
        prefilled, then every output token but the last (fed by a step that never ran)."""
        if req.prefilled < len(req.input_ids):
            return req.input_ids[: req.prefilled]
        return req.input_ids + req.output_ids[:-1]

    # ----------------------------------------------------------------- sampling n > 1

    def fork(self, req: Req) -> ForkPages:
        """Split the pages reserved with ``req`` (just prefilled, n > 1) among its sequences:
        ``req`` keeps its own; each fork shares the prompt's pages before the one holding its
        last token and gets its own from there on (the first of which the caller fills with a
        copy of ``req``'s: copy-on-write)."""
        n = req.sampling.n
        assert req.pages is not None
        own = self.sequence_pages(req)
        cut = (len(req.input_ids) - 1) // self.page_size  # the prompt's last page
        shared, reserve = req.pages[:cut], req.pages[own:]
        req.pages = req.pages[:own]
        each = own - cut
        self.allocator.share(shared, n - 1)
        return ForkPages(cut, tuple(shared + reserve[(i - 1) * each : i * each]
                                    for i in range(1, n)))

    # ----------------------------------------------------------------- gauges

    @property
    def cached_pages(self) -> int:
        """Pages held by the prefix cache alone: freed when pages are wanted."""
        return 0 if self.cache is None else self.cache.evictable()

    @property
    def evicted_pages(self) -> int:
        return 0 if self.cache is None else self.cache.evicted
