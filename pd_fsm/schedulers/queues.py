"""A scheduler's requests and the queues they move through, and the inbox other threads hand work
to: what the ``Scheduler`` decides over, kept apart from what it runs.

Life of a request: WAITING (``waiting``, FIFO) -> PREFILLING (``prefilling``: pages reserved, the
prompt going into the pool, possibly over several chunked steps) -> RUNNING (``running``) ->
FINISHED (in no queue). ``reqs`` holds every live request by rid (a request with sampling n > 1
is live until its last sequence finishes).

One thread uses it, the scheduler's; only ``put`` is safe from other threads (a deque's append
and popleft are atomic).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from pd_fsm.schedulers.page_budget import PageBudget
from pd_fsm.schedulers.request import Req, ReqState

# What other threads hand over: a request to add, or (rid, message) to abort.
InboxItem = Req | tuple[str, str]


class RequestQueues:
    def __init__(self) -> None:
        self.reqs: dict[str, Req] = {}  # every live (unfinished) request
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []
        self.running: list[Req] = []
        self._inbox: deque[InboxItem] = deque()

    # ----------------------------------------------------------------- the inbox

    def put(self, item: InboxItem) -> None:
        """Thread-safe: queue a request or an abort for the scheduler's next step."""
        self._inbox.append(item)

    def take_inbox(self) -> Iterator[InboxItem]:
        """What other threads handed over, in order (including what arrives meanwhile)."""
        while self._inbox:
            yield self._inbox.popleft()

    # ----------------------------------------------------------------- admission

    def admit(self, budget: PageBudget, max_running: int) -> list[Req]:
        """Move waiting requests to ``prefilling`` while fewer than ``max_running`` are admitted
        and their pages can be reserved; the ones moved, in order. Strict FIFO: a head request
        that does not fit yet blocks those behind it, so a large request is not starved by a
        stream of small ones."""
        admitted: list[Req] = []
        while self.waiting and self.admitted < max_running:
            req = self.waiting[0]
            if not budget.reserve(req):
                break
            self.waiting.popleft()
            req.state = ReqState.PREFILLING
            self.prefilling.append(req)
            admitted.append(req)
        return admitted

    def remove(self, req: Req) -> None:
        """Take ``req`` out of every queue it is in."""
        for queue in (self.prefilling, self.running):
            if req in queue:
                queue.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    @property
    def admitted(self) -> int:
        """Requests prefilling or running: each holds one of ``max_running``'s batch slots."""
        return len(self.prefilling) + len(self.running)

    @property
    def busy(self) -> bool:
        """Whether anything is queued: handed over, waiting, prefilling or running."""
        return bool(self._inbox or self.waiting or self.prefilling or self.running)
