"""Benchmark: gpud under load: readers, MIG applies, an XID storm and watch streams at once.

Usage: python bench/load.py [--seconds 20] [--clients 64] [--xids 1000] [--watchers 8]

Starts gpud on a simulated DGX A100 (8 GPUs) and, all on its Unix socket, for --seconds:
* --clients keep-alive connections read GET /v1/gpus, /v1/health, /v1/mig and /metrics in turn;
* MIG applies run back to back (PUT /v1/mig?wait=true, two layouts in alternation);
* --xids XIDs are injected (POST /v1/sim/xid), spread evenly over the run;
* --watchers streams read GET /v1/watch.
Prints errors (a status other than the expected one, or a failed connection) and p50/p99 latency per
kind of request, and the watch events each stream missed: its sequence numbers against the bus's,
read back afterwards with ?since=. Every request is counted; none is expected to fail or be dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import aiohttp
from simulated_gpud import simulated_gpud

READ_PATHS = ("/v1/gpus", "/v1/health", "/v1/mig", "/metrics")
LAYOUTS = ("all-1g.5gb", "all-balanced")
XIDS = (13, 31, 43, 45, 48, 63, 64, 74, 79, 92, 94, 95)  # application errors and unhealthy ones, mixed
QUIET_S = 0.5  # a watch stream (or the replay) with nothing for this long has everything
SUBSCRIBE_S = 0.3  # given to the watch streams to subscribe before the load begins


class Tally:
    """One kind of request: latencies of the ones answered as expected, and the others."""

    def __init__(self) -> None:
        self.latencies_ms: list[float] = []
        self.errors: list[str] = []

    def line(self, name: str) -> str:
        done = sorted(self.latencies_ms)
        if not done:
            return f"{name:<22} n=0 errors {len(self.errors)}"
        p50, p99 = done[len(done) // 2], done[min(len(done) - 1, int(len(done) * 0.99))]
        return f"{name:<22} n={len(done) + len(self.errors):<7} errors {len(self.errors):<4} " \
               f"p50 {p50:7.2f} ms  p99 {p99:7.2f} ms"


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = head.lower()
    if b"content-length:" in headers:
        length = int(headers.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        return status, await reader.readexactly(length)
    body = b""  # chunked
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        body += await reader.readexactly(size)
        await reader.readexactly(2)
    await reader.readexactly(2)
    return status, body


async def reader_client(sock: str, offset: int, until: float, tallies: dict[str, Tally]) -> None:
    """One keep-alive connection reading the read routes in turn (a light raw client, so the figures
    are gpud's, not an HTTP library's); reconnects after an error."""
    clock, n = time.perf_counter, offset
    while clock() < until:
        try:
            reader, writer = await asyncio.open_unix_connection(sock)
        except OSError as exc:
            tallies[READ_PATHS[n % len(READ_PATHS)]].errors.append(f"connect: {exc}")
            await asyncio.sleep(0.01)
            continue
        try:
            while clock() < until:
                path = READ_PATHS[n % len(READ_PATHS)]
                n += 1
                started = clock()
                writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
                status, _ = await read_response(reader)
                if status == 200:
                    tallies[path].latencies_ms.append((clock() - started) * 1000)
                else:
                    tallies[path].errors.append(f"HTTP {status}")
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            tallies[READ_PATHS[(n - 1) % len(READ_PATHS)]].errors.append(repr(exc))
        finally:
            writer.close()


async def timed(tally: Tally, http: aiohttp.ClientSession, method: str, path: str, body: dict) -> None:
    started = time.perf_counter()
    try:
        async with http.request(method, f"http://localhost{path}", json=body) as response:
            text = await response.text()
            if response.status == 200:
                tally.latencies_ms.append((time.perf_counter() - started) * 1000)
            else:
                tally.errors.append(f"HTTP {response.status}: {text[:200]}")
    except aiohttp.ClientError as exc:
        tally.errors.append(repr(exc))


async def mig_applies(http: aiohttp.ClientSession, until: float, tally: Tally) -> None:
    n = 0
    while time.perf_counter() < until:
        await timed(tally, http, "PUT", "/v1/mig?wait=true", {"layout": LAYOUTS[n % len(LAYOUTS)]})
        n += 1


async def xid_storm(http: aiohttp.ClientSession, count: int, seconds: float, tally: Tally) -> None:
    """`count` XIDs spread evenly over `seconds`, each on the next GPU; they are posted as scheduled
    whatever the answers take (up to 16 in flight), as a burst from the driver would come."""
    started, in_flight = time.perf_counter(), set()
    for n in range(count):
        await asyncio.sleep(max(0.0, started + n * seconds / count - time.perf_counter()))
        xid = {"gpu": n % 8, "xid": XIDS[n % len(XIDS)]}
        task = asyncio.ensure_future(timed(tally, http, "POST", "/v1/sim/xid", xid))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        if len(in_flight) >= 16:
            await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.gather(*in_flight)


async def watch_lines(http: aiohttp.ClientSession, path: str, seqs: list[int], ends: list[str],
                      until: float | None) -> str | None:
    """Reads a watch stream into `seqs` until `until` has passed and it has been quiet for QUIET_S
    (with no `until`: as soon as it is quiet). Returns the epoch; `ends` gets gap and end lines."""
    epoch = None
    async with http.get(f"http://localhost{path}") as stream:
        if stream.status != 200:
            ends.append(f"HTTP {stream.status}")
            return None
        while True:
            try:
                line = await asyncio.wait_for(stream.content.readline(), QUIET_S)
            except asyncio.TimeoutError:
                if until is None or time.perf_counter() > until:
                    return epoch
                continue
            if not line:
                ends.append("cut off")  # gpud ended the stream: a watcher too far behind
                return epoch
            event = json.loads(line)
            if event["type"] in ("heartbeat", "gap"):
                ends += [f"gap: {event.get('data')}"] if event["type"] == "gap" else []
                continue
            epoch = event["epoch"]
            seqs.append(event["seq"])


async def load(sock: Path, args: argparse.Namespace) -> list[str]:
    connector = aiohttp.UnixConnector(path=str(sock), limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        for _ in range(600):  # start-up done: the first inventory read and MIG settled
            async with http.get("http://localhost/v1/mig") as response:
                if response.status == 200 and (await response.json())["state"] not in ("pending", "applying"):
                    break
            await asyncio.sleep(0.05)
        streams: list[tuple[list[int], list[str]]] = [([], []) for _ in range(args.watchers)]
        until = time.perf_counter() + SUBSCRIBE_S + args.seconds
        watching = [asyncio.ensure_future(watch_lines(http, "/v1/watch", seqs, ends, until)) for seqs, ends in streams]
        await asyncio.sleep(SUBSCRIBE_S)  # every stream subscribed before the first event
        reads = {path: Tally() for path in READ_PATHS}
        applies, xids = Tally(), Tally()
        started = time.perf_counter()
        await asyncio.gather(*(reader_client(str(sock), n, until, reads) for n in range(args.clients)),
                             mig_applies(http, until, applies), xid_storm(http, args.xids, args.seconds * 0.9, xids))
        elapsed = time.perf_counter() - started
        epochs = await asyncio.gather(*watching)
        lines = [f"load on dgx-a100 (8 GPUs), {elapsed:.1f} s: {args.clients} readers, {args.watchers} watch streams, "
                 f"{args.xids} XIDs, MIG applies back to back ({' / '.join(LAYOUTS)})"]
        lines += [reads[path].line(f"GET {path}") for path in READ_PATHS]
        every = Tally()
        for tally in reads.values():
            every.latencies_ms += tally.latencies_ms
            every.errors += tally.errors
        lines.append(every.line("reads, all") + f"  ({len(every.latencies_ms) / elapsed:.0f} req/s)")
        lines += [xids.line("POST /v1/sim/xid"), applies.line("PUT /v1/mig?wait=true")]
        lines += await watch_report(http, streams, next((e for e in epochs if e), None))
        errors = [*every.errors, *xids.errors, *applies.errors]
        if errors:
            lines.append(f"first errors: {errors[:3]}")
        return lines


async def watch_report(http: aiohttp.ClientSession, streams: list[tuple[list[int], list[str]]],
                       epoch: str | None) -> list[str]:
    """Each stream's sequence numbers against the bus's, replayed from the backlog with ?since=."""
    firsts = [seqs[0] for seqs, _ in streams if seqs]
    if not firsts or epoch is None:
        return ["watch: no events received"]
    bus: list[int] = []
    bus_ends: list[str] = []
    await watch_lines(http, f"/v1/watch?since={min(firsts) - 1}&epoch={epoch}", bus, bus_ends, None)
    published = set(bus)
    dropped = [len(published - set(seqs)) for seqs, _ in streams]
    cut = sum("cut off" in ends for _, ends in streams)
    gaps = sum(1 for end in bus_ends if end.startswith("gap"))
    return [f"watch: {len(streams)} streams, {len(published)} events on the bus, dropped per stream: "
            f"max {max(dropped)}, total {sum(dropped)}; streams cut off: {cut}"
            + (f"; the backlog no longer held all of them ({gaps} gap)" if gaps else "")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the load runs")
    parser.add_argument("--clients", type=int, default=64, help="concurrent reading connections")
    parser.add_argument("--xids", type=int, default=1000, help="XIDs injected over the run")
    parser.add_argument("--watchers", type=int, default=8, help="watch streams")
    args = parser.parse_args()
    if not (0 < args.seconds <= 600 and 0 < args.clients <= 1024 and 0 <= args.xids <= 100_000
            and 0 < args.watchers <= 64):
        parser.error("out of bounds: 0 < seconds <= 600, 0 < clients <= 1024, 0 <= xids <= 100000, "
                     "0 < watchers <= 64")
    with simulated_gpud() as (_gpud, sock):
        for line in asyncio.run(load(sock, args)):
            print(line, flush=True)

if __name__ == "__main__":
    main()
