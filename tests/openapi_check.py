"""Checks API responses against the OpenAPI document gpud ships."""

from __future__ import annotations

import functools

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from gpud.api.server import load_openapi

_ROOT = "urn:gpud-openapi"


@functools.cache
def _registry() -> tuple[dict, Registry]:
    document = load_openapi()
    resource = Resource.from_contents(document, default_specification=DRAFT202012)
    return document, Registry().with_resource(_ROOT, resource)


def _pointer(*parts: str) -> str:
    return "/".join(p.replace("~", "~0").replace("/", "~1") for p in parts)


def assert_matches_openapi(method: str, route: str, status: int, body) -> None:
    """Validates body against the schema the document gives for (route, method, status)."""
    document, registry = _registry()
    operation = document["paths"][route][method.lower()]
    assert str(status) in operation["responses"], f"{method} {route} does not document status {status}"
    response = operation["responses"][str(status)]
    if "$ref" in response:
        ref = f"{_ROOT}#{response['$ref'][1:]}/content/application~1json/schema"
    else:
        ref = f"{_ROOT}#/{_pointer('paths', route, method.lower(), 'responses', str(status))}" \
              "/content/application~1json/schema"
    validator = Draft202012Validator({"$ref": ref}, registry=registry)
    errors = sorted(validator.iter_errors(body), key=lambda e: e.path)
    assert not errors, f"{method} {route} {status} does not match the OpenAPI document: " + \
        "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])
