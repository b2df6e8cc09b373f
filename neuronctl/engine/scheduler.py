"""Which requests run this step, and in which KV-cache slot. No tensors, no threads, no HTTP.

Neuron's static cache has `batch_size` slots; a request holds one from its context encoding to
its last token. `schedule()` decides one engine step and returns it as a `SchedulerOutput`;
the engine applies that and reports back with `release()`. New policies (preemption, chunked
or batched prefill limits, speculation) change what `schedule()` returns, not the engine loop.
The engine calls these methods with its lock held.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from neuronctl.engine.errors import QueueFullError
from neuronctl.engine.request import Request


@dataclass(frozen=True)
class SchedulerOutput:
    """One engine step: what to context-encode, what to decode, what was dropped."""

    prefill: list[Request] = field(default_factory=list)  # newly given a slot: encode the prompt
    decode: list[Request] = field(default_factory=list)  # hold a slot already: one token each
    aborted: list[Request] = field(default_factory=list)  # cancelled; their slots are free

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.decode or self.aborted)


# One client (peer address) may hold at most this share of the waiting places: a client
# that fills the queue leaves the rest of it to everyone else.
CLIENT_QUEUE_SHARE = 0.5


class Scheduler:
    """Admits waiting requests fairly: a free slot goes to the waiting request whose client
    (`Request.client`, the peer's address) holds the fewest slots, then whose API request
    (`Request.group`) holds the fewest, earliest first among equals; one API request never
    takes the last free slot while it holds another. A request of many prompts therefore
    runs beside later requests instead of ahead of them (259 prompts in one request held a
    neighbour's 0.35 s answer back for 40 s when admission was FIFO), and so does a client
    of many requests: its hundredth waits behind another client's first."""

    def __init__(self, batch_size: int, max_queue: int | None = None) -> None:
        self.slots: list[Request | None] = [None] * batch_size
        self.waiting: deque[Request] = deque()
        self.max_queue = max_queue

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    def add(self, request: Request) -> None:
        # Waiting requests go to free slots first: only those beyond them are queued.
        free = sum(r is None for r in self.slots)
        if self.max_queue is not None and len(self.waiting) - free >= self.max_queue:
            raise QueueFullError(
                f"the request queue is full ({self.max_queue} waiting, "
                f"{len(self.slots)} slots busy)",
                "retry later, or start the server with a larger --max-queue",
            )
        self._check_share(request, free)
        self.waiting.append(request)

    def client_share(self) -> int | None:
        """How many waiting places one client may hold (None: no limit)."""
        if self.max_queue is None:
            return None
        return max(1, int(self.max_queue * CLIENT_QUEUE_SHARE))

    def _check_share(self, request: Request, free: int) -> None:
        share = self.client_share()
        if share is None or request.client is None:
            return
        held = sum(r.client == request.client for r in self.waiting)
        if held - free >= share:
            raise QueueFullError(
                f"this client has {held} requests waiting, its share of the "
                f"{self.max_queue}-place queue is {share}",
                "wait for your earlier requests to finish, then retry",
            )

    def schedule(self) -> SchedulerOutput:
        """Drop cancelled requests, decode every running one, admit waiting ones (fairly)."""
        aborted = self._take_cancelled()
        decode = self.running()
        return SchedulerOutput(prefill=self._admit(), decode=decode, aborted=aborted)

    def release(self, request: Request) -> None:
        if request.slot is not None and self.slots[request.slot] is request:
            self.slots[request.slot] = None

    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    def drain_all(self) -> list[Request]:
        """Remove every request, waiting or running (the engine stopped)."""
        gone = list(self.waiting) + self.running()
        self.waiting.clear()
        self.slots = [None] * len(self.slots)
        return gone

    def _admit(self) -> list[Request]:
        admitted = []
        for slot, occupant in enumerate(self.slots):
            if occupant is not None or not self.waiting:
                continue
            request = self._next_fair()
            if request is None:
                break
            self.waiting.remove(request)
            request.slot = slot
            self.slots[slot] = request
            admitted.append(request)
        return admitted

    def _next_fair(self) -> Request | None:
        """The earliest waiting request of the client that holds the fewest slots, and of
        its API requests the one that holds the fewest; None when only a request holding a
        slot waits and this is the last free one."""
        by_client: dict[str | None, int] = {}
        by_group: dict[int, int] = {}
        for r in self.running():
            by_client[r.client] = by_client.get(r.client, 0) + 1
            by_group[id(r.group)] = by_group.get(id(r.group), 0) + 1

        def held(request: Request) -> tuple[int, int]:
            # Requests of no known client (a library caller) compete as one client each.
            mine = by_client.get(request.client, 0) if request.client is not None else 0
            return mine, by_group.get(id(request.group), 0)

        best: Request | None = None
        for request in self.waiting:  # earliest first: only a strictly lower count wins
            if best is None or held(request) < held(best):
                best = request
        if best is None or best.group is None:
            return best
        free = sum(r is None for r in self.slots)
        if by_group.get(id(best.group), 0) and free == 1 and self.batch_size > 1:
            return None  # the last slot stays free for another request's arrival
        return best

    def _take_cancelled(self) -> list[Request]:
        gone = [r for r in self.waiting if r.cancelled]
        if gone:
            self.waiting = deque(r for r in self.waiting if not r.cancelled)
        for request in self.running():
            if request.cancelled:
                self.release(request)
                gone.append(request)
        return gone
