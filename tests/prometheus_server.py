"""Debian's Prometheus as the tests run it: `promtool` and `prometheus` found (or the test skipped, and
failed under CI), and a Prometheus server scraping given targets, with rule files, answering its HTTP
API (https://prometheus.io/docs/prometheus/latest/querying/api/)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from helpers import IN_CI


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if IN_CI:
            pytest.fail(f"CI must have {name} (Debian's prometheus package; scripts/test-all installs it)")
        pytest.skip(f"{name} is not installed (apt-get install prometheus)")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class PrometheusServer:
    """A Prometheus server in `tmp`, scraping `targets` as the job "gpud" every `interval_s` (rules
    evaluated as often), loading `rule_files`. Use as an async context manager."""

    def __init__(self, tmp: Path, targets: list[str], rule_files: tuple[Path, ...] = (), interval_s: float = 1.0):
        self.tmp, self.targets, self.rule_files, self.interval_s = tmp, targets, rule_files, interval_s
        self.web = f"127.0.0.1:{free_port()}"
        self.log_path = tmp / "prometheus.log"
        self._server: subprocess.Popen | None = None

    async def __aenter__(self) -> PrometheusServer:
        prometheus = tool("prometheus")
        interval = f"{self.interval_s:g}s"
        config = {"global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
                  "rule_files": [str(path) for path in self.rule_files],
                  "scrape_configs": [{"job_name": "gpud", "static_configs": [{"targets": self.targets}]}]}
        (self.tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        with self.log_path.open("w") as log:
            self._server = subprocess.Popen([prometheus, f"--config.file={self.tmp / 'prometheus.yml'}",
                                             f"--storage.tsdb.path={self.tmp / 'data'}",
                                             f"--web.listen-address={self.web}"],
                                            stdout=log, stderr=subprocess.STDOUT)
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._server.send_signal(signal.SIGTERM)
        try:
            self._server.wait(10)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait(10)

    def log_tail(self, size: int = 3000) -> str:
        return self.log_path.read_text()[-size:]

    async def answer(self, path: str, wanted: Callable[[Any], Any], timeout: float = 30.0) -> Any:
        """The API answer's data once wanted(data) is truthy (Prometheus is starting, then scraping)."""
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            assert self._server.poll() is None, self.log_path.read_text()
            try:
                last = await asyncio.to_thread(_get_json, f"http://{self.web}{path}")
                found = wanted(last["data"])
                if found:
                    return found
            except (urllib.error.URLError, ConnectionError):
                pass
            await asyncio.sleep(0.2)
        raise AssertionError(f"Prometheus never answered {path} as wanted: {last}\n{self.log_tail()}")

    async def query(self, expr: str) -> dict:
        """An instant query's answer (status and all), a query Prometheus refuses included."""
        url = f"http://{self.web}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        return await asyncio.to_thread(_get_json, url)


def _get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:  # a query refused (400, 422) answers JSON saying why
        if error.code in (400, 422):
            return json.loads(error.read())
        raise
