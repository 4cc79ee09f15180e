"""The Files, Batch, Models and health routes: each a small translation between
OpenAI's shapes and :mod:`kvmux.daemon.batches` or the service."""

from __future__ import annotations

from typing import Annotated, Any, BinaryIO, Literal

import anyio.to_thread
import msgspec
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, Response

from kvmux.client.errors import BadRequest, NotFound

from ..batches import Staged
from ..metrics import CONTENT_TYPE_LATEST
from ._common import caller_of, front_of, json_response, read_json

_UPLOAD_CHUNK = 1 << 20


# -- health and models ---------------------------------------------------------------
async def health(request: Request) -> Response:
    """200 when ready, 503 while the model loads or the daemon drains (load balancers
    and ``kvmux``-less scripts poll it)."""
    state = front_of(request).state()
    return json_response({"status": state}, 200 if state == "ready" else 503)


async def list_models(request: Request) -> Response:
    front = front_of(request)
    return json_response({"object": "list", "data": [front.model_object(n) for n in front.names]})


async def get_model(request: Request) -> Response:
    front = front_of(request)
    name = front.served_model(request.path_params["model"])
    return json_response(front.model_object(name))


async def metrics(request: Request) -> Response:
    """Prometheus' text format, the metrics ``metrics.listen`` also serves."""
    front = front_of(request)
    if front.metrics is None:
        raise NotFound("this kvmuxd keeps no metrics", {"param": None})
    return Response(front.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


# -- files ---------------------------------------------------------------------------
class _ExpiresAfter(msgspec.Struct, forbid_unknown_fields=True):
    anchor: Literal["created_at"]
    seconds: Annotated[int, msgspec.Meta(ge=3600, le=2_592_000)]


async def create_file(request: Request) -> Response:
    """``POST /v1/files`` (multipart: ``file``, ``purpose``, ``expires_after[...]``)."""
    front = front_of(request)
    caller = caller_of(request)
    form = await request.form(max_files=1, max_fields=8, max_part_size=64 * 1024)
    try:
        purpose = form.get("purpose")
        if purpose != "batch":
            raise BadRequest(
                f"purpose {purpose!r} is not supported: kvmux stores files for the Batch API "
                "(purpose 'batch')",
                {"param": "purpose"},
            )
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise BadRequest("the form needs a `file` part", {"param": "file"})
        expires_after = None
        if "expires_after[anchor]" in form or "expires_after[seconds]" in form:
            seconds = str(form.get("expires_after[seconds]", ""))
            expiry = msgspec.convert(
                {
                    "anchor": form.get("expires_after[anchor]"),
                    "seconds": int(seconds) if seconds.isdigit() else seconds,
                },
                _ExpiresAfter,
            )
            expires_after = float(expiry.seconds)
        front.files.check_quota(caller.owner, upload.size or 0)
        staged = front.files.stage()
        try:
            # Starlette spooled the part already: copied and closed in one thread call.
            await anyio.to_thread.run_sync(_copy, upload.file, staged)
        except BaseException:
            staged.discard()
            raise
        record = await front.files.add(
            staged,
            owner=caller.owner,
            purpose="batch",
            filename=(upload.filename or "upload.jsonl")[:256],
            expires_after=expires_after,
        )
    finally:
        await form.close()
    return json_response(record.object())


def _copy(source: BinaryIO, staged: Staged) -> None:
    source.seek(0)
    while data := source.read(_UPLOAD_CHUNK):
        staged.write(data)
    staged.close()


def _limit(request: Request, default: int, most: int) -> int:
    text = request.query_params.get("limit")
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise BadRequest(f"limit must be a whole number from 1 to {most}", {"param": "limit"})
    return int(text)


def _page(objects: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": objects,
        "first_id": objects[0]["id"] if objects else None,
        "last_id": objects[-1]["id"] if objects else None,
        "has_more": has_more,
    }


async def list_files(request: Request) -> Response:
    front = front_of(request)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order is 'asc' or 'desc'", {"param": "order"})
    records, more = front.files.listing(
        caller_of(request),
        after=request.query_params.get("after"),
        limit=_limit(request, 10_000, 10_000),
        order="asc" if order == "asc" else "desc",
        purpose=request.query_params.get("purpose"),
    )
    return json_response(_page([r.object() for r in records], more))


async def get_file(request: Request) -> Response:
    front = front_of(request)
    return json_response(
        front.files.find(request.path_params["file_id"], caller_of(request)).object()
    )


async def file_content(request: Request) -> Response:
    """The file's bytes, streamed a bounded chunk at a time (Starlette's FileResponse:
    64 KiB reads off the event loop)."""
    front = front_of(request)
    record = front.files.find(request.path_params["file_id"], caller_of(request))
    return FileResponse(front.files.path(record), media_type="application/octet-stream")


async def delete_file(request: Request) -> Response:
    front = front_of(request)
    record = await front.files.delete(request.path_params["file_id"], caller_of(request))
    return json_response({"id": record.id, "object": "file", "deleted": True})


# -- batches ---------------------------------------------------------------------------
Metadata = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
    msgspec.Meta(max_length=16),
]


class _BatchCreate(msgspec.Struct):
    input_file_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    endpoint: str
    completion_window: str
    metadata: Metadata | None = None
    output_expires_after: _ExpiresAfter | None = None


async def create_batch(request: Request) -> Response:
    front = front_of(request)
    req = msgspec.convert(await read_json(request), _BatchCreate)
    record = await front.batches.create(
        caller_of(request),
        input_file_id=req.input_file_id,
        endpoint=req.endpoint,
        completion_window=req.completion_window,
        metadata=req.metadata,
        output_expires_after=(
            None if req.output_expires_after is None else req.output_expires_after.seconds
        ),
    )
    return json_response(record.object())


async def get_batch(request: Request) -> Response:
    front = front_of(request)
    return json_response(
        front.batches.find(request.path_params["batch_id"], caller_of(request)).object()
    )


async def list_batches(request: Request) -> Response:
    front = front_of(request)
    records, more = front.batches.listing(
        caller_of(request),
        after=request.query_params.get("after"),
        limit=_limit(request, 20, 100),
    )
    return json_response(_page([r.object() for r in records], more))


async def cancel_batch(request: Request) -> Response:
    front = front_of(request)
    await request.body()  # the SDK sends an empty one
    record = await front.batches.cancel(request.path_params["batch_id"], caller_of(request))
    return json_response(record.object())
