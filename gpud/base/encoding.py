"""The one compact JSON encoding of every body gpud serves or streams."""

from __future__ import annotations

import json
from typing import Any


def encode(document: Any) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()
