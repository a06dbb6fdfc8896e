"""The watch stream: every change gpud sees, numbered, kept for a while, pushed to subscribers.

A subscriber that reconnects passes the last sequence number it saw and gets what it missed,
so a device plugin needs no polling and loses nothing across a reconnect (within the backlog).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, NamedTuple

from gpud.encoding import encode

EVENT_TYPES = ("health", "mig", "mps", "sharing", "inventory")
BACKLOG = 10_000
# The end markers a subscription's queue can hold after its events.
OVERFLOW = "overflow"  # the watcher fell too far behind
CLOSED = "closed"  # gpud is stopping


class Event(NamedTuple):
    """One published event: its number and type, to filter by without decoding, and its encoded line."""

    seq: int
    type: str
    line: bytes


class Subscription:
    """One watcher's queue. A watcher too slow to keep up is cut off rather than let it grow."""

    def __init__(self, limit: int):
        # Room for the limit plus one end marker (OVERFLOW or CLOSED).
        self.queue: asyncio.Queue[Event | str] = asyncio.Queue(maxsize=limit + 1)
        self.limit = limit

    def offer(self, event: Event) -> bool:
        if self.queue.qsize() >= self.limit:
            self.queue.put_nowait(OVERFLOW)  # the one spare slot: wakes the reader to end the stream
            return False
        self.queue.put_nowait(event)
        return True


class EventBus:
    def __init__(self, backlog: int = BACKLOG):
        self._events: collections.deque[Event] = collections.deque(maxlen=backlog)
        self._subscribers: set[Subscription] = set()
        self.sequence = 0

    def publish(self, kind: str, data: dict[str, Any]) -> int:
        """Numbers the event, keeps it, and hands it to every subscriber. Returns its sequence number."""
        self.sequence += 1
        line = encode({"seq": self.sequence, "type": kind, "time": time.time(), "data": data}) + b"\n"
        event = Event(self.sequence, kind, line)
        self._events.append(event)
        for subscription in list(self._subscribers):
            if not subscription.offer(event):
                self._subscribers.discard(subscription)
        return self.sequence

    def backlog_after(self, since: int) -> tuple[list[Event], bool]:
        """Events after sequence `since`, and whether some of those were already dropped from the backlog."""
        oldest = self._events[0].seq if self._events else self.sequence + 1
        return [event for event in self._events if event.seq > since], since + 1 < oldest

    def subscribe(self, limit: int = 10_000) -> Subscription:
        subscription = Subscription(limit)
        self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

    def close(self) -> None:
        """Ends every stream (gpud is stopping): watchers reconnect with ?since= to the next gpud."""
        for subscription in self._subscribers:
            subscription.queue.put_nowait(CLOSED)
        self._subscribers.clear()
