"""The OpenAI Batch API's routes: ``/v1/files`` and ``/v1/batches`` (docs/BATCH.md).

Routes:
    POST   /v1/files                  upload a file (multipart: ``file``, ``purpose=batch``)
    GET    /v1/files                  the files, newest first (``purpose``, ``order``, ``after``, ``limit``;
                                      ``first_id``, ``last_id``, ``has_more``)
    GET    /v1/files/{id}             one file's object
    GET    /v1/files/{id}/content     its bytes (an input, output or error file)
    DELETE /v1/files/{id}             remove it
    POST   /v1/batches                create a batch of an uploaded file's lines (validated here, whole)
    GET    /v1/batches                the batches, newest first (``after``, ``limit``; ``has_more``)
    GET    /v1/batches/{id}           one batch: status, request_counts, output and error file ids
    POST   /v1/batches/{id}/cancel    stop it: lines not started are not run

The API key guards every one of them like the other routes; every error is answered and counted as
any route's (gateway/edge.py ``error_answer``). The storage is gateway/batch_store.py;
one frontend of the node runs the batches (gateway/batch_runner.py). Every call here is a few small
SQLite transactions or a file read or write, run off the event loop. A storage failure is the store's
error (gateway/batch_faults.py: 507 on a full disk, 503 on an I/O error or a damaged store), raised to
the app's ShmgateError handler like any other.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from shmgate.gateway.batch_faults import StoreDamaged
from shmgate.gateway.batch_store import TERMINAL, BatchStore
from shmgate.gateway.edge import error_answer
from shmgate.gateway.endpoints import BY_PATH
from shmgate.gateway.served import read_body, served
from shmgate.shared.errors import Conflict, InvalidRequest, NotFound, RequestTooLarge, ShmgateError

__all__ = ["ENDPOINTS", "add_batch_routes", "validate_input"]

ENDPOINTS = tuple(BY_PATH)  # a batch runs the lines of one model endpoint (gateway/endpoints.py)
WINDOWS = {"24h": 24 * 3600}
MAX_FILE_BYTES = 200 << 20  # OpenAI's limit on a batch input file
MAX_LINES = 50_000  # OpenAI's limit on requests per batch
MAX_METADATA = 16  # keys, each up to 64 characters, values up to 512


def add_batch_routes(app: Any) -> None:
    app.add_api_route("/v1/files", upload_file, methods=["POST"])
    app.add_api_route("/v1/files", list_files, methods=["GET"])
    app.add_api_route("/v1/files/{file_id}", get_file, methods=["GET"])
    app.add_api_route("/v1/files/{file_id}", delete_file, methods=["DELETE"])
    app.add_api_route("/v1/files/{file_id}/content", file_content, methods=["GET"])
    app.add_api_route("/v1/batches", create_batch, methods=["POST"])
    app.add_api_route("/v1/batches", list_batches, methods=["GET"])
    app.add_api_route("/v1/batches/{batch_id}", get_batch, methods=["GET"])
    app.add_api_route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"])


def _store(request: Request) -> BatchStore:
    """The batch store, once the key is checked."""
    served(request).check_key(request)
    store: BatchStore | None = getattr(request.app.state, "batches", None)
    if store is None:
        raise InvalidRequest("the Batch API is not enabled on this node")
    if store.damage is not None:
        raise StoreDamaged()
    return store


def _not_found(request: Request, what: str, ident: str) -> Response:
    return error_answer(request, NotFound(f"no {what} with id {ident[:100]!r}", param="id"))


async def upload_file(request: Request) -> Response:
    try:
        store = _store(request)
        try:
            form = await request.form(max_files=1, max_fields=8)
        except Exception as exc:  # a malformed or non-multipart body
            raise InvalidRequest(f"send the file as multipart/form-data: {exc}", param="file") from None
        try:
            purpose = form.get("purpose")
            upload = form.get("file")
            if purpose != "batch":
                raise InvalidRequest("purpose must be 'batch' (the only purpose served here)", param="purpose")
            if upload is None or isinstance(upload, str):
                raise InvalidRequest("the form has no 'file' part", param="file")
            data = await upload.read(MAX_FILE_BYTES + 1)
            if len(data) > MAX_FILE_BYTES:
                raise RequestTooLarge(f"a batch file holds at most {MAX_FILE_BYTES} bytes", param="file")
            filename = upload.filename or "upload.jsonl"
        finally:
            await form.close()
        return JSONResponse(await asyncio.to_thread(store.add_file, data, filename, "batch"))
    except ShmgateError as exc:
        return error_answer(request, exc)


MAX_FILES_PAGE = 10_000  # OpenAI's largest (and default) files.list page


async def list_files(request: Request) -> Response:
    """OpenAI's files.list: a page of files in ``order`` (``desc``, newest first, by default), starting
    after the file ``after`` names, with the page's ``first_id``/``last_id`` and whether more follow."""
    query = request.query_params
    try:
        store = _store(request)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be asc or desc", param="order")
        try:
            limit = int(query.get("limit", str(MAX_FILES_PAGE)))
        except ValueError:
            raise InvalidRequest("limit must be an integer", param="limit") from None
        if not 1 <= limit <= MAX_FILES_PAGE:
            raise InvalidRequest(f"limit must be between 1 and {MAX_FILES_PAGE}", param="limit")
        files = await asyncio.to_thread(store.files, query.get("purpose"))
        if order == "asc":
            files.reverse()
        after = query.get("after")
        if after is not None:
            ids = [f["id"] for f in files]
            if after not in ids:
                raise InvalidRequest(f"after names no file: {after[:64]!r}", param="after")
            files = files[ids.index(after) + 1 :]
    except ShmgateError as exc:
        return error_answer(request, exc)
    data = files[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(files) > limit,
        }
    )


async def get_file(file_id: str, request: Request) -> Response:
    try:
        store = _store(request)
    except ShmgateError as exc:
        return error_answer(request, exc)
    found = await asyncio.to_thread(store.file, file_id)
    return _not_found(request, "file", file_id) if found is None else JSONResponse(found)


async def delete_file(file_id: str, request: Request) -> Response:
    try:
        store = _store(request)
    except ShmgateError as exc:
        return error_answer(request, exc)
    if not await asyncio.to_thread(store.delete_file, file_id):
        return _not_found(request, "file", file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


async def file_content(file_id: str, request: Request) -> Response:
    try:
        store = _store(request)
    except ShmgateError as exc:
        return error_answer(request, exc)
    data = await asyncio.to_thread(store.read_file, file_id)
    if data is None:
        return _not_found(request, "file", file_id)
    return Response(data, media_type="application/octet-stream")


def validate_input(data: bytes, endpoint: str, max_line_bytes: int) -> dict[str, int]:
    """Check a batch input file whole; its lines counted by the model they name. Raises InvalidRequest
    naming the lines at fault."""
    if not data.strip():
        raise InvalidRequest("the input file is empty", param="input_file_id")
    problems: list[str] = []
    seen: set[str] = set()
    models: dict[str, int] = {}
    count = 0
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        count += 1
        problem = _line_problem(raw, endpoint, max_line_bytes, seen, models)
        if problem is not None:
            problems.append(f"line {number}: {problem}")
            if len(problems) >= 10:
                break
    if count > MAX_LINES:
        problems.insert(0, f"the file has {count} requests; a batch takes at most {MAX_LINES}")
    if problems:
        raise InvalidRequest("invalid batch input file: " + "; ".join(problems), param="input_file_id")
    return models


def _line_problem(raw: bytes, endpoint: str, max_line_bytes: int, seen: set[str], models: dict[str, int]) -> str | None:
    if len(raw) > max_line_bytes:
        return f"{len(raw)} bytes; a line holds at most {max_line_bytes}"
    try:
        line = json.loads(raw)
    except ValueError:
        return "not valid JSON"
    if not isinstance(line, dict):
        return "not a JSON object"
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "custom_id must be a non-empty string"
    if custom_id in seen:
        return f"custom_id {custom_id[:64]!r} is not unique"
    seen.add(custom_id)
    if line.get("method") != "POST":
        return "method must be 'POST'"
    if line.get("url") != endpoint:
        return f"url must be the batch's endpoint {endpoint!r}"
    body = line.get("body")
    if not isinstance(body, dict):
        return "body must be a JSON object"
    model = body.get("model")
    model = model[:200] if isinstance(model, str) else ""  # a line without one fails alone, when it runs
    models[model] = models.get(model, 0) + 1
    return None


async def create_batch(request: Request) -> Response:
    try:
        store = _store(request)
        try:
            body = json.loads(await read_body(request, 1 << 20))
        except ValueError:
            raise InvalidRequest("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise InvalidRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        window = body.get("completion_window")
        if window not in WINDOWS:
            raise InvalidRequest("completion_window must be '24h'", param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (
            isinstance(metadata, dict)
            and len(metadata) <= MAX_METADATA
            and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items()
            )
        ):
            raise InvalidRequest(
                "metadata must map at most 16 keys (64 characters) to strings (512 characters)", param="metadata"
            )
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or await asyncio.to_thread(store.file, file_id) is None:
            raise InvalidRequest(f"no uploaded file with id {str(file_id)[:100]!r}", param="input_file_id")
        data = await asyncio.to_thread(store.read_file, file_id)
        if data is None:
            raise InvalidRequest(f"the file {file_id!r} was deleted", param="input_file_id")
        models = await asyncio.to_thread(validate_input, data, endpoint, served(request).options.max_body_bytes)
        batch = await asyncio.to_thread(store.add_batch, endpoint, file_id, WINDOWS[window], metadata, models)
        return JSONResponse(batch)
    except ShmgateError as exc:
        return error_answer(request, exc)


async def list_batches(request: Request) -> Response:
    try:
        store = _store(request)
        try:
            limit = int(request.query_params.get("limit", "20"))
        except ValueError:
            raise InvalidRequest("limit must be an integer", param="limit") from None
        if not 1 <= limit <= 100:
            raise InvalidRequest("limit must be between 1 and 100", param="limit")
    except ShmgateError as exc:
        return error_answer(request, exc)
    data, more = await asyncio.to_thread(store.batches, request.query_params.get("after"), limit)
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
    )


async def get_batch(batch_id: str, request: Request) -> Response:
    try:
        store = _store(request)
    except ShmgateError as exc:
        return error_answer(request, exc)
    found = await asyncio.to_thread(store.batch, batch_id)
    return _not_found(request, "batch", batch_id) if found is None else JSONResponse(found)


async def cancel_batch(batch_id: str, request: Request) -> Response:
    try:
        store = _store(request)
    except ShmgateError as exc:
        return error_answer(request, exc)
    found = await asyncio.to_thread(store.batch, batch_id)
    if found is None:
        return _not_found(request, "batch", batch_id)
    if found["status"] in TERMINAL and found["status"] != "cancelled":
        return error_answer(request, Conflict(f"batch {batch_id!r} is {found['status']}; it cannot be cancelled"))
    await asyncio.to_thread(store.set_status, batch_id, "cancelling", only_from=("in_progress", "validating"))
    return JSONResponse(await asyncio.to_thread(store.batch, batch_id))
