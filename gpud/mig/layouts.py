"""MIG layout files: NVIDIA mig-parted's `version: v1` config format.

A file names layouts (`mig-configs`); each layout is a list of entries, and each entry says, for
the GPUs it selects (by index and/or PCI id), whether MIG is on and which MIG devices to have.
What mig-parted accepts, gpud accepts, and what it refuses, gpud refuses (NVIDIA/mig-parted
api/spec/v1/spec.go: an unknown key is an error; helpers.go: a malformed device-filter silently
matches nothing). What mig-parted accepts but can never do what its writer meant comes back as a
warning instead (check_layouts): a device-filter that never matches, negative or repeated GPU
indices, profiles no GPU gpud knows offers, well-formed profile names no GPU can offer (`0g.5gb`,
`2c.1g.5gb`: mig-parted checks a name's form only; applying such a layout is refused). One exception stays: a key given twice in one
mapping is an error (YAML loaders silently keep the last one).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from gpud.base.errors import ErrorKind, GpudError
from gpud.base.logs import get_logger
from gpud.base.yamlfile import at_line as _at_line
from gpud.base.yamlfile import load_yaml, read_yaml_text
from gpud.model.mig import MigCapabilities
from gpud.model.mig_profile_names import MigProfileName, read_layout_profile
from gpud.nvml import mig_tables

FORMAT_VERSION = "v1"
_TOP_LEVEL_KEYS = ("version", "mig-configs")
_ENTRY_KEYS = ("devices", "device-filter", "mig-enabled", "mig-devices")
# PCI device id plus vendor id, optionally followed by the subsystem device id plus subsystem vendor id.
_DEVICE_FILTER = re.compile(r"0x[0-9a-f]{8}(?::0x[0-9a-f]{8})?")
# mig-parted enumerates NVIDIA's PCI devices only (NVIDIA/mig-parted cmd/nvidia-mig-parted/assert/assert.go)
_NVIDIA_VENDOR = "10de"
_REPO_LAYOUTS = Path(__file__).parents[2] / "etc/gpud/mig-layouts.yaml"

log = get_logger("mig")


class LayoutError(ValueError):
    """A layout file, or a layout applied to a GPU, that gpud will not act on; the message says where."""


class NodeGpu(NamedTuple):
    """What a layout's entries select a GPU by."""

    index: int
    pci_device_id: str  # "0x233010DE"
    mig_capable: bool


@dataclass(frozen=True)
class LayoutEntry:
    devices: tuple[int, ...] | None  # None = all (MIG-capable) GPUs
    # empty = any GPU. Well-formed filters are normalised ("0x20b010de" or "0x20b010de:0x145f10de");
    # a malformed one is kept as written and never matches, as in mig-parted.
    device_filter: tuple[str, ...]
    mig_enabled: bool
    mig_devices: dict[str, int]  # canonical profile name -> count, no zero counts

    def matches(self, index: int, pci_device_id: str, pci_subsystem_id: str | None = None) -> bool:
        if self.devices is not None and index not in self.devices:
            return False
        return not self.device_filter or any(
            _filter_matches(pci_filter, pci_device_id, pci_subsystem_id) for pci_filter in self.device_filter)

    def selects(self, gpu: NodeGpu, pci_subsystem_id: str | None = None) -> bool:
        """Whether this entry applies to the GPU: `devices: all` means all MIG-capable GPUs
        (mig-parted since v0.4.0: NVIDIA/mig-parted CHANGELOG.md)."""
        return self.matches(gpu.index, gpu.pci_device_id, pci_subsystem_id) and \
            (self.devices is not None or gpu.mig_capable)

    def describe(self) -> str:
        devices = "devices all (MIG-capable GPUs)" if self.devices is None else \
            f"devices [{', '.join(map(str, self.devices))}]"
        return devices + (f", device-filter {', '.join(self.device_filter)}" if self.device_filter else "")


def _filter_matches(pci_filter: str, pci_device_id: str, pci_subsystem_id: str | None) -> bool:
    if not _DEVICE_FILTER.fullmatch(pci_filter):
        return False  # mig-parted parses it to nothing that equals a GPU's id (api/spec/v1/helpers.go)
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
        gpu = NodeGpu(index, pci_device_id, mig_capable)
        for number, entry in enumerate(self.entries, start=1):
            if not entry.selects(gpu, pci_subsystem_id):
                continue
            if not mig_capable and entry.mig_enabled:
                raise LayoutError(f"layout {self.name!r}, entry {number}: mig-enabled is true "
                                  f"but GPU {index} is not MIG-capable")
            chosen = entry
        return chosen

    def selected(self, gpus: list[NodeGpu]) -> list[NodeGpu]:
        """The GPUs this layout decides the MIG state of; the others it leaves alone."""
        return [gpu for gpu in gpus if any(entry.selects(gpu) for entry in self.entries)]

    def no_match_reason(self, gpus: list[NodeGpu]) -> str | None:
        """Why the layout selects no GPU of this node, or None when it selects one."""
        if self.selected(gpus):
            return None
        node = ", ".join(f"GPU {g.index} ({g.pci_device_id.lower()}{'' if g.mig_capable else ', not MIG-capable'})"
                         for g in gpus) or "no GPU at all"
        entries = "; ".join(f"entry {number} ({entry.describe()})" for number, entry in enumerate(self.entries, 1))
        return f"matches no GPU of this node: {entries} selects none of {node}"


def offers(capabilities: MigCapabilities, profile: str) -> bool:
    """Whether a GPU with this profile table can hold a MIG device of the (canonical) profile."""
    try:
        name = MigProfileName.parse(profile)
    except ValueError:
        return False  # a well-formed but impossible name (read_layout_profile): no GPU offers it
    return any(gi.name == name.gi_name and any(ci.slices == name.ci_slices for ci in gi.ci_profiles)
               for gi in capabilities.gi_profiles)


def parse_layouts(text: str, source: str = "<layouts>") -> dict[str, Layout]:
    """The layouts of a v1 file's text, in file order; `source` names the file in errors."""
    return check_layouts(text, source)[0]


def check_layouts(text: str, source: str = "<layouts>") -> tuple[dict[str, Layout], list[str]]:
    """(the layouts, the warnings: what mig-parted accepts that cannot do what was meant, each
    starting with its key path). Raises LayoutError for what mig-parted refuses too."""
    return _read_layouts(text, source, model_checks=True)


def _read_layouts(text: str, source: str, model_checks: bool) -> tuple[dict[str, Layout], list[str]]:
    document = load_yaml(text, lambda reason, line: LayoutError(_at_line(source, line, reason)))
    where = _Where(source, model_checks=model_checks)
    layouts = _build_layouts(document, where)
    return layouts, [f"{key}: {message}" for key, message in where.warnings]


def load_layouts(path: Path) -> dict[str, Layout]:
    return check_layouts_file(path)[0]


def check_layouts_file(path: Path) -> tuple[dict[str, Layout], list[str]]:
    """check_layouts for a file; LayoutError when it cannot be read."""
    try:
        text = read_yaml_text(Path(path), lambda reason, line: LayoutError(_at_line(str(path), line, reason)))
    except OSError as error:
        raise LayoutError(f"{path}: cannot read the file: {error}") from None
    return check_layouts(text, str(path))


def default_layouts() -> dict[str, Layout]:
    """The layouts shipped with gpud (NVIDIA's default mig-parted config): package data when
    installed, else the repository's copy."""
    return _default_layouts()[0]


@functools.cache
def _default_layouts() -> tuple[dict[str, Layout], list[str]]:
    packaged = importlib.resources.files("gpud.mig") / "data" / "mig-layouts.yaml"
    path = packaged if packaged.is_file() else _REPO_LAYOUTS
    # Its PCI ids are what gpud knows (_known_pci_ids): checking them against themselves would recurse.
    return _read_layouts(path.read_text(encoding="utf-8"), str(path), model_checks=False)


@functools.cache
def _known_pci_ids() -> frozenset[int]:
    """The PCI device+vendor ids of the MIG-capable GPUs gpud knows: those it ships profile tables
    for, and those NVIDIA's default mig-parted config (gpud's shipped layouts) names."""
    named = {int(f.partition(":")[0], 16) for layout in default_layouts().values()
             for entry in layout.entries for f in entry.device_filter if _DEVICE_FILTER.fullmatch(f)}
    return frozenset(named | {pci_id for table in mig_tables.shipped_tables() for pci_id in table.pci_device_ids})


class LayoutUnavailable(GpudError):
    """A layout that cannot be looked up: the layouts file is invalid, or names no such layout."""


class LayoutsFile:
    """The operator's layouts file when there is one, else the layouts shipped with gpud; parsed
    again only when the file changes (its inode, size or modification time). The file's warnings
    are logged each time it is parsed."""

    def __init__(self, path: Path):
        self.path = path
        self._read: tuple[tuple[int, int, int] | None, str, dict[str, Layout] | LayoutError, list[str]] | None = None

    def layouts(self) -> tuple[str, dict[str, Layout]]:
        """(where they come from: the file's path or "builtin", the layouts by name)."""
        _, source, layouts, _ = self._current()
        return source, layouts

    def warnings(self) -> list[str]:
        """The warnings of the file as last parsed (the shipped layouts have none)."""
        return list(self._current()[3])

    def layout(self, name: str) -> Layout:
        source, layouts = self.layouts()
        return layout_named(layouts, name, source)

    def _current(self) -> tuple[Any, str, dict[str, Layout], list[str]]:
        try:
            stat = os.stat(self.path)
            version = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        except (FileNotFoundError, NotADirectoryError):
            version = None
        if self._read is None or self._read[0] != version:
            self._read = (version, *self._parse(version))
        version, source, layouts, warnings = self._read
        if isinstance(layouts, LayoutError):
            raise LayoutUnavailable(ErrorKind.REFUSED, "layouts-file-invalid", str(layouts))
        return version, source, layouts, warnings

    def _parse(self, version: tuple[int, int, int] | None) -> tuple[str, dict[str, Layout] | LayoutError, list[str]]:
        if version is None:
            return "builtin", default_layouts(), []
        try:
            layouts, warnings = check_layouts_file(self.path)
        except LayoutError as exc:
            return str(self.path), exc, []
        for warning in warnings:
            key, _, message = warning.partition(": ")
            log.warning("mig_layouts_file_warning", path=str(self.path), key=key, warning=message)
        return str(self.path), layouts, warnings


def layout_named(layouts: dict[str, Layout], name: str, source: str) -> Layout:
    """The layout `name`, or the API's not-found answer naming where it was looked for."""
    if name not in layouts:
        raise LayoutUnavailable(ErrorKind.NOT_FOUND, "layout-not-found",
                                f"no layout '{name}' in {source}; known: {', '.join(layouts)}")
    return layouts[name]


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
    """A place in a layout file, for error messages, and the warnings found so far in the file."""

    source: str
    layout: str | None = None
    entry: int | None = None  # 1-based
    warnings: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (key path, message)
    model_checks: bool = True  # check PCI ids and profiles against the GPU models gpud knows

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

    def warn(self, message: str, key: str) -> None:
        """A warning at `key` of this entry, named by its key path: mig-configs.<layout>[<0-based entry>].<key>."""
        self.warnings.append((f"mig-configs.{self.layout}[{(self.entry or 1) - 1}].{key}", message))


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
        if key not in _ENTRY_KEYS:  # mig-parted: "unexpected field" (api/spec/v1/spec.go)
            raise where.error(f"unexpected key (allowed: {', '.join(_ENTRY_KEYS)})", key=str(key))
    devices = _devices(raw, where)
    mig_enabled = _mig_enabled(raw, where)
    entry = LayoutEntry(devices=devices, device_filter=_device_filter(raw, where),
                        mig_enabled=mig_enabled, mig_devices=_mig_devices(raw, mig_enabled, where))
    _warn_unknown_to_gpud(entry, where)
    return entry


def _devices(raw: dict, where: _Where) -> tuple[int, ...] | None:
    """`all` or a list of integers, as mig-parted reads it (a JSON []int: negative, repeated and no
    indices are accepted there; here they are accepted with a warning)."""
    if "devices" not in raw:
        raise where.error("missing; give 'all' or a list of GPU indices", key="devices")
    value = raw["devices"]
    if value == "all":
        return None
    if not isinstance(value, list):
        raise where.error(f"must be 'all' or a list of GPU indices, got {value!r}", key="devices")
    for index in value:
        if not _is_int(index):
            raise where.error(f"GPU index must be an integer, got {index!r}", key="devices")
    if not value:
        where.warn("an empty list selects no GPU", key="devices")
    for index in sorted({index for index in value if index < 0}):
        where.warn(f"index {index} is negative: it selects no GPU", key="devices")
    for index, times in Counter(value).items():
        if times > 1:
            where.warn(f"index {index} is repeated", key="devices")
    return tuple(value)


def _mig_enabled(raw: dict, where: _Where) -> bool:
    if "mig-enabled" not in raw:
        raise where.error("missing; give true or false", key="mig-enabled")
    value = raw["mig-enabled"]
    if value is None:  # JSON null leaves Go's bool false: mig-parted reads it so
        where.warn("null is read as false", key="mig-enabled")
        return False
    if not isinstance(value, bool):
        raise where.error(f"must be true or false, got {value!r}", key="mig-enabled")
    return value


def _mig_devices(raw: dict, mig_enabled: bool, where: _Where) -> dict[str, int]:
    if "mig-devices" not in raw:
        if mig_enabled:
            raise where.error("missing; required when mig-enabled is true ({} for no MIG devices)", key="mig-devices")
        return {}
    value = raw["mig-devices"]
    if value is None:
        # mig-parted (api/spec/v1/spec.go MigConfigSpec.UnmarshalJSON): json.Unmarshal of null sets the
        # types.MigConfig map to nil, and a nil map under mig-enabled true is "missing required field
        # 'mig-devices' when 'mig-enabled' is true"; with mig-enabled false a nil map is no MIG devices.
        if mig_enabled:
            raise where.error("null counts as missing; required when mig-enabled is true "
                              "({} for no MIG devices)", key="mig-devices")
        where.warn("null is read as {} (no MIG devices)", key="mig-devices")
        return {}
    if not isinstance(value, dict):
        raise where.error(f"must be a mapping of MIG profile name to count, got {value!r}", key="mig-devices")
    if value and not mig_enabled:
        raise where.error("must be absent or empty when mig-enabled is false", key="mig-devices")
    counts: dict[str, int] = {}
    for written, count in value.items():
        key = f"mig-devices.{written}"
        try:
            profile, impossible = read_layout_profile(str(written))
        except ValueError as error:
            raise where.error(str(error), key=key) from None
        if impossible is not None:  # mig-parted loads it; applying it fails (read_layout_profile)
            where.warn(f"no GPU offers profile {profile}: {impossible}; applying this layout is refused", key=key)
        if not _is_int(count) or count < 0:
            raise where.error(f"count must be an integer >= 0, got {count!r}", key=key)
        if profile in counts:
            raise where.error(f"the same MIG profile as an earlier key ({profile})", key=key)
        counts[profile] = count
    if counts and not any(counts.values()):
        raise where.error("all counts are 0; give at least one count > 0, or {} for no MIG devices", key="mig-devices")
    return {profile: count for profile, count in counts.items() if count}


def _device_filter(raw: dict, where: _Where) -> tuple[str, ...]:
    """A PCI id string or a list of them (mig-parted: a JSON string or []string; "" or null is no
    filter). A string mig-parted cannot parse is kept, with a warning: it never matches."""
    value = raw.get("device-filter")
    written = [] if value in (None, "") else [value] if isinstance(value, str) else value
    if not isinstance(written, list):
        raise where.error(f"must be a PCI id or a list of PCI ids, got {value!r}", key="device-filter")
    filters = []
    for pci_filter in written:
        if not isinstance(pci_filter, str):
            raise where.error(f"{pci_filter!r} is not a PCI id string such as '0x20B010DE'", key="device-filter")
        normalised = _pci_filter(pci_filter)
        if normalised is None:
            where.warn(f"{pci_filter!r} is not a PCI id of the form 0xDDDDVVVV or 0xDDDDVVVV:0xSSSSssss "
                       "(device, vendor, then optionally subsystem device and vendor): it never matches",
                       key="device-filter")
        elif not normalised.startswith(_NVIDIA_VENDOR, 6):
            where.warn(f"{pci_filter!r} is read as {normalised}, whose vendor 0x{normalised[6:10]} is not NVIDIA's "
                       f"(0x{_NVIDIA_VENDOR}): it never matches", key="device-filter")
        elif normalised != pci_filter.lower():
            where.warn(f"{pci_filter!r} is read as {normalised}: each part is a number, "
                       "0xDDDDVVVV with 8 hex digits is meant", key="device-filter")
        filters.append(normalised or pci_filter)
    return tuple(filters)


def _pci_filter(text: str) -> str | None:
    """The filter normalised to "0xddddvvvv[:0xssssssss]", or None where mig-parted cannot parse it
    (pkg/types/device.go: each part through Go's strconv.ParseInt(s, 0, 32))."""
    parts = text.split(":")
    if len(parts) > 2:
        return None
    values = []
    for part in parts:
        try:
            value = int(part, 0) if part == part.strip() else -1
        except ValueError:
            return None
        if not 0 <= value <= 0x7FFFFFFF:
            return None
        values.append(f"0x{value:08x}")
    return ":".join(values)


def _warn_unknown_to_gpud(entry: LayoutEntry, where: _Where) -> None:
    """Offline checks against the GPU models gpud ships profile tables for: a MIG layout for a PCI id
    none of them has, and profiles none of the GPUs the entry can apply to offers."""
    if not entry.mig_enabled or not where.model_checks:
        return  # a filter for a GPU without MIG (a display GPU) is legitimate
    tables = mig_tables.shipped_tables()
    named = [f for f in entry.device_filter if _DEVICE_FILTER.fullmatch(f)]
    for pci_filter in named:
        if int(pci_filter.partition(":")[0], 16) not in _known_pci_ids() and pci_filter.startswith(_NVIDIA_VENDOR, 6):
            where.warn(f"{pci_filter} is the PCI id of no MIG-capable GPU gpud knows", key="device-filter")
    known = {f: [t for t in tables if int(f.partition(":")[0], 16) in t.pci_device_ids] for f in named}
    if named and all(known.values()):  # the entry is for GPUs gpud knows: their tables decide
        candidates, whom = [t for models in known.values() for t in models], "no GPU its device-filter names"
    else:
        candidates, whom = tables, "no GPU model gpud knows"
    for profile in entry.mig_devices:
        if read_layout_profile(profile)[1] is not None:
            continue  # impossible on any GPU: already warned about by _mig_devices
        if not any(offers(t.capabilities, profile) for t in candidates):
            where.warn(f"{whom} offers this profile", key=f"mig-devices.{profile}")


def _is_int(value: Any) -> bool:
    # YAML booleans load as Python bools, which are ints too; an index or a count must be a real integer.
    return isinstance(value, int) and not isinstance(value, bool)
