"""The OpenAPI description of the request bodies. The handlers read their bodies raw
(bounded, cluster/api/request_body.py) and validate them with these models themselves, so
FastAPI would describe them as taking no body; `describe_bodies` puts each model's JSON
schema into the served `/openapi.json`, for clients, generators and API fuzzers."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def body_of(model: type[BaseModel]) -> dict:
    """The route's `openapi_extra`: a required JSON body of `model`."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def describe_bodies(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make `app.openapi()` carry `models` (and the models they use) as components."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                described = model.model_json_schema(ref_template=_REF)
                components.update(described.pop("$defs", {}))
                components[model.__name__] = described
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
