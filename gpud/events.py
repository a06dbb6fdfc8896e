"""The watch stream: every change gpud sees, numbered, kept for a while, pushed to subscribers.

A subscriber that reconnects passes the last sequence number it saw and gets what it missed,
so a device plugin needs no polling and loses nothing across a reconnect (within the backlog).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from gpud.api.views import encode

EVENT_TYPES = ("health", "mig", "mps", "sharing", "inventory")
BACKLOG = 10_000


class Subscription:
    """One watcher's queue. A watcher too slow to keep up is cut off rather than let it grow."""

    def __init__(self, limit: int):
        # Room for the limit plus one end marker: None (overflow) or b"" (gpud stopping).
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=limit + 1)
        self.limit = limit

    def offer(self, line: bytes) -> bool:
        if self.queue.qsize() >= self.limit:
            self.queue.put_nowait(None)  # the one spare slot: wakes the reader to end the stream
            return False
        self.queue.put_nowait(line)
        return True


class EventBus:
    def __init__(self, backlog: int = BACKLOG):
        self._events: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=backlog)
        self._subscribers: set[Subscription] = set()
        self.sequence = 0

    def publish(self, kind: str, data: dict[str, Any]) -> int:
        """Numbers the event, keeps it, and hands it to every subscriber. Returns its sequence number."""
        self.sequence += 1
        line = encode({"seq": self.sequence, "type": kind, "time": time.time(), "data": data}) + b"\n"
        self._events.append((self.sequence, line))
        for subscription in list(self._subscribers):
            if not subscription.offer(line):
                self._subscribers.discard(subscription)
        return self.sequence

    def backlog_after(self, since: int) -> tuple[list[bytes], bool]:
        """Lines after sequence `since`, and whether some of those were already dropped from the backlog."""
        oldest = self._events[0][0] if self._events else self.sequence + 1
        return [line for seq, line in self._events if seq > since], since + 1 < oldest

    def subscribe(self, limit: int = 10_000) -> Subscription:
        subscription = Subscription(limit)
        self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

    def close(self) -> None:
        """Ends every stream (gpud is stopping): watchers reconnect with ?since= to the next gpud."""
        for subscription in self._subscribers:
            subscription.queue.put_nowait(b"")
        self._subscribers.clear()
