"""The sharing config: NVIDIA k8s-device-plugin's config file (`version: v1`).

A file written for the plugin loads unchanged, and every file the plugin refuses is refused, with
the file and the key path in the message. Where the plugin is silently lenient, gpud accepts the
file too and says what it found (check_sharing): an unknown key anywhere (the plugin reads the file
with sigs.k8s.io/yaml's non-strict Unmarshal, api/config/v1/config.go, so it ignores them), an empty
or repeated `devices` list. Unlike the plugin, gpud honours `rename` and `devices`
(gpud.sharing.resources applies them), and it reads one key of its own, `sharing.timeSlicing.interval`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from gpud.base.yamlfile import at_line, load_yaml, read_yaml_text
from gpud.model.names import is_dns_subdomain

FORMAT_VERSION = "v1"
RESOURCE_PREFIX = "nvidia.com/"
MAX_RESOURCE_NAME_LENGTH = 63
SHARED_RENAME_SUFFIX = ".shared"
MIG_STRATEGIES = ("none", "single", "mixed")
TIME_SLICE_INTERVALS = ("default", "short", "medium", "long")
# The plugin's MPS replica cap for compute capability >= 7.5. Older GPUs allow only 16, which needs
# the GPUs to check: gpud.sharing.resources does.
MAX_MPS_REPLICAS = 48
# Warnings kept (GET /v1/sharing's list, and the log at each read): a file of thousands of unknown keys
# is valid, and each of its warnings was logged at every read and served in every document.
MAX_WARNINGS = 64

_TOP_LEVEL_KEYS = ("version", "flags", "resources", "sharing", "imex")
_REPLICATED_KEYS = ("renameByDefault", "failRequestsGreaterThanOne", "resources")
_SHARED_RESOURCE_KEYS = ("name", "rename", "devices", "replicas")

_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_GPU_INDEX = re.compile(r"[0-9]+")
_MIG_INDEX = re.compile(r"([0-9]+):([0-9]+)")
_DEVICE_UUID = re.compile(rf"GPU-{_UUID}|MIG-{_UUID}|MIG-GPU-{_UUID}/[0-9]+/[0-9]+")
# Go's time.ParseDuration syntax ("60s", "1h30m", "1.5m"), which the plugin uses for durations.
_GO_DURATION = re.compile(r"[-+]?(0|(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h))+)")
_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}


class SharingConfigError(ValueError):
    """A sharing file gpud will not use; the message names the file and the key."""


@dataclass(frozen=True)
class SharedResource:
    name: str  # full, e.g. "nvidia.com/gpu" or "nvidia.com/mig-1g.5gb"
    rename: str | None  # the full name the replicas are advertised under; None keeps `name`
    devices: str | int | tuple[str, ...]  # "all", the first N devices, or selectors (index, "<gpu>:<mig>", UUID)
    replicas: int


@dataclass(frozen=True)
class ReplicatedResources:
    rename_by_default: bool
    fail_requests_greater_than_one: bool
    resources: tuple[SharedResource, ...]


@dataclass(frozen=True)
class SharingConfig:
    mig_strategy: str = "none"
    time_slicing: ReplicatedResources | None = None
    mps: ReplicatedResources | None = None
    interval: str | None = None  # gpud's own key: the time-slice length, sharing.timeSlicing.interval
    # What check_sharing warned about, for GET /v1/sharing; not part of what the config means.
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def strategy(self) -> str:
        """The sharing in force, decided as the plugin does: MPS wins over time-slicing."""
        if _replicates(self.mps):
            return "mps"
        if _replicates(self.time_slicing):
            return "time-slicing"
        return "none"


def _replicates(sharing: ReplicatedResources | None) -> bool:
    return sharing is not None and any(resource.replicas > 1 for resource in sharing.resources)


def parse_sharing(text: str, source: str = "<sharing>") -> SharingConfig:
    """The config in a file's text; `source` names the file in errors."""
    return check_sharing(text, source)[0]


def check_sharing(text: str, source: str = "<sharing>") -> tuple[SharingConfig, list[str]]:
    """(the config, the warnings: what the plugin accepts silently that may not be what was meant,
    each starting with its key path; the first MAX_WARNINGS, then one saying how many more). Raises
    SharingConfigError for what the plugin refuses too."""
    document = load_yaml(text, lambda reason, line: SharingConfigError(at_line(source, line, reason)))
    warnings: list[str] = []
    try:
        config = _config(document, warnings)
    except _Invalid as invalid:
        raise SharingConfigError(f"{source}: {invalid}") from None
    if len(warnings) > MAX_WARNINGS:
        warnings[MAX_WARNINGS:] = [f"{len(warnings) - MAX_WARNINGS} more warnings not listed (at most "
                                   f"{MAX_WARNINGS} are)"]
    return replace(config, warnings=tuple(warnings)), warnings


def load_sharing(path: Path) -> SharingConfig:
    """The config in a file. FileNotFoundError propagates: the caller treats a missing file as no sharing."""
    return check_sharing_file(path)[0]


def check_sharing_file(path: Path, opener: Callable[[str, int], int] | None = None) -> tuple[SharingConfig, list[str]]:
    """check_sharing for a file; FileNotFoundError propagates as from load_sharing. opener: open()'s,
    which may refuse what it opened with an OSError (read_yaml_text)."""
    try:
        text = read_yaml_text(Path(path), lambda reason, line: SharingConfigError(at_line(str(path), line, reason)),
                              opener)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise SharingConfigError(f"{path}: cannot read the file: {error}") from None
    return check_sharing(text, str(path))


# -- errors and value checks -----------------------------------------------------------------------


class _Invalid(Exception):
    """A bad value at a key path; parse_sharing adds the file's name."""

    def __init__(self, path: str, message: str):
        super().__init__(f"key '{path}': {message}" if path else message)


def _fail(path: str, message: str) -> NoReturn:
    raise _Invalid(path, message)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return _KINDS[type(value)]
    return f"{_KINDS.get(type(value), type(value).__name__)} {value!r}"


def _is_int(value: Any) -> bool:
    # YAML booleans load as Python bools, which are ints too.
    return isinstance(value, int) and not isinstance(value, bool)


def _mapping(value: Any, path: str) -> dict:
    if value is None:  # a key with nothing under it: an empty section
        return {}
    if not isinstance(value, dict):
        _fail(path, f"must be a mapping, got {_kind(value)}")
    return value


def _list(value: Any, path: str) -> list:
    if not isinstance(value, list):
        _fail(path, f"must be a list, got {_kind(value)}")
    return value


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        _fail(path, f"must be true or false, got {_kind(value)}")
    return value


def _int(value: Any, path: str) -> int:
    if not _is_int(value):
        _fail(path, f"must be an integer, got {_kind(value)}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        _fail(path, f"must be a string, got {_kind(value)}")
    return value


def _known_keys(mapping: dict, known: Any, path: str, warnings: list[str]) -> None:
    for key in mapping:
        if key not in known:
            warnings.append(f"{_join(path, key)}: unknown key, ignored as the device plugin ignores it "
                            f"(known here: {', '.join(known)})")


def _required(mapping: dict, key: str, path: str, message: str) -> Any:
    if key not in mapping:
        _fail(_join(path, key), message)
    return mapping[key]


# -- keys gpud accepts without acting on them ------------------------------------------------------

Check = Callable[[Any, str], Any]  # returns the value, or raises _Invalid naming the path
Schema = dict[str, Any]  # key -> a Check, or a nested Schema


def _checked(value: Any, schema: Schema, path: str, warnings: list[str]) -> dict:
    """A mapping whose values for the keys in `schema` pass their checks (or nested schemas); other
    keys are warned about. A null value counts as unset, as it does for the plugin's optional flags."""
    mapping = _mapping(value, path)
    _known_keys(mapping, schema, path, warnings)
    for key, item in mapping.items():
        if item is None or key not in schema:
            continue
        check = schema[key]
        if isinstance(check, dict):
            _checked(item, check, _join(path, key), warnings)
        else:
            check(item, _join(path, key))
    return mapping


def _choice(*allowed: str) -> Check:
    def check(value: Any, path: str) -> str:
        if _str(value, path) not in allowed:
            _fail(path, f"must be one of {', '.join(allowed)}, got {value!r}")
        return value
    return check


def _list_of(check: Check) -> Check:
    def check_items(value: Any, path: str) -> list:
        return [check(item, f"{path}[{i}]") for i, item in enumerate(_list(value, path))]
    return check_items


def _one_or_list_of(check: Check) -> Check:
    def check_either(value: Any, path: str) -> Any:
        return _list_of(check)(value, path) if isinstance(value, list) else check(value, path)
    return check_either


def _duration(value: Any, path: str) -> Any:
    # The plugin reads a duration as a Go duration string or a number of nanoseconds; GFD also takes "infinite".
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and (value == "infinite" or _GO_DURATION.fullmatch(value)):
        return value
    _fail(path, f"must be a duration such as '60s' or 'infinite', got {_kind(value)}")


def _resource_pattern(value: Any, path: str) -> dict:
    entry = _checked(value, {"pattern": _str, "name": _resource_name}, path, [])  # the section is warned about whole
    for key in ("pattern", "name"):
        if entry.get(key) is None:
            _fail(_join(path, key), "missing; each resource has a 'pattern' and a 'name'")
    return entry


_FLAGS: Schema = {
    "migStrategy": _choice(*MIG_STRATEGIES),
    "failOnInitError": _bool,
    "mpsRoot": _str,
    "nvidiaDriverRoot": _str,
    "nvidiaDevRoot": _str,
    "gdrcopyEnabled": _bool,
    "gdsEnabled": _bool,
    "mofedEnabled": _bool,
    "useNodeFeatureAPI": _bool,
    "deviceDiscoveryStrategy": _choice("auto", "nvml", "tegra"),
    "plugin": {
        "passDeviceSpecs": _bool,
        "deviceListStrategy": _one_or_list_of(_choice("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")),
        "deviceIDStrategy": _choice("uuid", "index"),
        "cdiAnnotationPrefix": _str,
        "nvidiaCTKPath": _str,
        "containerDriverRoot": _str,
        "sharedDevicesAllocationPolicy": _choice("distributed", "packed"),
    },
    "gfd": {
        "oneshot": _bool,
        "noTimestamp": _bool,
        "sleepInterval": _duration,
        "outputFile": _str,
        "machineTypeFile": _str,
    },
}
# Top-level `resources` renames full GPUs and MIG devices by pattern; the plugin drops it, and so does gpud.
_RESOURCE_PATTERNS: Schema = {"gpus": _list_of(_resource_pattern), "mig": _list_of(_resource_pattern)}
_IMEX: Schema = {"channelIDs": _list_of(_int), "required": _bool}


# -- the document ----------------------------------------------------------------------------------


def _config(document: Any, warnings: list[str]) -> SharingConfig:
    if document is None:  # an empty file: the plugin's defaults, no sharing
        return SharingConfig()
    if not isinstance(document, dict):
        _fail("", f"expected a mapping of {', '.join(_TOP_LEVEL_KEYS)}, got {_kind(document)}")
    _known_keys(document, _TOP_LEVEL_KEYS, "", warnings)
    _check_version(document.get("version"))
    flags = _checked(document.get("flags"), _FLAGS, "flags", warnings)
    patterns = _checked(document.get("resources"), _RESOURCE_PATTERNS, "resources", warnings)
    if patterns.get("gpus") or patterns.get("mig"):  # the plugin logs that it ignores them (config.go)
        warnings.append("resources: renaming by pattern is ignored, as the device plugin ignores it")
    _checked(document.get("imex"), _IMEX, "imex", warnings)
    mig_strategy = flags.get("migStrategy") or "none"  # unset or null: the plugin's default
    return _sharing(document.get("sharing"), mig_strategy, warnings)


def _check_version(value: Any) -> None:
    if value in (None, ""):  # the plugin reads an empty version as v1
        return
    if value != FORMAT_VERSION:
        _fail("version", f"unknown version {value!r}, expected {FORMAT_VERSION!r}")


def _sharing(value: Any, mig_strategy: str, warnings: list[str]) -> SharingConfig:
    section = _mapping(value, "sharing")
    _known_keys(section, ("timeSlicing", "mps"), "sharing", warnings)
    time_slicing = mps = interval = None
    if "timeSlicing" in section:
        time_slicing = _replicated(section["timeSlicing"], "sharing.timeSlicing", warnings, fail_default=False,
                                   extra_keys=("interval",))
        interval = _interval(section["timeSlicing"])
    if "mps" in section:
        mps = _replicated(section["mps"], "sharing.mps", warnings, fail_default=True)
        _check_mps(mps, mig_strategy)
    return SharingConfig(mig_strategy=mig_strategy, time_slicing=time_slicing, mps=mps, interval=interval)


def _interval(time_slicing: dict | None) -> str | None:
    value = (time_slicing or {}).get("interval")
    return None if value is None else _choice(*TIME_SLICE_INTERVALS)(value, "sharing.timeSlicing.interval")


def _check_mps(mps: ReplicatedResources, mig_strategy: str) -> None:
    if mig_strategy == "mixed":
        _fail("flags.migStrategy", "migStrategy mixed is not supported with MPS (sharing.mps)")
    for i, resource in enumerate(mps.resources):
        if resource.replicas > MAX_MPS_REPLICAS:
            _fail(f"sharing.mps.resources[{i}].replicas",
                  f"at most {MAX_MPS_REPLICAS} MPS replicas per device, got {resource.replicas}")


def _replicated(value: Any, path: str, warnings: list[str], fail_default: bool,
                extra_keys: tuple[str, ...] = ()) -> ReplicatedResources:
    section = _mapping(value, path)
    _known_keys(section, _REPLICATED_KEYS + extra_keys, path, warnings)
    rename_by_default = _bool(section.get("renameByDefault", False), f"{path}.renameByDefault")
    fail = _bool(section.get("failRequestsGreaterThanOne", fail_default), f"{path}.failRequestsGreaterThanOne")
    entries = section.get("resources")
    if entries is None or entries == []:
        _fail(f"{path}.resources", "no resources specified")
    resources = tuple(_shared_resource(entry, f"{path}.resources[{i}]", rename_by_default, warnings)
                      for i, entry in enumerate(_list(entries, f"{path}.resources")))
    return ReplicatedResources(rename_by_default=rename_by_default, fail_requests_greater_than_one=fail,
                               resources=resources)


def _shared_resource(value: Any, path: str, rename_by_default: bool, warnings: list[str]) -> SharedResource:
    entry = _mapping(value, path)
    _known_keys(entry, _SHARED_RESOURCE_KEYS, path, warnings)
    name = _resource_name(_required(entry, "name", path, "no resource name specified"), f"{path}.name")
    replicas = _int(_required(entry, "replicas", path, "no replicas specified"), f"{path}.replicas")
    if replicas < 2:
        _fail(f"{path}.replicas", f"number of replicas must be >= 2, got {replicas}")
    return SharedResource(name=name, rename=_rename(entry, name, path, rename_by_default),
                          devices=_devices(entry.get("devices", "all"), f"{path}.devices", warnings),
                          replicas=replicas)


def _rename(entry: dict, name: str, path: str, rename_by_default: bool) -> str | None:
    if "rename" in entry:
        return _resource_name(entry["rename"], f"{path}.rename")
    if rename_by_default:  # checked too: a long name plus ".shared" can pass the length limit
        return _resource_name(name + SHARED_RENAME_SUFFIX, f"{path}.name")
    return None


def _resource_name(value: Any, path: str) -> str:
    """The full name, "nvidia.com/" added when missing, checked as the plugin checks it."""
    written = _str(value, path)
    full = written if written.startswith(RESOURCE_PREFIX) else RESOURCE_PREFIX + written
    if len(full) > MAX_RESOURCE_NAME_LENGTH:
        _fail(path, f"fully-qualified resource name must be {MAX_RESOURCE_NAME_LENGTH} characters or less: {full}")
    name = full[len(RESOURCE_PREFIX):]
    if not is_dns_subdomain(name):
        _fail(path, f"incorrect format for resource name {full!r}: the part after '/' must be a DNS subdomain "
                    "(lowercase letters, digits, '-' and '.', starting and ending with a letter or digit)")
    return full


def _devices(value: Any, path: str, warnings: list[str]) -> str | int | tuple[str, ...]:
    if isinstance(value, str):
        if value != "all":
            _fail(path, f"devices set as {value!r} but the only valid string is 'all'")
        return value
    if _is_int(value):
        if value <= 0:
            _fail(path, f"a count of devices must be > 0, got {value}")
        return value
    if isinstance(value, list):  # the plugin accepts an empty list (api/config/v1/replicas.go)
        if not value:
            warnings.append(f"{path}: an empty list shares no device (list at least one, or use 'all')")
        selectors = tuple(_selector(item, f"{path}[{i}]") for i, item in enumerate(value))
        # counted once (a count per selector made a long list quadratic: 20,000 indices took 5 s)
        warnings += [f"{path}: device {selector} is repeated"
                     for selector, times in Counter(selectors).items() if times > 1]
        return selectors
    _fail(path, f"must be 'all', a count of devices or a list of devices, got {_kind(value)}")


def _selector(item: Any, path: str) -> str:
    """A device reference as a string: GPU and MIG indices lose leading zeros, UUIDs stay as written."""
    if _is_int(item) and item >= 0:
        return str(item)
    if isinstance(item, str):
        if _GPU_INDEX.fullmatch(item):
            return str(int(item))
        if match := _MIG_INDEX.fullmatch(item):
            return f"{int(match[1])}:{int(match[2])}"
        if _DEVICE_UUID.fullmatch(item):
            return item
    _fail(path, f"{item!r} is not a GPU index, a MIG index '<gpu>:<mig>', a GPU UUID (GPU-<uuid>) "
                "or a MIG UUID (MIG-<uuid> or MIG-GPU-<uuid>/<gi>/<ci>)")
