"""The OpenAPI document served at ``GET /openapi.json``: what each route takes and every answer it gives.

FastAPI's generated document says nothing useful here, because the routes read the ``Request``
themselves (one msgspec decode, no pydantic model per request). So the document is built from the
msgspec types the routes really decode with (``msgspec.json.schema_components``), and every error
status a route can answer with is listed with the one OpenAI error object (gateway/http_errors.py).
A fuzzer (tests/test_fuzz.py, schemathesis) checks the server against it: a status not
listed, or a body not matching its schema, is a failure.

``GET /docs`` shows the same document as an interactive page (``docs_page``).

The statuses, and where they come from:
    400  invalid input (gateway/intake.py), an unparsable HTTP request (gateway/http_limits.py)
    401  a missing or wrong API key (``--api-key``)
    404  an unknown model or route
    405  a known route with another method
    413  a body, an image or its pixels over their caps
    415  a body not sent as ``application/json`` (gateway/guards.py)
    421  a ``Host`` header not in ``--allowed-hosts`` (gateway/guards.py)
    429  ``--max-in-flight`` reached
    431  a request head over 1 MiB (gateway/http_limits.py)
    500  a model error, or a bug (the catch-all in gateway/guards.py names a request id)
    502  the worker died with the request
    503  overloaded (arena, queues), no worker, draining (``/ready``: ``{"status": "not ready", ...}`` saying
         which models it waits for)
    504  ``--request-timeout-s`` passed
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.responses import HTMLResponse

from shmgate.gateway.endpoints import ENDPOINTS, Endpoint
from shmgate.gateway.http_errors import MAX_MESSAGE_CHARS
from shmgate.gateway.tokenize import DetokenizeRequest, TokenizeRequest

__all__ = ["DOCUMENT_URL", "docs_page", "openapi_document"]

DOCUMENT_URL = "/openapi.json"  # where gateway/app.py serves openapi_document()
_REF = "#/components/schemas/{name}"
# Swagger UI's script and style, and a favicon from the same package, all from one CDN.
_SWAGGER_UI = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/"

# The API key (``--api-key``) as a bearer token: what /docs's "Authorize" sends. Optional ({}),
# because a server started without a key asks for none; the routes that never check it
# (/health, /ready, /docs) name no security at all.
_BEARER = {"type": "http", "scheme": "bearer", "description": "the server's --api-key, when it has one"}
_KEY_WHEN_SET: list[dict[str, list[str]]] = [{"apiKey": []}, {}]

# Statuses every route may answer with: the Host check, a head too large, a bug, a wrong method.
_ANY_ROUTE = (405, 421, 431, 500)
_POST_BODY = (400, 401, 404, 413, 415, 429, 502, 503, 504)

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "maxLength": MAX_MESSAGE_CHARS},  # capped (http_errors.py)
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        name: {"type": "integer", "minimum": 0} for name in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}
_CHAT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "chat.completion"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "message", "finish_reason"],
                "properties": {
                    "index": {"type": "integer", "minimum": 0},
                    "message": {
                        "type": "object",
                        "required": ["role", "content"],
                        "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
                    },
                    "finish_reason": {"enum": ["stop", "length"]},
                },
            },
        },
        "usage": {"$ref": _REF.format(name="Usage")},
    },
}
_EMBEDDINGS = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"const": "embedding"},
                    "index": {"type": "integer"},
                    "embedding": {"type": ["array", "string"], "items": {"type": "number"}},
                },
            },
        },
        "model": {"type": "string"},
        "usage": {"type": "object"},
    },
}
_OUTPUT_TEXT = {
    "type": "object",
    "required": ["type", "text", "annotations"],
    "properties": {
        "type": {"const": "output_text"},
        "text": {"type": "string"},
        "annotations": {"type": "array", "maxItems": 0},
        "logprobs": {"type": "array"},
    },
}
_RESPONSE = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output", "usage", "error", "incomplete_details"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "response"},
        "created_at": {"type": "integer"},
        "status": {"enum": ["completed", "incomplete"]},
        "error": {"type": "null"},
        "incomplete_details": {
            "type": ["object", "null"],
            "properties": {"reason": {"const": "max_output_tokens"}},
        },
        "model": {"type": "string"},
        "output": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "type", "status", "role", "content"],
                "properties": {
                    "id": {"type": "string"},
                    "type": {"const": "message"},
                    "status": {"enum": ["completed", "incomplete"]},
                    "role": {"const": "assistant"},
                    "content": {"type": "array", "items": _OUTPUT_TEXT},
                },
            },
        },
        "store": {"const": False},
        "usage": {
            "type": "object",
            "required": ["input_tokens", "output_tokens", "total_tokens"],
            "properties": {
                name: {"type": "integer", "minimum": 0} for name in ("input_tokens", "output_tokens", "total_tokens")
            },
        },
    },
}
# The model endpoints' answers, by the name their row in gateway/endpoints.py gives (``Endpoint.answer``).
_ANSWERS = {"ChatCompletion": _CHAT_COMPLETION, "Embeddings": _EMBEDDINGS, "Response": _RESPONSE}
_MODEL_STATES = ["loading", "ready", "failed", "draining"]  # gateway/app.py model_state
_MODEL_CARD = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by", "state", "endpoints", "capabilities"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer", "description": "when the node started serving it (Unix seconds)"},
        "owned_by": {"type": "string"},
        "state": {"enum": _MODEL_STATES},
        "endpoints": {
            "type": "array",
            "items": {"type": "string"},
            "description": "the model endpoints that serve it (POST)",
        },
        "capabilities": {
            "type": "object",
            "required": ["chat", "embeddings", "tokenize", "max_model_len"],
            "properties": {
                "chat": {"type": "boolean"},
                "embeddings": {"type": "boolean"},
                "tokenize": {"type": "boolean"},
                "max_model_len": {"type": ["integer", "null"]},
            },
        },
    },
}
_MODEL_READY = {
    "type": "object",
    "required": ["status", "model"],
    "properties": {
        "status": {"enum": ["ready", "not ready"]},
        "model": {"type": "string"},
        "state": {"enum": _MODEL_STATES},
    },
}
# A served model's id as a path parameter: ids may hold a slash (``org/name``).
_MODEL_PARAMETER = {
    "name": "model",
    "in": "path",
    "required": True,
    "description": "a served model's id (GET /v1/models lists them); it may hold a slash",
    "schema": {"type": "string", "minLength": 1},
}
_MODELS = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "items": _MODEL_CARD},
    },
}
_TOKENS = {
    "type": "object",
    "required": ["count", "tokens"],
    "properties": {"count": {"type": "integer"}, "tokens": {"type": "array", "items": {"type": "integer"}}},
}
_STATUS = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
_VERSION = {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}
_NOT_READY = {
    "type": "object",
    "required": ["status", "message", "waiting_for", "models"],
    "properties": {
        "status": {"const": "not ready"},
        "message": {"type": "string", "description": "what the node waits for, in one line"},
        "waiting_for": {
            "type": "array",
            "items": {"type": "string"},
            "description": "the models without a ready worker (empty while draining)",
        },
        "models": {"type": "object", "additionalProperties": {"enum": _MODEL_STATES}},
    },
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(statuses: tuple[int, ...]) -> dict[str, Any]:
    error = {"$ref": _REF.format(name="Error")}
    return {str(status): _json(error, "an OpenAI error object") for status in sorted(set(statuses))}


def _post(operation_id: str, request: str, ok: dict[str, Any], summary: str) -> dict[str, Any]:
    return {
        "post": {
            "operationId": operation_id,
            "summary": summary,
            "security": _KEY_WHEN_SET,
            "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": request}}}},
            "responses": {"200": ok, **_errors(_POST_BODY + _ANY_ROUTE)},
        }
    }


def _get(operation_id: str, ok: dict[str, Any], summary: str, *errors: int) -> dict[str, Any]:
    keyed = {"security": _KEY_WHEN_SET} if 401 in errors else {}
    return {
        "get": {
            "operationId": operation_id,
            "summary": summary,
            **keyed,
            "responses": {"200": ok, **_errors(errors + _ANY_ROUTE)},
        }
    }


def _ready() -> dict[str, Any]:
    """``/ready`` answers a probe, not a client: its 200 is ``{"status": "ready"}``; its 503 says which models
    it waits for, and each one's state."""
    path = _get("ready", _json(_STATUS, "every model has a worker serving it"), "readiness", 404)
    path["get"]["parameters"] = [
        {
            "name": "model",
            "in": "query",
            "required": False,
            "description": "one model's readiness instead (as /ready/{model})",
            "schema": {"type": "string"},
        }
    ]
    path["get"]["responses"]["503"] = _json(_NOT_READY, "a model has no worker serving it yet, or draining")
    return path


def _model_ready() -> dict[str, Any]:
    """``/ready/{model}``: one model's readiness, for a probe that gates that model's traffic; a model not
    served is the usual 404 error object."""
    path = _get("model_ready", _json(_MODEL_READY, "a worker serves this model"), "one model's readiness", 404)
    path["get"]["parameters"] = [_MODEL_PARAMETER]
    path["get"]["responses"]["503"] = _json(_MODEL_READY, "no worker serves this model yet, it failed, or draining")
    return path


def _model() -> dict[str, Any]:
    """``/v1/models/{model}``: one model's entry (``client.models.retrieve``)."""
    path = _get("model", _json(_MODEL_CARD, "the model, its state and capabilities"), "one served model", 401, 404)
    path["get"]["parameters"] = [_MODEL_PARAMETER]
    return path


def _answer(endpoint: Endpoint) -> dict[str, Any]:
    """A model endpoint's 200: its answer's schema, and server-sent events when it streams."""
    content: dict[str, Any] = {"application/json": {"schema": {"$ref": _REF.format(name=endpoint.answer)}}}
    if endpoint.streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {"description": endpoint.answer_description, "content": content}


# The Batch API (gateway/batch_routes.py, docs/BATCH.md): OpenAI's file and batch objects, the fields a
# client reads named and the rest left open (gateway/batch_store.py writes them).
_FILE = {
    "type": "object",
    "required": ["id", "object", "bytes", "filename", "purpose"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "file"},
        "bytes": {"type": "integer"},
        "filename": {"type": "string"},
        "purpose": {"type": "string"},
    },
}
_BATCH = {
    "type": "object",
    "required": ["id", "object", "endpoint", "status", "input_file_id"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "batch"},
        "endpoint": {"type": "string"},
        "status": {"type": "string"},
        "input_file_id": {"type": "string"},
        "request_counts": {"type": "object"},
    },
}
_BATCH_ERRORS = (400, 401, 404, 413, 415, 503)  # the Batch API off on this node: a 400 saying so


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": item}},
    }


def _batch_operation(
    operation_id: str,
    ok: dict[str, Any],
    summary: str,
    *,
    path_id: str = "",
    body: Any = None,
    errors: tuple[int, ...] = (),
) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": operation_id,
        "summary": summary,
        "security": _KEY_WHEN_SET,
        "responses": {"200": ok, **_errors(_BATCH_ERRORS + errors + _ANY_ROUTE)},
    }
    if path_id:
        operation["parameters"] = [{"name": path_id, "in": "path", "required": True, "schema": {"type": "string"}}]
    if body is not None:
        operation["requestBody"] = {"required": True, "content": body}
    return operation


def _batch_api() -> dict[str, Any]:
    """``/v1/files`` and ``/v1/batches``: the Batch API's routes, as OpenAI's client calls them."""
    upload = {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["purpose", "file"],
                "properties": {"purpose": {"const": "batch"}, "file": {"type": "string", "format": "binary"}},
            }
        }
    }
    create = {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["input_file_id", "endpoint", "completion_window"],
                "properties": {
                    "input_file_id": {"type": "string"},
                    "endpoint": {"enum": [endpoint.path for endpoint in ENDPOINTS]},  # gateway/endpoints.py
                    "completion_window": {"const": "24h"},
                    "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                },
            }
        }
    }
    file, batch = _json(_FILE, "the file object"), _json(_BATCH, "the batch object")
    content = {
        "description": "the file's bytes (JSONL)",
        "content": {"application/octet-stream": {"schema": {"type": "string"}}},
    }
    return {
        "/v1/files": {
            "post": _batch_operation(
                "upload_file", file, "upload a JSONL file of requests (purpose batch)", body=upload
            ),
            "get": _batch_operation("list_files", _json(_listed(_FILE), "the files"), "the uploaded and result files"),
        },
        "/v1/files/{file_id}": {
            "get": _batch_operation("file", file, "one file", path_id="file_id"),
            "delete": _batch_operation(
                "delete_file", _json({"type": "object"}, "deleted"), "delete a file", path_id="file_id"
            ),
        },
        "/v1/files/{file_id}/content": {
            "get": _batch_operation("file_content", content, "a file's content", path_id="file_id"),
        },
        "/v1/batches": {
            "post": _batch_operation("create_batch", batch, "run a batch of an uploaded file's requests", body=create),
            "get": _batch_operation("list_batches", _json(_listed(_BATCH), "the batches, newest first"), "the batches"),
        },
        "/v1/batches/{batch_id}": {"get": _batch_operation("batch", batch, "one batch", path_id="batch_id")},
        "/v1/batches/{batch_id}/cancel": {
            "post": _batch_operation(
                "cancel_batch", batch, "cancel a batch (a finished one: 409)", path_id="batch_id", errors=(409,)
            ),
        },
    }


def openapi_document() -> dict[str, Any]:
    """The whole document (OpenAPI 3.1: its schemas are JSON Schema, as msgspec writes them).

    The model endpoints' paths come from their table (gateway/endpoints.py); each one's answer schema
    is one of ``_ANSWERS``."""
    schemas, components = msgspec.json.schema_components(
        [*(endpoint.request_type for endpoint in ENDPOINTS), TokenizeRequest, DetokenizeRequest],
        ref_template=_REF,
    )
    *requests, tokenize, detokenize = schemas
    components |= {"Error": _ERROR, "Usage": _USAGE, **_ANSWERS}
    models = {
        endpoint.path: _post(endpoint.operation_id, schema["$ref"], _answer(endpoint), endpoint.summary)
        for endpoint, schema in zip(ENDPOINTS, requests, strict=True)
    }
    text = {"type": "string"}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "shmgate",
            "version": "1",
            "description": "An OpenAI-compatible gateway for vision models. Every error is an OpenAI error object.",
        },
        "paths": {
            **models,
            "/tokenize": _post(
                "tokenize",
                tokenize["$ref"],
                _json(_TOKENS, "the prompt's token ids"),
                "vLLM's tokenize: token ids of a chat request, images expanded",
            ),
            "/detokenize": _post(
                "detokenize", detokenize["$ref"], _json({"type": "object"}, "the text"), "vLLM's detokenize"
            ),
            "/v1/models": _get("models", _json(_MODELS, "the served models"), "the served models", 401),
            "/v1/models/{model}": _model(),
            "/health": _get("health", _json(_STATUS, "this process is up"), "liveness"),
            "/version": _get("version", _json(_VERSION, "the shmgate version serving"), "the version"),
            "/ready": _ready(),
            "/ready/{model}": _model_ready(),
            "/metrics": _get(
                "metrics",
                {
                    "description": "Prometheus text or OpenMetrics",
                    "content": {"text/plain": {"schema": text}, "application/openmetrics-text": {"schema": text}},
                },
                "Prometheus metrics of the whole node",
                401,
            ),
            "/docs": _get(
                "docs",
                {"description": "an HTML page", "content": {"text/html": {"schema": text}}},
                f"this document as an interactive page (Swagger UI reading {DOCUMENT_URL})",
            ),
            **_batch_api(),
        },
        "components": {"schemas": components, "securitySchemes": {"apiKey": _BEARER}},
    }


def docs_page() -> HTMLResponse:
    """``GET /docs``: Swagger UI for the document at ``/openapi.json``.

    The page is a few lines of HTML; its script and style load from a CDN (jsDelivr's
    swagger-ui-dist), so a browser without internet access shows an empty page, while the document
    itself is always served by us. It is open without the API key, as /openapi.json is: it holds
    nothing the document does not, and every call made from it ("Try it out") is an ordinary
    request that needs the key like any other.
    """
    return get_swagger_ui_html(
        openapi_url=DOCUMENT_URL,
        title="shmgate API",
        swagger_js_url=_SWAGGER_UI + "swagger-ui-bundle.js",
        swagger_css_url=_SWAGGER_UI + "swagger-ui.css",
        swagger_favicon_url=_SWAGGER_UI + "favicon-32x32.png",
    )
