"""The one error type that carries an HTTP answer: a domain refusal says its status, slug and details
where it is raised, and the API answers it as it is (home-assistant supervisor's rule)."""

from __future__ import annotations

from typing import Any


class GpudError(Exception):
    """A refusal with the HTTP status that fits, a slug (`code`), a sentence and JSON-able details."""

    def __init__(self, status: int, code: str, message: str, **details: Any):
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, details
