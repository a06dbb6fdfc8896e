"""Reading gpud's YAML files (config, MIG layouts, sharing) strictly, with the line of any error.

The files are small and written by hand, so anything a hostile or broken file can use to make
reading slow or crash is refused, with its line: more than MAX_NODES values, written out or
through aliases (an alias bomb: a few anchors expanding past MAX_NODES), nesting deeper than MAX_DEPTH, integers longer than MAX_INT_CHARS, `.nan` and `.inf`, a key given
twice, bytes that are not UTF-8, and files over MAX_FILE_BYTES.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import yaml

MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 64
# Nodes in the document once every alias is expanded: far above any real file (the shipped layouts
# file has about 600), far below what makes a traversal of the loaded document slow.
MAX_NODES = 100_000
# A 64-bit integer has 20 characters with its sign; every number gpud reads is far smaller.
MAX_INT_CHARS = 24

Fail = Callable[[str, "int | None"], Exception]  # (reason, line or None) -> the caller's error


class LimitExceeded(yaml.composer.ComposerError):
    """A document too large or too deep to read, valid YAML as it may be."""


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML would
    silently keep the last one, so a typo'd duplicate would pass unnoticed), and that the limits
    above are errors too."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._composed = 0  # nodes written out in the document so far (an alias composes none)
        self._expanded_sizes: dict[int, int] = {}  # id(node) -> its node count with aliases expanded

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        mark = self.peek_event().start_mark
        if self._depth >= MAX_DEPTH:
            raise LimitExceeded(None, None, f"nested more than {MAX_DEPTH} levels deep", mark)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        sizes = self._expanded_sizes
        size = sizes.get(id(node))
        if size is None:  # a new node (an alias returns one composed earlier, already counted)
            self._composed += 1
            if self._composed > MAX_NODES:  # refused as soon as it is known, not once all is composed
                raise LimitExceeded(None, None, f"more than {MAX_NODES} values: too large for a gpud file", mark)
            children = node.value if isinstance(node, yaml.SequenceNode) else \
                [child for pair in node.value for child in pair] if isinstance(node, yaml.MappingNode) else ()
            size = sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
        if size > MAX_NODES:  # fewer written out: aliases made up the rest
            raise LimitExceeded(None, None, f"aliases expand to more than {MAX_NODES} values (an alias bomb)", mark)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key_node.value!r} given twice", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        # Checked before converting: Python's int() is quadratic in the digits, and refuses over 4300.
        if len(node.value) > MAX_INT_CHARS:
            raise yaml.constructor.ConstructorError(
                None, None, f"integer of {len(node.value)} characters is too large", node.start_mark)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        value = super().construct_yaml_float(node)
        if not math.isfinite(value):
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value!r} is not a finite number", node.start_mark)
        return value


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)


def read_yaml_text(path: Path, fail: Fail, opener: Callable[[str, int], int] | None = None) -> str:
    """A YAML file's text. Raises fail(reason, line) when it is too large or not UTF-8; OSError
    (FileNotFoundError included) propagates, as callers treat a missing file differently. opener:
    open()'s, for a caller that checks what it opened (where a file in a directory leads)."""
    with open(path, "rb", opener=opener) as file:
        raw = file.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise fail(f"larger than {MAX_FILE_BYTES} bytes; not a gpud file", None)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise fail(f"not UTF-8 text: byte 0x{raw[error.start]:02x} at offset {error.start}", line) from None


def compose_yaml(text: str, fail: Fail) -> tuple[yaml.Node | None, Any]:
    """(the document's node tree, for line numbers; the document). On a YAML error raises fail(reason, line)."""
    try:
        loader = StrictLoader(text)  # reads the text at once: refuses control characters here
    except yaml.reader.ReaderError as error:
        line = text.count("\n", 0, error.position) + 1
        raise fail(f"invalid YAML: character #x{error.character:04x} is not allowed in YAML", line) from None
    try:
        node = loader.get_single_node()
        return node, (loader.construct_document(node) if node is not None else None)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        what = error.problem if isinstance(error, LimitExceeded) else f"invalid YAML: {error.problem or error.context}"
        raise fail(what, mark.line + 1 if mark else None) from None
    except yaml.YAMLError as error:
        raise fail(f"invalid YAML: {error}", None) from None
    finally:
        loader.dispose()


def load_yaml(text: str, fail: Fail) -> Any:
    """The document in text. On a YAML error raises fail(reason, line or None)."""
    return compose_yaml(text, fail)[1]


def at_line(source: str, line: int | None, reason: str) -> str:
    return f"{source}: line {line}: {reason}" if line else f"{source}: {reason}"
