"""``GET /openapi.json``: an OpenAPI 3.1 document generated from the wire
models (pydantic) of every surface the server speaks.

Each surface describes its routes through the seam (``Surface.operations()``,
optional: see :class:`~sluiceway.surfaces.base.Documented`); a surface that
does not is listed with its paths and methods only. The document is built
once, when the routes are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from sluiceway import __version__
from sluiceway.surfaces.base import JSON_HEADERS, Call, Documented, Operation, Serving, Surface

REF = "#/components/schemas/{model}"

#: The server's own routes, described here (their bodies are plain JSON).
OWN: Mapping[str, tuple[str, str]] = {
    "/health": ("Liveness: 200 while the server can serve, else 503", "application/json"),
    "/ready": ("Readiness: 200 while new requests are welcome, else 503", "application/json"),
    "/metrics": ("Prometheus metrics", "text/plain"),
    "/version": ("The server's version", "application/json"),
    "/server_info": ("The server's configuration", "application/json"),
    "/model_info": ("The served model", "application/json"),
    "/v1/loads": ("The scheduler's load (SGLang's shape)", "application/json"),
}


#: A model with the way it is used: "validation" (a request) or "serialization".
Keyed = tuple[type[BaseModel], Literal["validation", "serialization"]]


def _keys(operation: Operation) -> list[Keyed]:
    keys: list[Keyed] = []
    if operation.request is not None:
        keys.append((operation.request, "validation"))
    for model in (operation.response, operation.event, operation.error):
        if model is not None:
            keys.append((model, "serialization"))
    return keys


def _models(operations: list[Operation]) -> tuple[dict[str, Any], dict[Keyed, Any]]:
    """Every model's schema, under components by name, and each model's
    reference. Pydantic names them: two surfaces' same-named models (each
    has an ``ErrorBody``) get names of their own."""
    keys = list(dict.fromkeys(key for operation in operations for key in _keys(operation)))
    if not keys:
        return {}, {}
    refs, schemas = models_json_schema(keys, ref_template=REF)
    defs: dict[str, Any] = schemas.get("$defs", {})
    return defs, {key: refs[key] for key in keys}


def _operation(operation: Operation, path: str, refs: Mapping[Keyed, Any]) -> dict[str, Any]:
    def _ref(model: type[BaseModel], mode: Literal["validation", "serialization"]) -> Any:
        return refs[(model, mode)]

    body: dict[str, Any] = {"summary": operation.summary}
    parameters = [
        {"name": part[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
        for part in path.split("/")
        if part.startswith("{") and part.endswith("}")
    ]
    if parameters:
        body["parameters"] = parameters
    if operation.request is not None:
        body["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(operation.request, "validation")}},
        }
    content: dict[str, Any] = {}
    if operation.response is not None:
        content["application/json"] = {"schema": _ref(operation.response, "serialization")}
    if operation.event is not None:
        # Each ``data:`` line of the stream is one such object (or ``[DONE]``).
        content["text/event-stream"] = {
            "schema": {"type": "string"},
            "x-event-schema": _ref(operation.event, "serialization"),
        }
    responses: dict[str, Any] = {"200": {"description": "Success", "content": content}}
    if operation.error is not None:
        error = {"application/json": {"schema": _ref(operation.error, "serialization")}}
        responses["4XX"] = {"description": "The client's error", "content": error}
        responses["5XX"] = {"description": "The server's error", "content": error}
    body["responses"] = responses
    return body


def _own_paths() -> dict[str, Any]:
    return {
        path: {
            "get": {
                "summary": summary,
                "responses": {
                    "200": {"description": "Success", "content": {kind: {}}},
                    "503": {"description": "Not now", "content": {kind: {}}},
                    "4XX": {"description": "The client's error"},
                },
            }
        }
        for path, (summary, kind) in OWN.items()
    }


def _surface_operations(surface: Surface) -> Mapping[str, Mapping[str, Operation]]:
    if isinstance(surface, Documented):
        return surface.operations()
    return {
        path: {method: Operation(summary=f"{surface.name}: {method} {path}") for method in methods}
        for path, methods in surface.routes().items()
    }


def document(speaks: tuple[Surface, ...]) -> bytes:
    """The OpenAPI document of the server speaking these surfaces."""
    routes = [
        (surface.name, path, method, operation)
        for surface in speaks
        for path, methods in _surface_operations(surface).items()
        for method, operation in methods.items()
    ]
    schemas, refs = _models([operation for *_, operation in routes])
    paths = _own_paths()
    for name, path, method, operation in routes:
        entry = paths.setdefault(path, {})
        entry[method.lower()] = _operation(operation, path, refs) | {"tags": [name]}
    spec = {
        "openapi": "3.1.0",
        "info": {"title": "sluiceway", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
    return json.dumps(spec).encode("utf-8")


async def serve(spec: bytes, serving: Serving, call: Call) -> None:
    await call.send_bytes(200, spec, JSON_HEADERS)
