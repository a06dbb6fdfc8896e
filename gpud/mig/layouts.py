"""MIG layout files: NVIDIA mig-parted's `version: v1` config format, read strictly.

A file names layouts (`mig-configs`); each layout is a list of entries, and each entry says, for
the GPUs it selects (by index and/or PCI id), whether MIG is on and which MIG devices to have.
mig-parted's own files load unchanged. gpud is stricter in two places: a malformed
`device-filter` is an error (mig-parted lets it silently match nothing), and a key given twice in
one mapping is an error (YAML loaders silently keep the last one).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpud.errors import GpudError
from gpud.mig.profile_names import MigProfileName
from gpud.yamlfile import at_line as _at_line
from gpud.yamlfile import load_yaml, read_yaml_text

FORMAT_VERSION = "v1"
_TOP_LEVEL_KEYS = ("version", "mig-configs")
_ENTRY_KEYS = ("devices", "device-filter", "mig-enabled", "mig-devices")
# PCI device id plus vendor id, optionally followed by the subsystem device id plus subsystem vendor id.
_DEVICE_FILTER = re.compile(r"0x[0-9a-f]{8}(?::0x[0-9a-f]{8})?")
_REPO_LAYOUTS = Path(__file__).parents[2] / "etc/gpud/mig-layouts.yaml"


class LayoutError(ValueError):
    """A layout file, or a layout applied to a GPU, that gpud will not act on; the message says where."""


@dataclass(frozen=True)
class LayoutEntry:
    devices: tuple[int, ...] | None  # None = all (MIG-capable) GPUs
    device_filter: tuple[str, ...]  # empty = any GPU; lowercase "0x20b010de" or "0x20b010de:0x145f10de"
    mig_enabled: bool
    mig_devices: dict[str, int]  # canonical profile name -> count, no zero counts

    def matches(self, index: int, pci_device_id: str, pci_subsystem_id: str | None = None) -> bool:
        if self.devices is not None and index not in self.devices:
            return False
        return not self.device_filter or any(
            _filter_matches(pci_filter, pci_device_id, pci_subsystem_id) for pci_filter in self.device_filter)


def _filter_matches(pci_filter: str, pci_device_id: str, pci_subsystem_id: str | None) -> bool:
    device, _, subsystem = pci_filter.partition(":")
    if device != pci_device_id.lower():
        return False
    # A filter naming a subsystem cannot match a GPU whose subsystem is unknown.
    return not subsystem or (pci_subsystem_id is not None and subsystem == pci_subsystem_id.lower())


@dataclass(frozen=True)
class Layout:
    name: str
    entries: tuple[LayoutEntry, ...]

    def for_gpu(self, index: int, pci_device_id: str, mig_capable: bool,
                pci_subsystem_id: str | None = None) -> LayoutEntry | None:
        """The entry that decides this GPU's MIG state, or None when the layout leaves the GPU alone.

        mig-parted applies every matching entry in turn, and each one sets the GPU's whole state
        (MIG mode, then the complete set of MIG devices, recreated from scratch). Only the last
        one therefore shows in the end, so gpud applies just that one.
        """
        chosen = None
        for number, entry in enumerate(self.entries, start=1):
            if not entry.matches(index, pci_device_id, pci_subsystem_id):
                continue
            if not mig_capable:
                if entry.devices is None:  # `all` means all MIG-capable GPUs
                    continue
                if entry.mig_enabled:
                    raise LayoutError(f"layout {self.name!r}, entry {number}: mig-enabled is true "
                                      f"but GPU {index} is not MIG-capable")
            chosen = entry
        return chosen


def parse_layouts(text: str, source: str = "<layouts>") -> dict[str, Layout]:
    """The layouts of a v1 file's text, in file order; `source` names the file in errors."""
    document = load_yaml(text, lambda reason, line: LayoutError(_at_line(source, line, reason)))
    return _build_layouts(document, _Where(source))


def load_layouts(path: Path) -> dict[str, Layout]:
    try:
        text = read_yaml_text(Path(path), lambda reason, line: LayoutError(_at_line(str(path), line, reason)))
    except OSError as error:
        raise LayoutError(f"{path}: cannot read the file: {error}") from None
    return parse_layouts(text, str(path))


def default_layouts() -> dict[str, Layout]:
    """The layouts shipped with gpud: package data when installed, else the repository's copy."""
    packaged = importlib.resources.files("gpud.mig") / "data" / "mig-layouts.yaml"
    if packaged.is_file():
        return parse_layouts(packaged.read_text(encoding="utf-8"), str(packaged))
    return load_layouts(_REPO_LAYOUTS)


class LayoutUnavailable(GpudError):
    """A layout that cannot be looked up: the layouts file is invalid, or names no such layout."""


class LayoutsFile:
    """The operator's layouts file when there is one, else the layouts shipped with gpud; parsed
    again only when the file changes (its inode, size or modification time)."""

    def __init__(self, path: Path):
        self.path = path
        self._read: tuple[tuple[int, int, int] | None, str, dict[str, Layout] | LayoutError] | None = None

    def layouts(self) -> tuple[str, dict[str, Layout]]:
        """(where they come from: the file's path or "builtin", the layouts by name)."""
        try:
            stat = os.stat(self.path)
            version = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        except (FileNotFoundError, NotADirectoryError):
            version = None
        if self._read is None or self._read[0] != version:
            self._read = (version, *self._parse(version))
        _, source, layouts = self._read
        if isinstance(layouts, LayoutError):
            raise LayoutUnavailable(422, "layouts-file-invalid", str(layouts))
        return source, layouts

    def layout(self, name: str) -> Layout:
        source, layouts = self.layouts()
        if name not in layouts:
            raise LayoutUnavailable(404, "layout-not-found",
                                    f"no layout '{name}' in {source}; known: {', '.join(layouts)}")
        return layouts[name]

    def _parse(self, version: tuple[int, int, int] | None) -> tuple[str, dict[str, Layout] | LayoutError]:
        if version is None:
            return "builtin", default_layouts()
        try:
            return str(self.path), load_layouts(self.path)
        except LayoutError as exc:
            return str(self.path), exc


def export_layout(name: str, per_gpu: list[tuple[int, bool, dict[str, int]]]) -> str:
    """A v1 document with one layout `name` reproducing the given GPUs' (index, mig_enabled, counts).

    GPUs with the same settings share one entry. The document is validated like a loaded file,
    so what comes out always loads back.
    """
    repeated = [index for index, times in Counter(index for index, _, _ in per_gpu).items() if times > 1]
    if repeated:
        raise LayoutError(f"layout {name!r}: GPU {repeated[0]} given more than once")
    entries = [_exported_entry(devices, mig_enabled, counts)
               for devices, mig_enabled, counts in _same_settings(per_gpu)]
    document = {"version": FORMAT_VERSION, "mig-configs": {name: entries}}
    _build_layouts(document, _Where("<export>"))
    return yaml.safe_dump(document, sort_keys=False, default_flow_style=None)


def _same_settings(per_gpu: list[tuple[int, bool, dict[str, int]]]) -> list[tuple[list[int], bool, dict[str, int]]]:
    """(sorted GPU indices, mig_enabled, non-zero counts) per distinct setting, in order of first appearance."""
    groups: dict[tuple[bool, frozenset], tuple[list[int], bool, dict[str, int]]] = {}
    for index, mig_enabled, counts in per_gpu:
        nonzero = {profile: count for profile, count in counts.items() if count != 0}
        groups.setdefault((mig_enabled, frozenset(nonzero.items())), ([], mig_enabled, nonzero))[0].append(index)
    return [(sorted(devices), mig_enabled, counts) for devices, mig_enabled, counts in groups.values()]


def _exported_entry(devices: list[int], mig_enabled: bool, counts: dict[str, int]) -> dict[str, Any]:
    entry: dict[str, Any] = {"devices": devices, "mig-enabled": mig_enabled}
    if mig_enabled or counts:  # counts with MIG off are kept so that validation refuses them
        entry["mig-devices"] = counts
    return entry


# -- reading ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Where:
    """A place in a layout file, for error messages."""

    source: str
    layout: str | None = None
    entry: int | None = None  # 1-based

    def inside(self, **place: Any) -> _Where:
        return dataclasses.replace(self, **place)

    def error(self, message: str, key: str | None = None) -> LayoutError:
        parts = []
        if self.layout is not None:
            parts.append(f"layout {self.layout!r}")
        if self.entry is not None:
            parts.append(f"entry {self.entry}")
        if key is not None:
            parts.append(f"key {key!r}")
        place = ", ".join(parts)
        return LayoutError(f"{self.source}: {place}: {message}" if place else f"{self.source}: {message}")


def _build_layouts(document: Any, where: _Where) -> dict[str, Layout]:
    if not isinstance(document, dict):
        raise where.error("not a MIG layout file: expected a mapping with 'version' and 'mig-configs'")
    for key in document:
        if key not in _TOP_LEVEL_KEYS:
            raise where.error("not a MIG layout file: unexpected top-level key "
                              "(a layout file has only 'version' and 'mig-configs')", key=str(key))
    if "version" not in document:
        raise where.error(f"missing; a layout file starts with 'version: {FORMAT_VERSION}'", key="version")
    if document["version"] != FORMAT_VERSION:
        raise where.error(f"unknown version {document['version']!r}, expected {FORMAT_VERSION!r}", key="version")
    configs = document.get("mig-configs")
    if not isinstance(configs, dict) or not configs:
        raise where.error("must map at least one layout name to its entries", key="mig-configs")
    return {name: _build_layout(name, entries, where) for name, entries in configs.items()}


def _build_layout(name: Any, entries: Any, where: _Where) -> Layout:
    if not isinstance(name, str):
        raise where.error(f"layout name must be a string, got {name!r}", key="mig-configs")
    where = where.inside(layout=name)
    if not isinstance(entries, list) or not entries:
        raise where.error("must be a non-empty list of entries")
    return Layout(name, tuple(_build_entry(raw, where.inside(entry=number))
                              for number, raw in enumerate(entries, start=1)))


def _build_entry(raw: Any, where: _Where) -> LayoutEntry:
    if not isinstance(raw, dict):
        raise where.error(f"must be a mapping with 'devices' and 'mig-enabled', got {raw!r}")
    for key in raw:
        if key not in _ENTRY_KEYS:
            raise where.error(f"unexpected key (allowed: {', '.join(_ENTRY_KEYS)})", key=str(key))
    devices = _devices(raw, where)
    mig_enabled = _mig_enabled(raw, where)
    return LayoutEntry(devices=devices, device_filter=_device_filter(raw, where),
                       mig_enabled=mig_enabled, mig_devices=_mig_devices(raw, mig_enabled, where))


def _devices(raw: dict, where: _Where) -> tuple[int, ...] | None:
    if "devices" not in raw:
        raise where.error("missing; give 'all' or a list of GPU indices", key="devices")
    value = raw["devices"]
    if value == "all":
        return None
    if not isinstance(value, list) or not value:
        raise where.error(f"must be 'all' or a non-empty list of GPU indices, got {value!r}", key="devices")
    for index in value:
        if not _is_count(index):
            raise where.error(f"GPU index must be an integer >= 0, got {index!r}", key="devices")
        if value.count(index) > 1:
            raise where.error(f"GPU {index} listed more than once", key="devices")
    return tuple(value)


def _mig_enabled(raw: dict, where: _Where) -> bool:
    if "mig-enabled" not in raw:
        raise where.error("missing; give true or false", key="mig-enabled")
    value = raw["mig-enabled"]
    if not isinstance(value, bool):
        raise where.error(f"must be true or false, got {value!r}", key="mig-enabled")
    return value


def _mig_devices(raw: dict, mig_enabled: bool, where: _Where) -> dict[str, int]:
    if "mig-devices" not in raw:
        if mig_enabled:
            raise where.error("missing; required when mig-enabled is true ({} for no MIG devices)", key="mig-devices")
        return {}
    value = raw["mig-devices"]
    if not isinstance(value, dict):
        raise where.error(f"must be a mapping of MIG profile name to count, got {value!r}", key="mig-devices")
    if value and not mig_enabled:
        raise where.error("must be absent or empty when mig-enabled is false", key="mig-devices")
    counts: dict[str, int] = {}
    for written, count in value.items():
        key = f"mig-devices.{written}"
        try:
            profile = str(MigProfileName.parse(str(written)))
        except ValueError as error:
            raise where.error(str(error), key=key) from None
        if not _is_count(count):
            raise where.error(f"count must be an integer >= 0, got {count!r}", key=key)
        if profile in counts:
            raise where.error(f"the same MIG profile as an earlier key ({profile})", key=key)
        counts[profile] = count
    if counts and not any(counts.values()):
        raise where.error("all counts are 0; give at least one count > 0, or {} for no MIG devices", key="mig-devices")
    return {profile: count for profile, count in counts.items() if count}


def _device_filter(raw: dict, where: _Where) -> tuple[str, ...]:
    if "device-filter" not in raw:
        return ()
    value = raw["device-filter"]
    written = [value] if isinstance(value, str) else value
    if not isinstance(written, list):
        raise where.error(f"must be a PCI id or a list of PCI ids, got {value!r}", key="device-filter")
    normalised = []
    for pci_filter in written:
        if not isinstance(pci_filter, str) or not _DEVICE_FILTER.fullmatch(pci_filter.lower()):
            raise where.error(f"{pci_filter!r} is not a PCI id of the form 0xDDDDVVVV or 0xDDDDVVVV:0xSSSSssss "
                              "(device, vendor, then optionally subsystem device and vendor)", key="device-filter")
        normalised.append(pci_filter.lower())
    return tuple(normalised)


def _is_count(value: Any) -> bool:
    # YAML booleans load as Python bools, which are ints too; a count must be a real integer.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
