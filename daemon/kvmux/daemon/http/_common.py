"""What every route shares: who is asking, what it may cost, reading a bounded body,
and turning any failure into OpenAI's error object with the status the SDK maps.

Errors are translated here, in one place (:func:`guarded`): a kvmux error keeps
its code (under OpenAI's name where OpenAI has one: ``context_length_exceeded``)
and its diagnostics, ``overloaded`` becomes 429 with ``Retry-After``, loading and
draining 503; anything else is logged with its traceback and answered 500
``internal`` without it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvmux.client import jsonin
from kvmux.client.errors import Overloaded, Unauthorized
from kvmux.client.openai import RequestError, error_body, http_status, info_body

from ..access import ANONYMOUS, Caller
from ..budget import Bucket
from ..errors import error_info

if TYPE_CHECKING:
    from . import HttpFront


# What an HTTP request costs beyond what is measured: parsing it, routing it,
# writing the response (the daemon's loop runs all of it).
REQUEST_SECONDS = 200e-6
Endpoint = Callable[[Request], Awaitable[Response]]


class BodyTooLarge(Exception):
    """A request body over its limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is over {limit} bytes")
        self.limit = limit


class BodyTimeout(Exception):
    """A request body that did not arrive within ``http.body_timeout``."""


def front_of(request: Request) -> HttpFront:
    front: HttpFront = request.app.state.front
    return front


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        msgspec.json.encode(body), status, headers=headers, media_type="application/json"
    )


def error_response(exc: BaseException) -> Response:
    """Any failure of a request as OpenAI's error object and status."""
    headers: dict[str, str] = {}
    if isinstance(exc, RequestError):
        status = 400
        body = error_body(exc.message, status=status, code="invalid_request", param=exc.param)
    elif isinstance(exc, msgspec.ValidationError):
        status = 400
        body = error_body(str(exc), status=status, code="invalid_request", param=_param(exc))
    elif isinstance(exc, msgspec.DecodeError):
        status = 400
        body = error_body(f"the body is not valid JSON: {exc}", status=status, code="invalid_json")
    elif isinstance(exc, BodyTooLarge):
        status = 413
        body = error_body(str(exc), status=status, code="request_too_large")
    elif isinstance(exc, BodyTimeout):
        status = 408
        body = error_body(str(exc), status=status, code="request_timeout")
    else:
        # Typed errors (kvmux's, the KV layer's, the engine's) as on the socket;
        # anything else logged and answered 500 internal.
        info = error_info(exc, front="http")
        status = http_status(info.code)
        body = info_body(info)
        if status in (429, 503):
            retry = info.details.get("retry_after", 1.0)
            if isinstance(retry, int | float) and retry > 0:
                headers["retry-after"] = str(max(1, math.ceil(retry)))
                headers["retry-after-ms"] = str(int(retry * 1000))
    return json_response(body, status, headers)


_MISSING = re.compile(r"missing required field `([^`]+)`")
_AT = re.compile(r"at `\$\.([A-Za-z_0-9]+)")


def _param(exc: msgspec.ValidationError) -> str | None:
    """The parameter msgspec's message names: where it failed, or what is missing."""
    text = str(exc)
    found = _AT.search(text) or _MISSING.search(text)
    return found.group(1) if found else None


def guarded(
    endpoint: Endpoint, *, auth: bool = True, metered: bool = True
) -> Callable[[Request], Awaitable[Response]]:
    """``endpoint`` with its caller authenticated, its cost checked against the request
    budget (``metered``) and charged, and every failure translated."""

    async def run(request: Request) -> Response:
        front = front_of(request)
        caller: Caller | None = None
        bucket: Bucket | None = None
        try:
            if auth:
                caller = front.authenticate(request.headers.get("authorization"))
                request.state.caller = caller
                bucket = front.connection_bucket(request.scope.get("client"))
                if metered:
                    try:
                        front.budget.check(bucket, caller.owner)
                    except Overloaded as exc:
                        return error_response(exc)  # refused, not charged (see .budget)
            response = await endpoint(request)
        except Exception as exc:  # noqa: BLE001 - translated; nothing escapes a request
            response = error_response(exc)
        if caller is not None:
            # What handling it took is not measured here: the endpoint waits, and the
            # loop runs everyone else meanwhile. Its bytes are what grows with it.
            sent = int(response.headers.get("content-length") or 0)
            received = int(request.headers.get("content-length") or 0)
            front.budget.charge(bucket, caller.owner, REQUEST_SECONDS, sent + received)
        return response

    return run


def caller_of(request: Request) -> Caller:
    caller: Caller = getattr(request.state, "caller", Caller(ANONYMOUS))
    return caller


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object (bounded by :class:`~kvmux.daemon.http.Limits`)."""
    obj = jsonin.decode(await request.body())
    if not isinstance(obj, dict):
        raise RequestError("the body must be a JSON object")
    return obj


async def json_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (an unknown route, a wrong method) in OpenAI's shape."""
    status = getattr(exc, "status_code", 500)
    if status == 404:
        message = f"no route {request.method} {request.url.path} on this kvmuxd"
        code = "not_found"
    elif status == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
        code = "method_not_allowed"
    else:
        message = str(getattr(exc, "detail", exc))
        code = None
    return json_response(error_body(message, status=status, code=code), status)


def unauthorized() -> Unauthorized:
    return Unauthorized(
        "Incorrect or missing API key: send `Authorization: Bearer KEY` with a key from this "
        "daemon's http.api_keys"
    )
