"""The XID catalog: what each XID means, how bad it is and what fixes it, kept as data in xids.yaml.

gpud's config can change which XIDs count: it may replace the list of application XIDs, ignore
XIDs entirely, or force XIDs to make a device unhealthy (as the device plugin's
DP_ENABLE_HEALTHCHECKS does, a forced XID counts even if it is also listed as ignored).
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpud.base.yamlfile import at_line, load_yaml
from gpud.health.states import Action
from gpud.model.named import Named


class Severity(Named):
    FATAL = "fatal"
    CRITICAL = "critical"
    WARNING = "warning"
    INFO = "info"


SEVERITIES = tuple(Severity)
ACTIONS = tuple(action for action in Action if action is not Action.FIX_SERVICE)  # a node reason's, no XID's
UNKNOWN_NAME = "unknown XID"
_REQUIRED_FIELDS = {"name", "severity", "action"}
_FIELDS = _REQUIRED_FIELDS | {"application"}


class CatalogError(ValueError):
    """An XID catalog file gpud cannot use; the message says where."""


@dataclass(frozen=True)
class XidEntry:
    """One XID as xids.yaml describes it."""

    xid: int
    name: str
    severity: str  # a Severity
    action: str  # one of ACTIONS
    application: bool  # normally caused by an application, not the GPU


@dataclass(frozen=True)
class XidInfo(XidEntry):
    """One XID as this node counts it: its entry with the config's overrides applied."""

    affects_health: bool  # makes a device degraded or unhealthy


XidTable = dict[int, XidEntry]


class XidCatalog:
    def __init__(self, application_xids: frozenset[int] | None = None, ignored_xids: frozenset[int] = frozenset(),
                 unhealthy_xids: frozenset[int] = frozenset(), *, table: XidTable | None = None):
        self._table = shipped_table() if table is None else table
        self._application = (frozenset(xid for xid, info in self._table.items() if info.application)
                             if application_xids is None else application_xids)
        self._ignored = ignored_xids
        self._forced = unhealthy_xids

    def info(self, xid: int) -> XidInfo:
        """What the XID is and whether it counts, with the config's overrides applied: all that a
        reported XID needs, in one lookup."""
        known = self._table.get(xid) or XidEntry(xid, UNKNOWN_NAME, Severity.CRITICAL, Action.RESET_GPU,
                                                 application=False)
        forced, application = xid in self._forced, xid in self._application
        severity = known.severity
        if forced and severity in (Severity.WARNING, Severity.INFO):
            severity = Severity.CRITICAL  # forced XIDs make the device unhealthy, not merely degraded
        affects_health = forced or (xid not in self._ignored and not application and known.severity != Severity.INFO)
        return XidInfo(xid, known.name, severity, known.action, application, affects_health)


def load_catalog(application_xids: Iterable[int] | None = None, ignored_xids: Iterable[int] = (),
                 unhealthy_xids: Iterable[int] = ()) -> XidCatalog:
    """The shipped catalog with the config's XID lists applied."""
    return XidCatalog(None if application_xids is None else frozenset(application_xids), frozenset(ignored_xids),
                      frozenset(unhealthy_xids))


@functools.cache
def shipped_table() -> XidTable:
    """xids.yaml as shipped in the package, read once."""
    resource = importlib.resources.files("gpud.health") / "xids.yaml"
    return parse_catalog(resource.read_text(encoding="utf-8"), str(resource))


def parse_catalog(text: str, source: str) -> XidTable:
    document = load_yaml(text, lambda reason, line: CatalogError(at_line(source, line, reason)))
    if not isinstance(document, dict) or set(document) != {"xids"} or not isinstance(document["xids"], dict):
        raise CatalogError(f"{source}: expected a mapping with the single key 'xids'")
    singles: XidTable = {}
    ranged: XidTable = {}
    for key, fields in document["xids"].items():
        where = f"{source}: XID {key}"
        first, last = _xid_span(key, where)
        entry = _entry(fields, where)
        target = singles if first == last else ranged
        for xid in range(first, last + 1):
            if xid in target:
                raise CatalogError(f"{where}: XID {xid} is already listed")
            target[xid] = XidEntry(xid, **entry)
    return dict(sorted((ranged | singles).items()))  # a single XID refines the range it falls in


def _xid_span(key: Any, where: str) -> tuple[int, int]:
    """An XID key as (first, last): 79 -> (79, 79), "144-150" -> (144, 150)."""
    if isinstance(key, int) and not isinstance(key, bool) and key > 0:
        return key, key
    first, dash, last = str(key).partition("-")
    if dash and first.isdigit() and last.isdigit() and 0 < int(first) < int(last):
        return int(first), int(last)
    raise CatalogError(f"{where}: a key must be an XID or a range 'first-last'")


def _entry(fields: Any, where: str) -> dict[str, Any]:
    if not isinstance(fields, dict) or not _REQUIRED_FIELDS <= set(fields) <= _FIELDS:
        raise CatalogError(f"{where}: expected the fields name, severity, action and optionally application")
    if not isinstance(fields["name"], str) or not fields["name"]:
        raise CatalogError(f"{where}: name must be a non-empty string")
    if fields["severity"] not in SEVERITIES:
        raise CatalogError(f"{where}: severity must be one of {', '.join(SEVERITIES)}")
    if fields["action"] not in ACTIONS:
        raise CatalogError(f"{where}: action must be one of {', '.join(ACTIONS)}")
    if not isinstance(fields.get("application", False), bool):
        raise CatalogError(f"{where}: application must be true or false")
    return {"application": False, **fields}
