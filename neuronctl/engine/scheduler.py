"""Which requests occupy which KV-cache slot. No tensors, no threads, no HTTP.

Neuron's static cache has `batch_size` slots; a request holds one from its context encoding to
its last token. Waiting requests enter freed slots first come, first served. The engine calls
these methods with its lock held.
"""

from __future__ import annotations

from collections import deque

from neuronctl.engine.errors import QueueFullError
from neuronctl.engine.request import Request


class Scheduler:
    def __init__(self, batch_size: int, max_queue: int | None = None) -> None:
        self.slots: list[Request | None] = [None] * batch_size
        self.waiting: deque[Request] = deque()
        self.max_queue = max_queue

    def add(self, request: Request) -> None:
        # Waiting requests go to free slots first: only those beyond them are queued.
        free = sum(r is None for r in self.slots)
        if self.max_queue is not None and len(self.waiting) - free >= self.max_queue:
            raise QueueFullError(
                f"the request queue is full ({self.max_queue} waiting, "
                f"{len(self.slots)} slots busy)",
                "retry later, or start the server with a larger --max-queue",
            )
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots; return them (they need a prefill)."""
        admitted = []
        for slot, occupant in enumerate(self.slots):
            if occupant is None and self.waiting:
                request = self.waiting.popleft()
                request.slot = slot
                self.slots[slot] = request
                admitted.append(request)
        return admitted

    def release(self, request: Request) -> None:
        if request.slot is not None and self.slots[request.slot] is request:
            self.slots[request.slot] = None

    def take_cancelled(self) -> list[Request]:
        """Remove cancelled requests, waiting or running, and return them."""
        gone = [r for r in self.waiting if r.cancelled]
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        for request in self.running():
            if request.cancelled:
                self.release(request)
                gone.append(request)
        return gone

    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)
