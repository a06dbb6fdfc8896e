"""metrics.listen: Prometheus scrapes gpud over TCP. The listener serves the socket's /metrics and
nothing else; promtool parses what it serves, and a real Prometheus server scrapes it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
from helpers import Running, answer_until, need, sim_config, start_daemon, stop_daemon, until_async
from prometheus_server import PrometheusServer, free_port, tool

from gpud.api.metrics_listener import HEAD_TIMEOUT_S, MAX_CONNECTIONS_PER_ADDRESS, MAX_HEADERS
from gpud.config import ConfigError, listen_address, load_config, parse_config
from gpud.daemon import Daemon

TWO_GPUS = "A100-SXM4-40GB:2"
# Label names spelt as dcgm-exporter spells them (its render_metrics.go, /work/shared/reference/health.md
# §C2): kept for its dashboards, though Prometheus's lint prefers snake_case.
DCGM_EXPORTER_LABELS = {"UUID", "modelName", "GPU_I_ID", "GPU_I_PROFILE", "DCGM_FI_DRIVER_VERSION"}


def listening(tmp: Path, address: str, preset: str = TWO_GPUS):
    return sim_config(tmp, preset).with_overrides(**{"metrics.listen": address})


async def scrape(address: str, method: str = "GET", path: str = "/metrics", **kwargs) -> tuple[int, dict, str]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, f"http://{address}{path}", **kwargs) as response:
            return response.status, dict(response.headers), await response.text()


def families(text: str) -> list[str]:
    return re.findall(r"^# TYPE (\S+) ", text, re.M)


@pytest.fixture
async def node(short_tmp):
    address = f"127.0.0.1:{free_port()}"
    running = await start_daemon(listening(short_tmp, address))
    running.address = address
    yield running
    await stop_daemon(running)


# -- what the listener serves ----------------------------------------------------------------


def temperature_uuids(text: str) -> list[str]:
    return sorted(re.findall(r'^DCGM_FI_DEV_GPU_TEMP\{[^}]*UUID="([^"]+)"', text, re.M))


async def scrape_sampled(address: str, gpus: int, timeout: float = 10.0) -> tuple[int, dict, str]:
    """A scrape once the first periodic readings are in (the simulated GPUs' temperatures)."""
    deadline = time.monotonic() + timeout
    while True:
        status, headers, text = await scrape(address)
        if len(temperature_uuids(text)) == gpus or time.monotonic() > deadline:
            return status, headers, text
        await asyncio.sleep(0.05)


async def test_it_serves_the_sockets_metrics(node):
    status, headers, text = await scrape_sampled(node.address, 2)
    assert status == 200 and headers["Content-Type"] == "text/plain; charset=utf-8"
    async with node.http.get("http://localhost/metrics") as response:
        over_socket = await response.text()
    assert families(text) == families(over_socket) and "DCGM_FI_DEV_GPU_TEMP" in families(text)
    _, gpus = await node.get("/v1/gpus")
    uuids = sorted(gpu["uuid"] for gpu in gpus["gpus"])
    assert len(uuids) == 2
    assert temperature_uuids(text) == uuids
    status, headers, body = await scrape(node.address, "HEAD")
    assert status == 200 and body == "" and headers["Content-Type"].startswith("text/plain")


OTHER_PATHS = ["/", "/v1/gpus", "/v1/node", "/v1/mig", "/v1/health", "/v1/watch", "/healthz", "/v1/openapi.json",
               "/metrics/", "/Metrics", "/metrics/../v1/gpus", "/%2e%2e/v1/gpus"]
CHANGES = [("/v1/reload", None), ("/v1/mig", {"layout": "all-1g.5gb"}), ("/v1/sim/xid", {"gpu": 0, "xid": 79}),
           ("/v1/health/0/clear", None), ("/v1/mps/gpu-0/stop", None)]


async def test_no_other_path_is_served(node):
    for path in OTHER_PATHS:
        status, _, body = await scrape(node.address, path=path)
        assert status == 404 and json.loads(body)["error"]["code"] == "not-found", path


async def test_no_method_changes_anything(node):
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        status, headers, body = await scrape(node.address, method, json={"layout": "all-1g.5gb"})
        assert status == 405 and headers["Allow"] == "GET, HEAD", method
        assert json.loads(body)["error"]["allowed"] == ["GET", "HEAD"]
        for path, change in CHANGES:
            status, _, _ = await scrape(node.address, method, path, json=change)
            assert status == 404, (method, path)
    _, health = await node.get("/v1/health")
    assert health["status"] == "healthy"  # the simulated XID did not get through
    _, mig = await node.get("/v1/mig")
    assert mig["layout"] is None


async def test_malformed_requests_get_a_json_error(node):
    host, port = listen_address(node.address)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split()[1] == b"400" and json.loads(body)["error"]["code"] == "bad-request"  # header too long
    status, _, _ = await scrape(node.address)
    assert status == 200  # and it still serves


# Guards the per-address share: a ninth connection from one address takes the place of that
# address's oldest (all eight completed a scrape: none is kept before another); another address's
# connection is untouched.
async def test_one_address_cannot_hold_every_connection(node):
    host, port = listen_address(node.address)
    other = await asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0))
    held = [await asyncio.open_connection(host, port) for _ in range(MAX_CONNECTIONS_PER_ADDRESS)]
    for reader, writer in [other, *held]:  # each is served: every connection was admitted
        writer.write(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
    assert (await scrape(node.address))[0] == 200  # one more from the same address is served
    assert await asyncio.wait_for(held[0][0].read(), 5) == b""  # in the place of its oldest
    for reader, writer in [other, *held[1:]]:  # and the others are still served
        writer.write(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
    for _, writer in [other, *held]:
        writer.close()


# Guards the churn a reconnecting trickler caused: when every connection of an address still waits
# for its head, a newcomer from that address is refused at once instead of pushing one of them out
# (which the trickler then replaces, in a loop that cost the event loop); the waiting ones stay.
async def test_an_address_waiting_for_its_heads_gets_no_more_room(node):
    host, port = listen_address(node.address)
    waiting = [await asyncio.open_connection(host, port, local_addr=("127.0.0.3", 0))
               for _ in range(MAX_CONNECTIONS_PER_ADDRESS)]
    reader, writer = await asyncio.open_connection(host, port, local_addr=("127.0.0.3", 0))
    assert await asyncio.wait_for(reader.read(), 5) == b""  # refused: closed unanswered
    writer.close()
    for reader, writer in waiting:  # the first eight are still there, and answered
        writer.write(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
        writer.close()


# A local user's process (a uid without an account, in no group): holds `per_address` connections
# from each of 9 addresses from 127.0.0.<first> (argv: port, per_address, first) to the listener, trickles a byte of a request head on each every
# 0.2 s, and connects again whenever one is closed, until its stdin closes; then says how often it
# connected and how often gpud closed one of its connections.
TRICKLER = r"""
import json, selectors, socket, sys, threading, time
port, per_address, first = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Trickle: " + b"a" * 4000
selector = selectors.DefaultSelector()
sent, stats = {}, {"connects": 0, "closed": 0}
def connect(address):
    sock = socket.socket()
    sock.bind((address, 0))
    sock.setblocking(False)
    sock.connect_ex(("127.0.0.1", port))
    selector.register(sock, selectors.EVENT_READ, address)
    sent[sock] = 0
    stats["connects"] += 1
for n in range(first, first + 9):
    for _ in range(per_address):
        connect(f"127.0.0.{n}")
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
print("started", flush=True)
next_byte = time.monotonic()
while not done.is_set():
    gone = []
    for key, _ in selector.select(0.05):
        try:
            if key.fileobj.recv(4096) == b"":
                gone.append(key)
        except OSError:
            gone.append(key)
    if time.monotonic() >= next_byte:
        next_byte += 0.2
        for key in list(selector.get_map().values()):
            sock = key.fileobj
            try:
                sock.send(HEAD[sent[sock]:sent[sock] + 1])
                sent[sock] += 1
            except (BlockingIOError, InterruptedError):
                pass  # still connecting
            except OSError:
                gone.append(key)
    for key in {key.fileobj: key for key in gone}.values():
        if key.fileobj in sent:
            selector.unregister(key.fileobj)
            del sent[key.fileobj]
            key.fileobj.close()
            stats["closed"] += 1
            connect(key.data)
print(json.dumps(stats), flush=True)
"""


async def scrape_failure(host: str, port: int) -> str | None:
    """A scrape as Prometheus's first one: a new connection, the request in one write, the whole answer.
    None when it was answered; else what went wrong, for the test's message."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    except (OSError, asyncio.TimeoutError) as exc:
        return repr(exc)
    if answer.startswith(b"HTTP/1.1 200") and b"gpud_collector_errors_total" in answer:
        return None
    return f"answered {answer[:60]!r}" if answer else "closed unanswered"


async def scrapes_beside_a_trickler(host: str, port: int, per_address: int, first: int, uid: int,
                                    seconds: float) -> tuple[list[str], int, dict, float]:
    """Prometheus's first scrapes from 127.0.0.1, one every 0.1 s for seconds, while TRICKLER runs as uid (a
    user with no group) holding per_address connections from each of 127.0.0.first to first+8. What went wrong
    with each failed scrape, the number of scrapes, the trickler's counts and the seconds scraped."""
    trickler = await asyncio.create_subprocess_exec(
        "/usr/bin/python3", "-c", TRICKLER, str(port), str(per_address), str(first), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, user=uid, group=uid, extra_groups=[])
    try:
        assert await asyncio.wait_for(trickler.stdout.readline(), 20) == b"started\n"
        await asyncio.sleep(1.0)  # fixed time: the trickler's connections fill every slot first
        failures, started = [], time.monotonic()
        while time.monotonic() < started + seconds:
            failures.append(await scrape_failure(host, port))
            await asyncio.sleep(0.1)  # fixed time: a scrape interval, shortened
        elapsed = time.monotonic() - started
    finally:
        trickler.stdin.close()
        stats = json.loads(await asyncio.wait_for(trickler.stdout.readline(), 20))
        await asyncio.wait_for(trickler.wait(), 20)
    return [failure for failure in failures if failure is not None], len(failures), stats, elapsed


# Guards issue 20 item 2: 8 trickling connections from each of 127.0.0.2-10, reconnecting when
# closed, took all 64 slots and 28-30 of 30 scrapes were refused. Now the trickler (a real local user
# with no group) holds 270, and Prometheus's scrapes from 127.0.0.1 on a new connection each are all
# answered: a scrape completes its request, the trickler's connections never do, and theirs make room.
@pytest.mark.parametrize("seconds", [6.0, pytest.param(30.0, marks=pytest.mark.slow)])
async def test_trickling_connections_from_many_loopback_addresses_do_not_lock_out_scrapes(node, seconds):
    need(os.geteuid() == 0, "runs the trickler as another user")
    host, port = listen_address(node.address)
    failed, scrapes, stats, _ = await scrapes_beside_a_trickler(host, port, 30, 2, 60051, seconds)
    assert stats["connects"] >= 270 and stats["closed"] > 0, stats  # it did hold (and lose) connections
    assert len(failed) <= 0.01 * scrapes, f"{len(failed)} of {scrapes} scrapes failed: {failed}"


# Guards the whole-head deadline: a head trickled a byte at a time used to hold its slot for
# api.idle_timeout_s (15 s by default), every byte welcome; now the head must be whole within
# HEAD_TIMEOUT_S of the connection, however steadily it trickles.
async def test_a_trickled_head_is_cut_at_the_head_deadline(node):
    host, port = listen_address(node.address)
    reader, writer = await asyncio.open_connection(host, port)
    started = time.monotonic()
    with pytest.raises(ConnectionError):
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Trickle: " + b"a" * 400:
            writer.write(bytes([byte]))
            await writer.drain()
            assert time.monotonic() - started < HEAD_TIMEOUT_S + 3, "the trickled head was never cut"
            await asyncio.sleep(0.1)  # (polling) a byte every 0.1 s: within any per-byte timeout
            if reader.at_eof():
                raise ConnectionError("closed")
    assert HEAD_TIMEOUT_S - 0.5 < time.monotonic() - started < HEAD_TIMEOUT_S + 3
    writer.close()


# Guards the memory a head may take: aiohttp's default of 128 header lines of 8 KiB each let one
# connection make gpud hold a megabyte; more than MAX_HEADERS lines are refused.
async def test_a_head_with_too_many_header_lines_is_refused(node):
    headers = {f"X-Filler-{n}": "a" * 100 for n in range(MAX_HEADERS + 8)}
    status, _, body = await scrape(node.address, headers=headers)
    assert status == 400 and json.loads(body)["error"]["code"] == "bad-request"
    assert (await scrape(node.address, headers=dict(list(headers.items())[:MAX_HEADERS - 8])))[0] == 200


# Guards issue 20 item 3: the TCP listener showed every local user's GPU processes (pid, comm,
# container) to whoever reached it. Now it leaves out every series with a pid label unless
# metrics.listen_process_series is set; the socket's /metrics keeps them for api.group.
@pytest.mark.parametrize("shown", [False, True])
async def test_per_process_series_stay_off_tcp_unless_turned_on(short_tmp, shown):
    address = f"127.0.0.1:{free_port()}"
    config = listening(short_tmp, address).with_overrides(**{"metrics.listen_process_series": shown,
                                                             "health.check_interval_s": 0.5})
    running = await start_daemon(config)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        status, body = await running.post("/v1/sim/processes", {"gpu": 0, "processes": [
            {"pid": sleeper.pid, "used_memory_mib": 512, "sm_percent": 10}]})
        assert status == 200, body

        async def over_socket() -> str | None:
            async with running.http.get("http://localhost/metrics") as response:
                text = await response.text()
            return text if f'pid="{sleeper.pid}"' in text else None
        await until_async(over_socket, timeout=10, what="the process in the socket's /metrics")
        _, _, text = await scrape(address)
        assert ('pid="' in text) is shown and ('comm="sleep"' in text) is shown
        assert "# TYPE gpud_process_gpu_memory_used_bytes gauge" in text  # the family is there, its series not
        assert re.search(r'gpud_device_compute_processes{[^}]*gpu="0"[^}]*} 1$', text, re.M)  # counts stay
    finally:
        sleeper.kill()
        sleeper.wait(10)
        await stop_daemon(running)


async def test_a_silent_connection_is_closed_after_the_idle_timeout(short_tmp):
    address = f"127.0.0.1:{free_port()}"
    running = await start_daemon(listening(short_tmp, address).with_overrides(**{"api.idle_timeout_s": 0.2}))
    try:
        host, port = listen_address(address)
        reader, writer = await asyncio.open_connection(host, port)
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert time.monotonic() - started < 2
        writer.close()
    finally:
        await stop_daemon(running)


async def test_ipv6_loopback(short_tmp):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    try:
        address = f"[::1]:{free_port('::1')}"
    except OSError:
        pytest.skip("::1 is not configured on this host")
    running = await start_daemon(listening(short_tmp, address))
    try:
        status, _, text = await scrape(address)
        assert status == 200 and "DCGM_FI_DEV_GPU_TEMP" in text
    finally:
        await stop_daemon(running)


async def test_off_by_default(short_tmp):
    assert parse_config("").metrics.listen is None and parse_config("metrics: {}\n").metrics.listen is None
    running = await start_daemon(sim_config(short_tmp, TWO_GPUS))
    try:
        assert running.daemon.metrics_listener.address is None
    finally:
        await stop_daemon(running)


# -- promtool and a real Prometheus ----------------------------------------------------------


# promtool's naming lints that dcgm-exporter's own names draw (DCGM_FI_DEV_PCIE_REPLAY_COUNTER: a
# counter without _total, with "counter" in its name): the names are kept, so its dashboards work.
DCGM_NAME_LINTS = re.compile(r'_total" suffix|should not include type|camelCase|abbreviated units|base unit')
CAMEL_LABEL_LINT = "label names should be written in 'snake_case' not 'camelCase'"


def lint_problems_that_are_ours(text: str, output: str) -> list[str]:
    """promtool's lint lines, less those dcgm-exporter compatibility draws on purpose: naming lints
    on its metric names, and its label spellings (which gpud's own families share, for joins)."""
    camel_labels = {label for label in re.findall(r'[{,]([A-Za-z_][A-Za-z0-9_]*)="', text)
                    if re.search(r"[a-z][A-Z]|^[A-Z]", label)}
    assert camel_labels <= DCGM_EXPORTER_LABELS, f"labels not spelt as dcgm-exporter's: {camel_labels}"
    ours = []
    for line in output.splitlines():
        metric, _, problem = line.partition(" ")
        if problem == CAMEL_LABEL_LINT or metric.startswith("DCGM_") and DCGM_NAME_LINTS.search(problem):
            continue
        ours.append(line)
    return ours


async def test_promtool_parses_the_scrape_and_lints_only_dcgm_names(node):
    promtool = tool("promtool")
    await node.post("/v1/sim/xid", {"gpu": 1, "xid": 79})  # reasons, XID counts: more families to check
    await answer_until(node, "/v1/health", lambda _, body: body["status"] == "unhealthy")
    _, _, text = await scrape_sampled(node.address, 2)
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    output = checked.stdout + checked.stderr
    # 1: the text does not parse; 3: lint problems (promtool 2.42, cmd/promtool/main.go)
    assert checked.returncode in (0, 3) and "error while linting" not in output, output
    assert lint_problems_that_are_ours(text, output) == []


@pytest.mark.slow
async def test_a_real_prometheus_scrapes_gpud(node, tmp_path):
    async with PrometheusServer(tmp_path, [node.address]) as prometheus:
        target = await prometheus.answer("/api/v1/targets",
                                         lambda data: [t for t in data["activeTargets"] if t["health"] == "up"])
        assert target[0]["labels"] == {"instance": node.address, "job": "gpud"}
        _, gpus = await node.get("/v1/gpus")
        expected = {gpu["uuid"]: gpu for gpu in gpus["gpus"]}
        series = await prometheus.answer("/api/v1/query?query=DCGM_FI_DEV_GPU_TEMP",
                                         lambda data: len(data["result"]) >= len(expected) and data["result"])
        assert sorted(s["metric"]["UUID"] for s in series) == sorted(expected)
        for one in series:
            labels, gpu = one["metric"], expected[one["metric"]["UUID"]]
            assert labels["gpu"] == str(gpu["index"]) and labels["job"] == "gpud"
            assert labels["modelName"].endswith(gpu["name"].removeprefix("NVIDIA "))
            assert {"pci_bus_id", "device", "hostname", "instance"} <= set(labels)
            assert 0 < float(one["value"][1]) < 100  # a temperature in °C


# -- configuration, a port in use, reload ----------------------------------------------------


@pytest.mark.parametrize("value, words", [
    ("9400", "expected host:port"),
    ("127.0.0.1", "expected host:port"),
    (":9400", "no host"),
    ("127.0.0.1:0", "1 to 65535"),
    ("127.0.0.1:65536", "1 to 65535"),
    ("127.0.0.1:-1", "1 to 65535"),
    ("127.0.0.1:http", "1 to 65535"),
    ("::1:9400", "in brackets"),
    ("[::1:9400", "in brackets"),
    ("[localhost]:9400", "not an IPv6 address"),
    ("300.1.1.1:9400", "not an IPv4 address"),
    ("bad host:9400", "not an IP address or a host name"),
    ("-node:9400", "not an IP address or a host name"),
])
def test_bad_listen_addresses_name_the_key_and_line(value, words):
    with pytest.raises(ConfigError) as caught:
        parse_config(f"log:\n  level: info\nmetrics:\n  listen: '{value}'\n", "gpud.yaml")
    assert (caught.value.key, caught.value.line) == ("metrics.listen", 4)
    assert words in str(caught.value) and "gpud.yaml, line 4, key 'metrics.listen'" in str(caught.value)


@pytest.mark.parametrize("text, words", [("metrics:\n  listen: 9400\n", "expected a string"),
                                         ("metrics:\n  listen: [127.0.0.1]\n", "expected a string"),
                                         ("metrics:\n  listen: ''\n", "must not be empty"),
                                         ("metrics:\n  port: 9400\n", "unknown key"),
                                         ("metrics: 127.0.0.1:9400\n", "expected a mapping")])
def test_wrong_types_are_refused(text, words):
    with pytest.raises(ConfigError, match=words):
        parse_config(text)


@pytest.mark.parametrize("value, host, port", [("127.0.0.1:9400", "127.0.0.1", 9400), ("[::1]:9400", "::1", 9400),
                                               ("0.0.0.0:1", "0.0.0.0", 1), ("[::]:65535", "::", 65535),
                                               ("gpu-node-7.internal:9400", "gpu-node-7.internal", 9400)])
def test_good_listen_addresses(value, host, port):
    assert parse_config(f"metrics:\n  listen: '{value}'\n").metrics.listen == value
    assert listen_address(value) == (host, port)


def test_a_port_in_use_stops_gpud_at_start(run_gpud, short_tmp):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = "127.0.0.1:%d" % taken.getsockname()[1]
        (short_tmp / "gpud.yaml").write_text(f"metrics:\n  listen: '{address}'\n")
        gpud = run_gpud("--simulate", TWO_GPUS, "--sim-state", str(short_tmp / "sim.json"),
                        "--config", str(short_tmp / "gpud.yaml"))
        assert gpud.proc.wait(30) == 1
    failed = [e for e in gpud.log_events() if e.get("event") == "metrics_listen_failed"]
    assert failed and failed[0]["address"] == address and "in use" in failed[0]["error"], gpud.log_text()
    assert not gpud.socket.exists()  # it never served


class Reloadable:
    """An in-process gpud started from a config file that POST /v1/reload re-reads."""

    def __init__(self, tmp: Path):
        self.file = tmp / "gpud.yaml"
        self.overrides = {"api.socket": str(tmp / "g.sock"), "simulate": TWO_GPUS, "sim_state": str(tmp / "sim.json"),
                          "state_dir": str(tmp / "state"), "sharing.file": str(tmp / "none.yaml"),
                          "inventory.refresh_interval_s": 3600.0}

    def write(self, listen: str | None) -> None:
        self.file.write_text(f"metrics:\n  listen: {listen!r}\n" if listen else "metrics: {}\n")

    def read(self):
        return load_config(self.file).with_overrides(**self.overrides)

    async def start(self) -> Running:
        daemon = Daemon(self.read(), reread=self.read)
        await daemon.start()
        connector = aiohttp.UnixConnector(path=str(daemon.config.socket_path))
        return Running(daemon, aiohttp.ClientSession(connector=connector))


async def refused(address: str) -> bool:
    host, port = listen_address(address)
    try:
        _, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def test_reload_moves_the_listener_and_keeps_it_when_the_new_address_fails(short_tmp):
    first, second = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = Reloadable(short_tmp)
    config.write(first)
    running = await config.start()
    try:
        assert (await scrape(first))[0] == 200
        config.write(second)  # a changed address: listened on at once, the old one closed
        status, body = await running.post("/v1/reload")
        assert status == 200 and body["reloaded"] is True
        assert (await scrape(second))[0] == 200 and await refused(first)
        assert running.daemon.config.metrics.listen == second
        with socket.socket() as taken:  # a port in use: refused, the running listener stays
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            config.write("127.0.0.1:%d" % taken.getsockname()[1])
            config.file.write_text(config.file.read_text() + "log:\n  level: debug\n")
            status, body = await running.post("/v1/reload")
            assert status == 409 and body["error"]["code"] == "metrics-listen-failed", body
            assert "in use" in body["error"]["message"] and body["error"]["listening"] == second
        assert (await scrape(second))[0] == 200 and running.daemon.config.metrics.listen == second
        assert running.daemon.config.log.level == "info"  # nothing else of that reload was applied
        config.write(None)  # unset: no listener
        assert (await running.post("/v1/reload"))[0] == 200
        assert await refused(second) and running.daemon.metrics_listener.address is None
        config.write(first)  # set again
        assert (await running.post("/v1/reload"))[0] == 200 and (await scrape(first))[0] == 200
    finally:
        await stop_daemon(running)
    assert await refused(first)  # gpud stopped: so did the listener


def test_gpud_serve_logs_where_it_listens_and_sighup_moves_it(run_gpud, short_tmp):
    first, second = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = short_tmp / "gpud.yaml"
    config.write_text(f"metrics:\n  listen: '{first}'\n")
    gpud = run_gpud("--simulate", TWO_GPUS, "--sim-state", str(short_tmp / "sim.json"), "--config", str(config))
    gpud.wait_healthy()
    assert asyncio.run(scrape(first))[0] == 200

    def listening_on(address):
        return [e for e in gpud.log_events() if e.get("event") == "metrics_listening" and e["address"] == address]

    assert listening_on(first)[0]["bound"] == [first]
    config.write_text(f"metrics:\n  listen: '{second}'\n")
    gpud.proc.send_signal(signal.SIGHUP)
    gpud.wait_for(lambda: listening_on(second), what="metrics_listening on the new address")
    assert asyncio.run(scrape(second))[0] == 200 and asyncio.run(refused(first))
    assert gpud.stop() == 0
