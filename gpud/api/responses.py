"""The one way the API answers with JSON."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gpud.base.encoding import encode


def json_response(document: Any, status: int = 200) -> web.Response:
    return encoded_json_response(encode(document), status)


def encoded_json_response(body: bytes, status: int = 200) -> web.Response:
    """A body encoded ahead of time: the hot read routes answer from snapshots encoded once per change."""
    return web.Response(status=status, body=body, content_type="application/json")
