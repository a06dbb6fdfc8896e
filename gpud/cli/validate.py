"""`gpud mig validate` and `gpud sharing validate`: a file checked here, without the daemon.

The file may be the Kubernetes ConfigMap that carries such files (deploy/kubernetes/sharing-configs.yaml;
the GPU operator's default-mig-parted-config, whose data key config.yaml mig-manager mounts as its file):
each of its data entries is checked as one file. Any other Kubernetes object is refused, saying what it is.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpud.cli.output import EXIT_OK, EXIT_USAGE, CliError, print_json, warn

TYPE_CHECKING = False  # annotations only: typing is imported where used
if TYPE_CHECKING:
    from typing import Any


def validate_file(args: argparse.Namespace, check, check_text, error_type: type, facts, summary, what: str) -> int:
    """`gpud … validate FILE [--strict]`: exit 0 with a summary (warnings on stderr), or 2 with the
    error; with --strict, warnings are errors. check(path) and check_text(text, source) give (what was
    loaded, warnings) or raise error_type; what: "a sharing config", for messages."""
    path = args.path
    found = _kubernetes_object(path)
    if found is not None:
        return _validate_object(args, *found, check_text, error_type, facts, summary, what)
    try:
        loaded, warnings = check(path)
    except error_type as exc:
        raise CliError(EXIT_USAGE, "file-invalid", str(exc)) from None
    except OSError as exc:
        raise CliError(EXIT_USAGE, "file-unreadable", f"{path}: {exc.strerror or exc}") from None
    _refuse_warnings(args, warnings)
    if args.json:
        print_json({"path": str(path), "valid": True, **facts(loaded), "warnings": warnings})
        return EXIT_OK
    for text in warnings:
        warn(text)
    print(f"{path}: valid, {summary(loaded)}")
    return EXIT_OK


def _refuse_warnings(args: argparse.Namespace, warnings: list[str], **details: Any) -> None:
    if args.strict and warnings:
        count = f"{len(warnings)} warning{'s' if len(warnings) > 1 else ''}"
        raise CliError(EXIT_USAGE, "file-warnings", f"{args.path}: {count} (--strict)",
                       **(details or {"warnings": warnings}))


class _NotRead(Exception):
    """The file could not be read or parsed: the file's own check says why."""


def _kubernetes_object(path: Path) -> tuple[dict, Any] | None:
    """(the document, its YAML node) when the file holds a Kubernetes object (a mapping with a string
    apiVersion and kind, which neither file format has); else None, a file unread or not YAML included."""
    from gpud.base.yamlfile import compose_yaml, read_yaml_text

    def fail(reason: str, line: int | None) -> Exception:
        return _NotRead(reason)

    try:
        text = read_yaml_text(Path(path), fail)
    except (_NotRead, OSError):
        return None
    if "apiVersion" not in text or "kind" not in text:  # parsed once, by the check, as every other file is
        return None
    try:
        node, document = compose_yaml(text, fail)
    except _NotRead as exc:  # PyYAML's composer: "expected a single document ... but found another document"
        return _first_of_several(text) if "another document" in str(exc) else None
    return (document, node) if _is_kubernetes_object(document) else None


def _is_kubernetes_object(document: Any) -> bool:
    return isinstance(document, dict) and all(isinstance(document.get(key), str) for key in ("apiVersion", "kind"))


def _first_of_several(text: str) -> tuple[dict, Any] | None:
    """A manifest of several documents (kubectl apply -f's), as a List of them all without a YAML node;
    None when its first document is no Kubernetes object."""
    import yaml

    from gpud.base.yamlfile import StrictLoader

    try:
        documents = list(yaml.load_all(text, Loader=StrictLoader))
    except yaml.YAMLError:
        return None
    if len(documents) < 2 or not _is_kubernetes_object(documents[0]):
        return None
    return {"apiVersion": "v1", "kind": "List", "items": documents}, None


def _validate_object(args: argparse.Namespace, document: dict, node: Any, check_text, error_type: type, facts,
                     summary, what: str) -> int:
    path, kind, api_version = args.path, document["kind"], document["apiVersion"]
    metadata = document.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) and isinstance(metadata.get("name"), str) else None
    if (api_version, kind) != ("v1", "ConfigMap") or node is None:
        if node is None:  # several documents (_first_of_several)
            items = document["items"]
            described = f"a Kubernetes manifest of {len(items)} documents (the first a {items[0]['kind']})"
        else:
            described = f"a Kubernetes {kind} ({api_version})" + (f" named {name}" if name else "")
        raise CliError(EXIT_USAGE, "file-invalid", f"{path}: {described}, not {what} (a ConfigMap carrying {what} "
                                                   "under data is checked entry by entry)")
    data = document.get("data")
    if not isinstance(data, dict) or not data:
        raise CliError(EXIT_USAGE, "file-invalid", f"{path}: ConfigMap {name or '(no name)'} has no entries under "
                                                   f"data, so no {what} to check")
    entries = [_entry(path, key, value, _entry_offset(node, key), check_text, error_type, facts)
               for key, value in data.items()]
    invalid = [entry for entry in entries if not entry["valid"]]
    if not args.json:
        count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
        print(f"{path}: ConfigMap {name or '(no name)'}, {count}, each {what}")
        for entry in entries:
            print(f"  {entry['name']}: " + (f"valid, {summary(entry.pop('_loaded'))}" if entry["valid"] else "invalid"))
            for text in entry["warnings"]:
                warn(f"{entry['name']}: {text}")
    for entry in entries:
        entry.pop("_loaded", None)
    if invalid:
        details = {"entries": entries} if args.json else {"errors": [entry["error"] for entry in invalid]}
        raise CliError(EXIT_USAGE, "file-invalid", f"{path}: {len(invalid)} of {len(entries)} entries invalid",
                       **details)
    _refuse_warnings(args, [f"{entry['name']}: {text}" for entry in entries for text in entry["warnings"]],
                     **({"entries": entries} if args.json else {}))
    if args.json:
        print_json({"path": str(path), "valid": True, "kind": kind, "name": name, "entries": entries})
    return EXIT_OK


def _entry(path: Path, key: Any, value: Any, offset: int, check_text, error_type: type, facts) -> dict:
    """One data entry checked as a file: its report, with what was loaded under _loaded when valid."""
    source = f"{path} (ConfigMap entry {key})"
    entry = {"name": str(key), "valid": False, "warnings": [], "error": None}
    if not isinstance(value, str):
        entry["error"] = f"{source}: not text but {type(value).__name__}: a ConfigMap's data values are strings"
        return entry
    try:
        # blank lines before it: its YAML errors then name the file's lines
        loaded, warnings = check_text("\n" * offset + value, source)
    except error_type as exc:
        entry["error"] = str(exc)
        return entry
    entry.update(valid=True, warnings=warnings, _loaded=loaded, **facts(loaded))
    return entry


def _entry_offset(node: Any, key: Any) -> int:
    """Lines of the file before the entry's text: a block scalar (`name: |`) starts on the line after its
    key; any other value on the key's line."""
    import yaml

    for key_node, value_node in node.value:
        if key_node.value == "data" and isinstance(value_node, yaml.MappingNode):
            for entry_key, entry_value in value_node.value:
                if entry_key.value == str(key):
                    return entry_value.start_mark.line + (1 if getattr(entry_value, "style", None) in ("|", ">") else 0)
    return 0
