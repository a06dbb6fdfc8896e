"""API errors and request-body parsing: every failure is a JSON error with a slug and a sentence."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from aiohttp import web

from gpud.api.responses import json_response
from gpud.errors import GpudError

MAX_BODY_BYTES = 1 << 20


class ApiError(GpudError):
    """A request the routes themselves refuse (its body, its query, an unknown id)."""


def error_response(status: int, code: str, message: str, **details: Any) -> web.Response:
    error = {"code": code, "message": message}
    error.update(details)
    return json_response({"error": error}, status)


def json_errors(handler):
    """Answers a GpudError raised by the handler (an ApiError, or a domain refusal) with its JSON response.

    A decorator on the routes rather than an aiohttp middleware: a middleware costs every request
    about 15% of throughput (bench/api.py), and the hot read routes cannot fail this way.
    """

    @functools.wraps(handler)
    async def answer(self, request: web.Request) -> web.StreamResponse:
        try:
            return await handler(self, request)
        except GpudError as exc:
            response = error_response(exc.status, exc.code, exc.message, **exc.details)
            if exc.status == 408:
                response.force_close()  # the rest of a stalled body is not worth waiting for
            return response

    return answer


async def no_such_route(request: web.Request) -> web.Response:
    """The catch-all route: 405 naming the allowed methods when the path exists, else 404."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.match_info.route.resource:
            allowed |= (await resource.resolve(request))[1]
    if allowed:
        return error_response(405, "method-not-allowed",
                              f"{request.method} is not allowed on {request.path}; allowed: {', '.join(sorted(allowed))}",
                              allowed=sorted(allowed))
    return error_response(404, "not-found", f"no such route: {request.path}; GET /v1/openapi.json lists the routes")


def _too_large(size: int | None) -> ApiError:
    got = f" (got {size} bytes)" if size is not None else ""
    return ApiError(413, "body-too-large", f"request bodies are limited to {MAX_BODY_BYTES} bytes{got}")


async def read_json_object(request: web.Request, timeout_s: float, fields: dict[str, tuple]) -> dict:
    """The request body as a JSON object whose keys are in `fields` (name -> accepted types).

    A key whose types include None is optional. Unknown keys are refused, so a typo never passes silently.
    """
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise _too_large(request.content_length)
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, "body-timeout", f"the request body did not arrive within {timeout_s:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(None) from None
    except web.HTTPException as exc:  # a malformed body (bad chunking and the like)
        raise ApiError(400, "bad-request", f"the request body could not be read: {exc.reason}") from None
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
