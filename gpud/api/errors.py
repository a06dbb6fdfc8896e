"""API errors and request-body parsing: every failure is a JSON error with a slug and a sentence."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from gpud.api.views import encode

MAX_BODY_BYTES = 1 << 20


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, **details: Any):
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, details

    def response(self) -> web.Response:
        response = error_response(self.status, self.code, self.message, **self.details)
        if self.status == 408:
            response.force_close()  # the rest of a stalled body is not worth waiting for
        return response


def error_response(status: int, code: str, message: str, **details: Any) -> web.Response:
    error = {"code": code, "message": message}
    error.update(details)
    return web.Response(status=status, body=encode({"error": error}), content_type="application/json")


# aiohttp's own HTTP errors (no route, wrong method, body too large) get gpud's shape too.
_HTTP_CODES = {400: "bad-request", 404: "not-found", 405: "method-not-allowed", 413: "body-too-large",
               414: "uri-too-long", 431: "headers-too-large"}


@web.middleware
async def error_middleware(request: web.Request, handler):
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        return _too_large(request.content_length)
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge:
        return _too_large(None)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = _http_message(request, exc)
        details = {"allowed": sorted(exc.allowed_methods)} if isinstance(exc, web.HTTPMethodNotAllowed) else {}
        return error_response(exc.status, _HTTP_CODES.get(exc.status, f"http-{exc.status}"), message, **details)


def _http_message(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"no such route: {request.path}; GET /v1/openapi.json lists the routes"
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return f"{request.method} is not allowed on {request.path}; allowed: {', '.join(sorted(exc.allowed_methods))}"
    return exc.text or exc.reason


def _too_large(size: int | None) -> web.Response:
    got = f" (got {size} bytes)" if size is not None else ""
    return error_response(413, "body-too-large", f"request bodies are limited to {MAX_BODY_BYTES} bytes{got}")


async def read_json_object(request: web.Request, timeout_s: float, fields: dict[str, tuple]) -> dict:
    """The request body as a JSON object whose keys are in `fields` (name -> accepted types).

    A key whose types include None is optional. Unknown keys are refused, so a typo never passes silently.
    """
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, "body-timeout", f"the request body did not arrive within {timeout_s:g} s") from None
    try:
        body = json.loads(raw) if raw.strip() else None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "invalid-json", f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid-body", "the request body must be a JSON object")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise ApiError(400, "unknown-field", f"unknown field(s): {', '.join(unknown)}; accepted: {', '.join(fields)}")
    for name, types in fields.items():
        value = body.get(name)
        if value is None:
            if type(None) not in types:
                raise ApiError(400, "missing-field", f"field '{name}' is required")
            continue
        if isinstance(value, bool) and bool not in types or not isinstance(value, tuple(t for t in types if t)):
            wanted = " or ".join(_JSON_TYPES[t] for t in types if t is not type(None))
            raise ApiError(400, "invalid-field", f"field '{name}' must be {wanted}, got {json.dumps(value)[:80]}")
    return body


_JSON_TYPES = {int: "an integer", str: "a string", list: "a list", bool: "true or false", dict: "an object"}
