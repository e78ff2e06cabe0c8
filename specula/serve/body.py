"""Reading a request's body within bounds, so that no client holds the server by how it sends one: too large
is a 413 (before it is all read), not whole within the time allowed is a 408 (a client that sends less than its
Content-Length and waits, or drips it a byte at a time), a client that leaves first is a 499."""

from __future__ import annotations

import anyio
from starlette.requests import ClientDisconnect, Request

from specula.serve.errors import CLIENT_CLOSED, APIError


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The raw body of ``request``: at most ``limit`` bytes, whole within ``timeout_s`` seconds."""
    too_large = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    parts, size = [], 0
    try:
        with anyio.fail_after(timeout_s):  # one deadline for the whole body, not one per chunk
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise too_large
                parts.append(part)
    except ClientDisconnect:  # the client left before its whole body came (e.g. fewer bytes than Content-Length)
        raise APIError(CLIENT_CLOSED, "the client disconnected before sending the whole request body",
                       code="client_closed_request") from None
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="request_timeout") from None
    return b"".join(parts)
