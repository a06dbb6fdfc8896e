"""NVIDIA's opaque device configs (`resource.nvidia.com/v1beta1` GpuConfig and MigDeviceConfig), decoded as
strictly as NVIDIA's driver decodes them (api/nvidia.com/resource/v1beta1: its strict decoder refuses an
unknown field; gpuconfig.go, migconfig.go, sharing.go Validate), and which config applies to which
request (cmd/gpu-kubelet-plugin/device_state.go GetOpaqueDeviceConfigs: only this driver's, a claim's over
its class's, a later one over an earlier one; no requests listed means every request)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpud.base import bounded_json
from gpud.base.quantity import parse_quantity

API_VERSION = "resource.nvidia.com/v1beta1"
GPU_CONFIG, MIG_CONFIG = "GpuConfig", "MigDeviceConfig"
TIME_SLICING, MPS = "TimeSlicing", "MPS"
INTERVALS = ("Default", "Short", "Medium", "Long")  # sharing.go TimeSliceInterval


class ConfigError(Exception):
    """A config the claim cannot be prepared with: what is wrong, naming the field."""


@dataclass(frozen=True)
class Sharing:
    strategy: str  # TIME_SLICING | MPS
    interval: str | None = None  # TimeSlicing
    mps: dict | None = None  # MPS: defaultActiveThreadPercentage, defaultPinnedDeviceMemoryLimit, ...


@dataclass(frozen=True)
class DeviceConfig:
    kind: str  # GPU_CONFIG | MIG_CONFIG
    sharing: Sharing | None = None


def _fields(document: Any, where: str, allowed: set[str]) -> dict:
    if not isinstance(document, dict):
        raise ConfigError(f"{where}: an object was expected, not {type(document).__name__}")
    unknown = sorted(set(document) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(allowed))})")
    return document


def _mps(document: Any, where: str) -> dict:
    mps = _fields(document, where, {"defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit",
                                    "defaultPerDevicePinnedMemoryLimit"})
    percentage = mps.get("defaultActiveThreadPercentage")
    if percentage is not None and (isinstance(percentage, bool) or not isinstance(percentage, int)
                                   or not 0 <= percentage <= 100):
        raise ConfigError(f"{where}.defaultActiveThreadPercentage: an integer from 0 to 100, not {percentage!r}")
    limits = {"defaultPinnedDeviceMemoryLimit": mps.get("defaultPinnedDeviceMemoryLimit"),
              **{f"defaultPerDevicePinnedMemoryLimit[{k}]": v
                 for k, v in (mps.get("defaultPerDevicePinnedMemoryLimit") or {}).items()}}
    if not isinstance(mps.get("defaultPerDevicePinnedMemoryLimit") or {}, dict):
        raise ConfigError(f"{where}.defaultPerDevicePinnedMemoryLimit: a map of device to quantity")
    for name, value in limits.items():
        if value is not None and not _is_quantity(value):
            raise ConfigError(f"{where}.{name}: not a quantity: {value!r}")
    return dict(mps)


def _is_quantity(value: Any) -> bool:
    try:
        parse_quantity(value)
    except ValueError:
        return False
    return True


def _sharing(document: Any, where: str, kind: str) -> Sharing:
    allowed = {"strategy", "mpsConfig"} | ({"timeSlicingConfig"} if kind == GPU_CONFIG else set())
    sharing = _fields(document, where, allowed)
    strategy = sharing.get("strategy")
    if strategy not in (TIME_SLICING, MPS):
        raise ConfigError(f"{where}.strategy: {strategy!r} is not {TIME_SLICING!r} or {MPS!r}")
    if strategy == TIME_SLICING:
        if sharing.get("mpsConfig") is not None:
            raise ConfigError(f"{where}: cannot use mpsConfig with the {TIME_SLICING!r} strategy")
        config = _fields(sharing.get("timeSlicingConfig") or {}, f"{where}.timeSlicingConfig", {"interval"})
        interval = config.get("interval")
        if interval is not None and interval not in INTERVALS:
            raise ConfigError(f"{where}.timeSlicingConfig.interval: {interval!r} is not one of {', '.join(INTERVALS)}")
        return Sharing(TIME_SLICING, interval=interval)
    if sharing.get("timeSlicingConfig") is not None:
        raise ConfigError(f"{where}: cannot use timeSlicingConfig with the {MPS!r} strategy")
    return Sharing(MPS, mps=_mps(sharing.get("mpsConfig") or {}, f"{where}.mpsConfig"))


def parse(parameters: Any) -> DeviceConfig:
    """One opaque config's parameters (raw JSON, as the API server stores them)."""
    if isinstance(parameters, (bytes, str)):
        try:
            parameters = bounded_json.loads(parameters, what="parameters")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    document = _fields(parameters, "parameters", {"apiVersion", "kind", "sharing"})
    if document.get("apiVersion") != API_VERSION:
        raise ConfigError(f"parameters.apiVersion: {document.get('apiVersion')!r} is not {API_VERSION!r}")
    kind = document.get("kind")
    if kind not in (GPU_CONFIG, MIG_CONFIG):
        raise ConfigError(f"parameters.kind: {kind!r} is not {GPU_CONFIG!r} or {MIG_CONFIG!r} "
                          "(VfioDeviceConfig is NVIDIA's alone: gpud hands out no VFIO devices)")
    sharing = document.get("sharing")
    return DeviceConfig(kind, None if sharing is None else _sharing(sharing, "parameters.sharing", kind))


def configs_by_request(allocation_configs: list[dict], driver: str) -> list[tuple[tuple[str, ...], DeviceConfig]]:
    """This driver's configs of status.allocation.devices.config, parsed, in the order they apply: class
    configs first, then the claim's, each list in its own order (the last that names a request wins)."""
    ordered = [c for c in allocation_configs if c.get("source") == "FromClass"] + \
              [c for c in allocation_configs if c.get("source") != "FromClass"]
    found = []
    for index, entry in enumerate(ordered):
        opaque = entry.get("opaque") or {}
        if opaque.get("driver") != driver:
            continue
        try:
            config = parse(opaque.get("parameters"))
        except ConfigError as exc:
            raise ConfigError(f"config {index} ({entry.get('source')}): {exc}") from None
        found.append((tuple(entry.get("requests") or ()), config))
    return found


def config_for(request: str, configs: list[tuple[tuple[str, ...], DeviceConfig]]) -> DeviceConfig | None:
    """The config that applies to a result's request (`<request>/<subrequest>` also matches `<request>`)."""
    chosen = None
    parent = request.split("/", 1)[0]
    for requests, config in configs:
        if not requests or request in requests or parent in requests:
            chosen = config
    return chosen
