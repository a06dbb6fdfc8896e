"""Reading gpud's YAML files (config, MIG layouts, sharing) strictly, with the line of any error."""

from __future__ import annotations

from typing import Any, Callable

import yaml


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML would
    silently keep the last one, so a typo'd duplicate would pass unnoticed)."""

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


def load_yaml(text: str, fail: Callable[[str, int | None], Exception]) -> Any:
    """The document in text. On a YAML error raises fail(reason, line or None)."""
    try:
        return yaml.load(text, Loader=StrictLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        raise fail(f"invalid YAML: {error.problem or error.context}", mark.line + 1 if mark else None) from None
    except yaml.YAMLError as error:
        raise fail(f"invalid YAML: {error}", None) from None


def at_line(source: str, line: int | None, reason: str) -> str:
    return f"{source}: line {line}: {reason}" if line else f"{source}: {reason}"
