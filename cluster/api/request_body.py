"""Reading a request body as JSON without letting one client stall or exhaust the server.

Called by the frontend for every POST, after the request was authorized and given a
provisional admission slot, before any work that scales with the body:
    Content-Type checked (JSON, or none) -> 415 otherwise: a browser page may POST
      `text/plain` cross-origin without a CORS preflight, and must not drive a local
      server that way
    -> the body streamed in, whatever its framing (Content-Length or chunked), and cut
       with a 413 as soon as it passes the limit (nothing past the limit is read), or
       with a 408 when it does not arrive within the deadline
    -> parsed in linear time (the C JSON scanner; large bodies on a worker thread, so the
       event loop keeps answering /health), nesting bounded, lone surrogates refused.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from cluster.api.openai_protocol import ApiError

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a body may have (OpenAI bodies need ~6)."""
OFF_LOOP_BYTES = 64 << 10
"""Bodies larger than this are parsed on a worker thread rather than the event loop."""


async def read_json(request, max_body_bytes: int, timeout_s: float) -> Any:
    """The request's body as JSON, or ApiError 415 / 413 / 408 / 400."""
    check_content_type(request.headers.get("content-type"))
    raw = await read_body(request, max_body_bytes, timeout_s)
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_json, raw)
    return parse_json(raw)


def check_content_type(content_type: str | None) -> None:
    """JSON bodies only, as FastAPI takes them: `application/json`, `application/*+json`,
    or no Content-Type at all (a client that names none)."""
    if content_type is None:
        return
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return
    raise ApiError(
        415,
        f"unsupported Content-Type {mime or '(empty)'!r}: send the body as application/json",
        kind="invalid_request_error",
    )


async def read_body(request, max_body_bytes: int, timeout_s: float) -> bytes:
    """The body's bytes, read as it streams in: a declared length over the limit is
    refused before anything is read, a chunked one as soon as it passes the limit."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body_bytes:
        raise _too_large(max_body_bytes)
    try:
        return await asyncio.wait_for(_collect(request, max_body_bytes), timeout_s)
    except TimeoutError:
        raise ApiError(
            408, f"request body not received within {timeout_s:g} s", kind="timeout"
        ) from None


async def _collect(request, max_body_bytes: int) -> bytes:
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > max_body_bytes:
            raise _too_large(max_body_bytes)
        parts.append(part)
    return b"".join(parts)


def _too_large(max_body_bytes: int) -> ApiError:
    return ApiError(413, f"request body over {max_body_bytes} bytes")


def parse_json(raw: bytes) -> Any:
    """`raw` as JSON, linear in its size whatever it holds; ApiError 400 on anything a
    client got wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not UTF-8: {exc}") from None
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        message = "nests too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ApiError(400, f"malformed JSON body: {message}") from None
    if json_depth(body) > MAX_JSON_DEPTH:
        raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400, "request body holds a string that is not valid Unicode (a lone surrogate)"
        ) from None
    return body


def json_depth(value: Any) -> int:
    """Deepest nesting of lists and dicts in a parsed body, walked without recursion (a
    body the C scanner took may still be deeper than Python's recursion limit)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children)
    return deepest
