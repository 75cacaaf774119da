"""A prefix cache of KV pages: a token-id tree over whole pages (RFC-2 stage D2).

Each node below the root is one full page of a sequence's KV, keyed by that page's token ids;
the path from the root spells the tokens before it, so a node's page holds the KV of exactly
that prefix. A finished request's whole pages go in (``insert``); a new request takes the pages
of the longest prefix of its prompt found there (``match``) and prefills only the rest.

Pages are counted per holder (``PageAllocator.share``): the tree holds one share of every page it
caches, and every request that matched a page holds another. A page leaves the tree only when the
tree is its last holder (``evict``, least recently used leaves first, when a request needs pages
and none are free), so a page a live request references is never evicted, freed or handed out.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence

import attrs

from pd_fsm.jax_engine.kv.pool import PageAllocator


@attrs.define(eq=False)
class _Node:
    key: tuple[int, ...]  # the page's token ids
    page: int
    parent: _Node | None
    last_used: int = 0
    children: dict[tuple[int, ...], _Node] = attrs.field(factory=dict)


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self._root = _Node((), 0, None)
        self._clock = itertools.count(1)
        self.pages = 0  # pages the tree caches
        self.hits = 0  # pages handed out by match
        self.evicted = 0

    def _keys(self, tokens: Sequence[int]) -> Iterator[tuple[int, ...]]:
        ps = self.page_size
        for i in range(len(tokens) // ps):
            yield tuple(tokens[i * ps : (i + 1) * ps])

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The pages of the longest cached prefix of ``tokens`` in whole pages, each now also
        held by the caller (who gives them up with ``PageAllocator.free``)."""
        node, pages = self._root, []
        now = next(self._clock)
        for key in self._keys(tokens):
            child = node.children.get(key)
            if child is None:
                break
            child.last_used = now
            pages.append(child.page)
            node = child
        if pages:
            self.allocator.share(pages, 1)
            self.hits += len(pages)
        return pages

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Cache the whole pages of a sequence whose KV for ``tokens`` is in ``pages`` (its
        page list, in order); the tree takes a share of each page it did not hold yet (a
        prefix it has already keeps its own pages). Returns the pages added."""
        node, added = self._root, 0
        now = next(self._clock)
        for i, key in enumerate(self._keys(tokens)):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, pages[i], node)
                self.allocator.share([pages[i]], 1)
                self.pages += 1
                added += 1
            child.last_used = now
            node = child
        return added

    def evict(self, wanted: int) -> int:
        """Free up to ``wanted`` pages that only the tree holds, least recently used leaves
        first (a leaf's parent becomes a candidate once its children are gone)."""
        heap = [(leaf.last_used, id(leaf), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < wanted:
            _, _, leaf = heapq.heappop(heap)
            if self.allocator.holders(leaf.page) != 1:
                continue  # a live request holds it: never evicted
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key]
            self.allocator.free([leaf.page])
            self.pages -= 1
            self.evicted += 1
            freed += 1
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def evictable(self) -> int:
        """Pages only the tree holds: what ``evict`` could free now. (A request holds every
        page of the prefix it matched, so below a page only the tree holds, no page is held
        by anyone else: leaf-first eviction reaches all of them.)"""
        return sum(1 for node in self._nodes() if self.allocator.holders(node.page) == 1)

    def _nodes(self) -> Iterator[_Node]:
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _leaves(self) -> Iterator[_Node]:
        return (node for node in self._nodes() if not node.children)
