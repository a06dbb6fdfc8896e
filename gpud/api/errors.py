"""API errors and request-body parsing: every failure is a JSON error with a slug and a sentence."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from gpud.api.responses import json_response
from gpud.base import bounded_json
from gpud.base.errors import ErrorKind, GpudError
from gpud.base.loops import within

MAX_BODY_BYTES = 1 << 20
# No route takes anything nested deeper than a list in an object; this leaves room and keeps a
# hostile body far from Python's recursion limit.
MAX_BODY_DEPTH = 32
# json's C parser holds the GIL for the whole parse, on a parser thread too: a 1 MiB body of empty
# lists stops the event loop for ~55 ms. No route takes more than a few hundred values (an inline
# config is one string), so a body with more brackets and commas than this (strings' own included:
# a cheap count, not a parse) is refused before it is parsed; parsing this many takes ~3 ms. PUT
# /v1/allocations, a list of device IDs, sets its own bounds.
MAX_BODY_VALUES = 50_000
# One kind of request error is logged at most this many times a window (see RequestErrorLog).
REQUEST_ERRORS_LOGGED = 5
REQUEST_ERROR_WINDOW_S = 60.0
# An error echoes at most this much of the request's path: an unknown 8 KiB path is not worth 8 KiB
# of answer (the length is said instead).
MAX_ECHOED_PATH = 100
# Request bodies are parsed on this many threads of their own, never on the event loop (a 1 MiB body
# takes tens of milliseconds as JSON, seconds as YAML): every other client is served meanwhile, and a
# flood of large bodies waits its turn here rather than taking the default executor's threads, which
# the rest of gpud's blocking work runs on.
BODY_PARSER_THREADS = 2
_body_parsers = ThreadPoolExecutor(BODY_PARSER_THREADS, thread_name_prefix="gpud-body-parser")
Parsed = TypeVar("Parsed")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(GpudError):
    """A request the routes themselves refuse (its body, its query, an unknown id)."""


def error_response(status: int, code: str, message: str, **details: Any) -> web.Response:
    error = {"code": code, "message": message}
    error.update(details)
    return json_response({"error": error}, status)


# The one table of what HTTP status answers each kind of GpudError, on every route (ErrorTableRouter).
ERROR_STATUS: dict[ErrorKind, int] = {
    ErrorKind.INVALID: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.TIMED_OUT: 408,
    ErrorKind.CONFLICT: 409,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.REFUSED: 422,
    ErrorKind.RATE_LIMITED: 429,
    ErrorKind.FAILED: 500,
    ErrorKind.UNSUPPORTED: 501,
    ErrorKind.TOOL_FAILED: 502,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.DISK_FULL: 507,
}


def gpud_error_response(exc: GpudError) -> web.Response:
    """The JSON answer to a GpudError, with its kind's status."""
    response = error_response(ERROR_STATUS[exc.kind], exc.code, exc.message, **exc.details)
    if exc.kind is ErrorKind.TIMED_OUT:
        response.force_close()  # the rest of a stalled body is not worth waiting for
    if isinstance(exc.details.get("retry_after_s"), (int, float)):  # RFC 9110 10.2.3: whole seconds
        response.headers["Retry-After"] = str(math.ceil(exc.details["retry_after_s"]))
    return response


def answering_gpud_errors(handler: Handler) -> Handler:
    """The handler, answering a GpudError it raises (an ApiError, or a domain refusal) with its JSON response."""

    @functools.wraps(handler)
    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except GpudError as exc:
            return gpud_error_response(exc)

    return answer


class ErrorTableRouter(web.UrlDispatcher):
    """aiohttp's router, except that every handler added to it answers a GpudError with the status of
    its kind (ERROR_STATUS), so that no route can forget to.

    Each handler is wrapped once, where it is added, rather than by an aiohttp middleware: a middleware
    costs every request about 15% of throughput (bench/api.py). aiohttp's add_get adds its HEAD and GET
    routes itself; every other add_* goes through add_route.
    """

    def add_route(self, method: str, path: str, handler: Handler, **kwargs: Any) -> web.AbstractRoute:
        return super().add_route(method, path, answering_gpud_errors(handler), **kwargs)

    def add_get(self, path: str, handler: Handler, **kwargs: Any) -> web.AbstractRoute:
        return super().add_get(path, answering_gpud_errors(handler), **kwargs)


async def no_such_route(request: web.Request) -> web.Response:
    """The catch-all route: 405 naming the allowed methods when the path exists, else 404."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.match_info.route.resource:
            allowed |= (await resource.resolve(request))[1]
    if allowed:
        response = error_response(405, "method-not-allowed",
                                  f"{request.method} is not allowed on {echoed_path(request.path)}; allowed: "
                                  f"{', '.join(sorted(allowed))}", allowed=sorted(allowed))
        response.headers["Allow"] = ", ".join(sorted(allowed))  # RFC 9110: a 405 must say what is allowed
        return response
    return error_response(404, "not-found",
                          f"no such route: {echoed_path(request.path)}; GET /v1/openapi.json lists the routes")


def echoed_path(path: str) -> str:
    """The path as an error message quotes it: whole up to MAX_ECHOED_PATH characters, else its start
    and its length."""
    if len(path) <= MAX_ECHOED_PATH:
        return path
    return f"{path[:MAX_ECHOED_PATH]}... ({len(path)} characters)"


async def off_the_loop(parse: Callable[..., Parsed], *args: Any) -> Parsed:
    """parse(*args) on a body-parser thread (see BODY_PARSER_THREADS)."""
    return await asyncio.get_running_loop().run_in_executor(_body_parsers, functools.partial(parse, *args))


def _too_large(size: int | None, limit: int = MAX_BODY_BYTES) -> ApiError:
    got = f" (got {size} bytes)" if size is not None else ""
    return ApiError(ErrorKind.TOO_LARGE, "body-too-large", f"request bodies are limited to {limit} bytes{got}")


def _too_deep() -> ApiError:
    return ApiError(ErrorKind.INVALID, "invalid-json",
                    f"the request body nests lists or objects more than {MAX_BODY_DEPTH} deep")


async def read_json_object(request: web.Request, timeout_s: float, fields: dict[str, tuple], *,
                           limit: int = MAX_BODY_BYTES, max_values: int = MAX_BODY_VALUES) -> dict:
    """The request body as a JSON object whose keys are in `fields` (name -> accepted types).

    A key whose types include None is optional. Unknown keys are refused, so a typo never passes silently.
    limit and max_values: for the one route whose body is a list of many IDs (PUT /v1/allocations).
    """
    return await off_the_loop(_json_object, await _read_body(request, timeout_s, limit), fields, max_values)


async def read_any_json_object(request: web.Request, timeout_s: float, limit: int) -> dict:
    """The request body as a JSON object of any keys, at most `limit` bytes (413 beyond), refused when
    too complex or too deep as read_json_object's bodies are."""
    return await off_the_loop(_parsed_object, await _read_body(request, timeout_s, limit))


async def _read_body(request: web.Request, timeout_s: float, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(request.content_length, limit)
    try:
        raw = await within(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(ErrorKind.TIMED_OUT, "body-timeout",
                       f"the request body did not arrive within {timeout_s:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(None, limit) from None
    except web.HTTPException as exc:  # a malformed body (bad chunking and the like)
        raise ApiError(ErrorKind.INVALID, "bad-request", f"the request body could not be read: {exc.reason}") from None
    except ConnectionResetError:  # the client went away mid-body: nothing to answer, nothing to trace
        raise ApiError(ErrorKind.INVALID, "body-incomplete",
                       "the client closed the connection before its body arrived") from None
    if len(raw) > limit:  # a chunked body says its size only once read
        raise _too_large(len(raw), limit)
    return raw


def _json_object(raw: bytes, fields: dict[str, tuple], max_values: int) -> dict:
    """read_json_object's parse and checks, on a body-parser thread."""
    body = _parsed_object(raw, max_values)
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise ApiError(ErrorKind.INVALID, "unknown-field",
                       f"unknown field(s): {', '.join(unknown)}; accepted: {', '.join(fields)}")
    for name, types in fields.items():
        value = body.get(name)
        if value is None:
            if type(None) not in types:
                raise ApiError(ErrorKind.INVALID, "missing-field", f"field '{name}' is required")
            continue
        if isinstance(value, bool) and bool not in types or not isinstance(value, tuple(t for t in types if t)):
            wanted = " or ".join(_JSON_TYPES[t] for t in types if t is not type(None))
            raise ApiError(ErrorKind.INVALID, "invalid-field",
                           f"field '{name}' must be {wanted}, got {json.dumps(value)[:80]}")
    return body


def _parsed_object(raw: bytes, max_values: int = MAX_BODY_VALUES) -> dict:
    """The body as a JSON object, on a body-parser thread: 400 when it is not one, or is too complex
    or too deep to take safely."""
    values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if values > max_values:
        why = " (gpud's requests hold a few values)" if max_values == MAX_BODY_VALUES else ""
        raise ApiError(ErrorKind.INVALID, "body-too-complex",
                       f"the request body has {values} brackets and commas; request bodies "
                       f"are limited to {max_values}{why}")
    try:
        body = bounded_json.loads(raw, what="the request body", max_depth=MAX_BODY_DEPTH, parse_constant=_not_json,
                                  parse_float=_finite) if raw.strip() else None
    except bounded_json.JsonTooDeep:
        raise _too_deep() from None
    except ValueError as exc:
        raise ApiError(ErrorKind.INVALID, "invalid-json", str(exc)) from None
    if not isinstance(body, dict):
        raise ApiError(ErrorKind.INVALID, "invalid-body", "the request body must be a JSON object")
    return body


def _not_json(word: str) -> float:
    """NaN and Infinity, which Python's json reads and JSON has not: gpud would serve them back unreadable."""
    raise ValueError(f"{word} is not a JSON number")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text[:40]} is too large a number")
    return number


_JSON_TYPES = {int: "an integer", float: "a number", str: "a string", list: "a list", bool: "true or false",
               dict: "an object"}


class RequestErrorLog(logging.Filter):
    """What aiohttp logs about requests it could not serve, made safe to log.

    A malformed request (the client's fault) becomes one warning naming its kind: aiohttp's own
    message quotes the request's bytes, an Authorization header included, and its traceback is of
    aiohttp's parser. A failure inside gpud keeps its traceback, as text without the frames' local
    variables, which hold the request's bytes. A kind is logged at most REQUEST_ERRORS_LOGGED times
    per REQUEST_ERROR_WINDOW_S, so a client sending garbage in a loop cannot flood the journal; the
    first line of the next window says how many were left out. (On a Unix socket aiohttp knows no
    peer address, so the limit is per kind of error rather than per client.)
    """

    def __init__(self) -> None:
        super().__init__()
        self._windows: dict[str, list] = {}  # kind -> [window start, lines logged, lines left out]

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        kind = type(error).__name__ if error else record.msg
        if isinstance(error, HttpProcessingError):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = "malformed_request: %s (answered %s)", (kind, error.code)
        elif error is not None:
            record.msg, record.args = "request_failed: %s", ("".join(traceback.format_exception(error)),)
        record.exc_info = None
        now = time.monotonic()
        window = self._windows.get(kind)
        if window is None or now - window[0] >= REQUEST_ERROR_WINDOW_S:
            left_out = window[2] if window else 0
            window = self._windows[kind] = [now, 0, 0]
            if left_out:
                record.msg = f"{record.msg} ({left_out} more like it left out in the last window)"
        if window[1] >= REQUEST_ERRORS_LOGGED:
            window[2] += 1
            return False
        window[1] += 1
        return True


class JsonErrorRequestHandler(RequestHandler):
    """aiohttp's connection protocol, answering what never reaches a route with gpud's JSON error.

    aiohttp answers a request it cannot parse (bytes that are not HTTP, an invalid method, a header
    line too long, bad chunking), and a handler that raised, itself: as text/plain quoting the
    offending bytes back. Here the answer is {"error": {...}} with the same status, naming only the
    kind of error; the connection is still closed after it, and the error still logged (rate-limited,
    without the bytes: RequestErrorLog).
    """

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises when an answer has begun already
        if status >= 500:
            code, sentence = "internal-error", "gpud failed to answer this request; its log says why"
        else:
            kind = type(exc).__name__ if exc is not None else "malformed request"
            code, sentence = "bad-request", f"the request is not valid HTTP/1.1 ({kind})"
        response = error_response(status, code, sentence)
        response.force_close()
        return response


def answer_malformed_requests_with_json(server: web.Server) -> None:
    """Makes every connection server accepts from now on a JsonErrorRequestHandler. aiohttp's
    AppRunner builds its Server itself and has no setting for the protocol class, which the Server
    instantiates in __call__: the one override is that of the Server's class."""
    server.__class__ = _JsonErrorServer


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


# The logger aiohttp reports request errors to (the API server passes it to aiohttp).
REQUEST_ERROR_LOG = logging.getLogger("gpud.requests")
REQUEST_ERROR_LOG.addFilter(RequestErrorLog())
