"""The watch stream: every change gpud sees, numbered, kept for a while, pushed to subscribers.

A subscriber that reconnects passes the last sequence number it saw and gets what it missed,
so a device plugin needs no polling and loses nothing across a reconnect (within the backlog).

The bus is also how gpud's components tell each other of a change (docs/architecture.md): whoever changes
something publishes an event of one of the EventTypes; a component that follows it in-process listens for that
type; a watcher over HTTP subscribes. No other callbacks between components.

Each gpud run is a new stream with its own identity, the epoch, on every line. Sequence numbers
also go on across restarts (blocks of them are reserved in the state directory), so a `since` from
an earlier run is told apart even from a client that does not pass the epoch back.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

from gpud.base.encoding import encode
from gpud.base.lifecycle import Component, Tasks
from gpud.base.logs import get_logger
from gpud.model.named import Named
from gpud.base.persist import CorruptFile, read_json, write_json_atomic

log = get_logger("events")



class EventType(Named):
    """What changed; the watch stream's `type` (its value)."""

    HEALTH = "health"
    MIG = "mig"
    MPS = "mps"
    SHARING = "sharing"
    INVENTORY = "inventory"
    KUBERNETES = "kubernetes"
    ALLOCATIONS = "allocations"
    CLAIMS = "claims"


EVENT_TYPES = tuple(kind.value for kind in EventType)
BACKLOG = 10_000
SEQUENCE_BLOCK = 10_000  # sequence numbers reserved in the state directory at a time
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


class EventBus(Component):
    name = "events"

    def __init__(self, backlog: int = BACKLOG, sequence_path: Path | None = None):
        self._events: collections.deque[Event] = collections.deque(maxlen=backlog)
        self._subscribers: set[Subscription] = set()
        self._listeners: dict[EventType, list[Callable[[dict[str, Any]], object]]] = {}
        self.epoch = secrets.token_hex(8)  # this run's stream
        self.corrupt_files: list[CorruptFile] = []
        self._sequence_path = sequence_path
        self.first = self.sequence = self._reserved = 0

    async def start(self, tasks: Tasks) -> None:
        """This run's numbers start above every earlier run's: the block reserved last is read back."""
        reserved, corrupt = read_json(self._sequence_path, _reserved_from) if self._sequence_path else (None, None)
        self.corrupt_files += [corrupt] if corrupt else []
        self.first = self.sequence = self._reserved = reserved or 0
        self._reserve()

    def problems(self) -> list[str]:
        return [file.message() for file in self.corrupt_files]

    def _reserve(self) -> None:
        """Reserves the next block of sequence numbers: the next run starts after it, crash or not."""
        if self._sequence_path is None:
            return
        try:
            write_json_atomic(self._sequence_path, {"reserved_up_to": self._reserved + SEQUENCE_BLOCK})
        except OSError as exc:
            log.error("event_sequence_not_saved", path=str(self._sequence_path), error=str(exc),
                      consequence="a watcher that does not pass ?epoch= may not notice the next restart")
            return
        self._reserved += SEQUENCE_BLOCK

    def listen(self, kind: EventType, listener: Callable[[dict[str, Any]], object]) -> None:
        """listener(data) is called, on the event loop, with every event of this type as it is published."""
        self._listeners.setdefault(kind, []).append(listener)

    def publish(self, kind: EventType, data: dict[str, Any]) -> int:
        """Numbers the event, keeps it, and hands it to every subscriber and listener. Returns its sequence
        number."""
        kind = EventType(kind)
        self.sequence += 1
        if self.sequence > self._reserved:
            self._reserve()
        line = encode({"seq": self.sequence, "type": kind.value, "epoch": self.epoch, "time": time.time(),
                       "data": data}) + b"\n"
        event = Event(self.sequence, kind.value, line)
        self._events.append(event)
        for subscription in list(self._subscribers):
            if not subscription.offer(event):
                self._subscribers.discard(subscription)
        for listener in self._listeners.get(kind, ()):
            listener(data)
        return self.sequence

    def backlog_after(self, since: int) -> tuple[list[Event], bool]:
        """Events after sequence `since`, and whether some of those were already dropped from the backlog."""
        oldest = self._events[0].seq if self._events else self.sequence + 1
        return [event for event in self._events if event.seq > since], since + 1 < oldest

    def from_earlier_run(self, since: int, epoch: str | None) -> bool:
        """Whether a watcher's last sequence number (and epoch, when it passes it) is of an earlier gpud
        run: this run's events are all new to it. A number this run has not reached is one too."""
        return (epoch is not None and epoch != self.epoch) or not self.first <= since <= self.sequence

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


def _reserved_from(document: dict) -> int:
    reserved = document["reserved_up_to"]
    if type(reserved) is not int or not 0 <= reserved < 1 << 62:
        raise ValueError(f"reserved_up_to must be a sequence number, not {reserved!r}")
    return reserved
