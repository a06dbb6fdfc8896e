"""JSON read from a child or a peer, with its nesting bounded.

Python's json parser counts nesting against the interpreter's recursion limit: a document nested
some thousands deep raises RecursionError, an error no caller expects, and one within that limit
but still deep breaks whatever walks, encodes or logs it recursively later. Every JSON gpud reads
from a program it runs (dcgmi, nvidia-ctk), a peer (the API server, the kubelet, gpud's own socket)
or a request body goes through `loads`, which turns both into one ValueError that says what was
read.
"""
from __future__ import annotations

import json

TYPE_CHECKING = False  # typing costs a command's start-up more than this whole module: annotations only
if TYPE_CHECKING:
    from typing import Any, Callable

# Deeper than any document gpud reads (a Kubernetes object nests about 12 levels, dcgmi's diag
# answer 6) and shallow enough to walk recursively from any stack gpud has.
MAX_DEPTH = 64


class JsonTooDeep(ValueError):
    """A JSON document nesting lists or objects deeper than allowed."""


def loads(raw: str | bytes, *, what: str, max_depth: int = MAX_DEPTH,
          parse_constant: Callable[[str], Any] | None = None,
          parse_float: Callable[[str], Any] | None = None) -> Any:
    """The document in raw, or ValueError naming `what` when it is not JSON or nests deeper than
    max_depth (JsonTooDeep)."""
    try:
        document = json.loads(raw, parse_constant=parse_constant, parse_float=parse_float)
    except RecursionError:  # the C parser's depth guard
        raise JsonTooDeep(f"{what} nests lists or objects more than {max_depth} deep") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except ValueError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    # Only a document with more brackets than the bound can exceed it: others are not walked.
    if _brackets(raw) > max_depth and nesting_exceeds(document, max_depth):
        raise JsonTooDeep(f"{what} nests lists or objects more than {max_depth} deep")
    return document


def _brackets(raw: str | bytes) -> int:
    if isinstance(raw, bytes):
        return raw.count(b"[") + raw.count(b"{")
    return raw.count("[") + raw.count("{")


def nesting_exceeds(value: Any, levels: int) -> bool:
    """Whether lists and objects nest more than `levels` deep in value, walked without recursion."""
    pending = [(value, levels)]
    while pending:
        item, left = pending.pop()
        if not isinstance(item, (list, dict)):
            continue
        if left == 0:
            return True
        children = item.values() if isinstance(item, dict) else item
        pending.extend((child, left - 1) for child in children if isinstance(child, (list, dict)))
    return False
