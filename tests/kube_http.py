"""A test's own HTTPS client of a Kubernetes API server (the stand-in in tests/kube_api_stand_in.py, or a
real kube-apiserver from tests/kube_real.py): what `kubectl` does for a test, in the standard library,
so that a test's setup and checks never go through the code under test (gpud's agent uses
kubernetes_asyncio)."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class KubeHttp:
    """One user of one API server: `token` is sent as a bearer token, the server's certificate is
    checked against `ca_file`."""

    def __init__(self, url: str, ca_file: Path, token: str | None, timeout: float = 10.0):
        parsed = urllib.parse.urlsplit(url)
        assert parsed.scheme == "https", url
        self.host, self.port = parsed.hostname, parsed.port or 443
        self.token = token
        self.timeout = timeout
        self.context = ssl.create_default_context(cafile=str(ca_file))

    def _connection(self, timeout: float | None) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=timeout)

    def _headers(self, content_type: str | None, accept: str = JSON) -> dict[str, str]:
        headers = {"Accept": accept}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        if content_type is not None:
            headers["Content-Type"] = content_type
        return headers

    def request(self, method: str, path: str, body: Any = None, content_type: str = JSON,
                query: dict[str, str] | None = None, accept: str = JSON) -> tuple[int, Any]:
        """(status, the decoded JSON answer, or the raw text where it is not JSON); a bytes body is sent as
        it is, anything else as JSON."""
        url = path + ("?" + urllib.parse.urlencode(query) if query else "")
        payload = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        conn = self._connection(self.timeout)
        try:
            conn.request(method, url, body=payload,
                         headers=self._headers(content_type if payload is not None else None, accept))
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, raw.decode(errors="replace")

    def get(self, path: str, **query: str) -> Any:
        status, document = self.request("GET", path, query=query or None)
        assert status == 200, (path, status, document)
        return document

    def patch(self, path: str, patch: Any, content_type: str = MERGE_PATCH) -> tuple[int, Any]:
        return self.request("PATCH", path, patch, content_type)

    def put(self, path: str, obj: Any, content_type: str = JSON) -> tuple[int, Any]:
        return self.request("PUT", path, obj, content_type)

    def delete(self, path: str, options: Any = None, **query: str) -> tuple[int, Any]:
        return self.request("DELETE", path, options, query=query or None)

    def watch(self, path: str, timeout: float = 10.0, **query: str) -> Iterator[dict]:
        """The events of a watch (query `watch=true` is added), one decoded JSON object each, until the
        server ends the stream; a read waiting longer than `timeout` raises TimeoutError."""
        conn = self._connection(timeout)
        try:
            conn.request("GET", path + "?" + urllib.parse.urlencode({**query, "watch": "true"}),
                         headers=self._headers(None))
            response = conn.getresponse()
            if response.status != 200:
                raise AssertionError(f"watch {path} answered {response.status}: {response.read()[:500]!r}")
            for line in response:
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()


def node_path(name: str, subresource: str | None = None) -> str:
    return f"/api/v1/nodes/{urllib.parse.quote(name, safe='')}" + (f"/{subresource}" if subresource else "")


SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"


def slice_path(name: str) -> str:
    return f"{SLICES_PATH}/{urllib.parse.quote(name, safe='')}"


def claim_path(namespace: str, name: str | None = None) -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims" + (f"/{name}" if name else "")
