"""GPU model catalogue: models.yaml turned into immutable, typed objects (loaded once)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import pynvml
import yaml

from .placement import Span


@dataclass(frozen=True)
class ComputeInstanceProfile:
    id: int  # the NVML_COMPUTE_INSTANCE_PROFILE_* constant; NVML reports it as info.id too
    # "1c.3g.20gb", or the GI profile name when the CI spans the whole GI (MIG user guide, "MIG Device Names")
    name: str
    slice_count: int
    multiprocessor_count: int
    spans: tuple[Span, ...]

    @property
    def instance_count(self) -> int:
        return len(self.spans)


@dataclass(frozen=True)
class GpuInstanceProfile:
    constant: int  # NVML_GPU_INSTANCE_PROFILE_*: only GetGpuInstanceProfileInfo takes this
    id: int  # info.id: every other call takes this
    name: str
    instance_count: int  # how many the driver lets exist at once
    reported_instance_count: int  # what GetGpuInstanceProfileInfo says: not always the same (A30)
    slice_count: int
    memory_mb: int
    multiprocessor_count: int
    copy_engines: int
    decoders: int
    encoders: int
    jpegs: int
    ofas: int
    spans: tuple[Span, ...]
    compute_profiles: tuple[ComputeInstanceProfile, ...]

    def compute_profile(self, profile_id: int) -> ComputeInstanceProfile | None:
        return next((p for p in self.compute_profiles if p.id == profile_id), None)


@dataclass(frozen=True)
class MemoryOverride:
    """From driver version `from_version` on, these GI profile ids report other memorySizeMB values."""

    from_version: tuple[int, ...]
    memory_mb: Mapping[int, int]  # GI profile id -> MiB


@dataclass(frozen=True)
class MigSpec:
    memory_slices: int
    needs_reset: bool  # Ampere: a new MIG mode stays pending until the GPU is reset
    gpu_instance_profiles: tuple[GpuInstanceProfile, ...]
    memory_by_driver: tuple[MemoryOverride, ...] = ()

    def memory_mb(self, profile: GpuInstanceProfile, driver_version: tuple[int, ...]) -> int:
        """memorySizeMB of a GI profile as this driver reports it (it changes by driver: models.yaml)."""
        memory = profile.memory_mb
        for override in self.memory_by_driver:  # ascending by from_version: the last applicable wins
            if driver_version >= override.from_version:
                memory = override.memory_mb.get(profile.id, memory)
        return memory

    def by_constant(self, constant: int) -> GpuInstanceProfile | None:
        return next((p for p in self.gpu_instance_profiles if p.constant == constant), None)

    def by_id(self, profile_id: int) -> GpuInstanceProfile | None:
        return next((p for p in self.gpu_instance_profiles if p.id == profile_id), None)

    @property
    def max_devices(self) -> int:
        """nvmlDeviceGetMaxMigDeviceCount with MIG on: as many as the smallest profile allows."""
        return max(p.instance_count for p in self.gpu_instance_profiles)


@dataclass(frozen=True)
class GpuModel:
    key: str
    name: str
    pci_device_id: int
    pci_subsystem_id: int
    memory_mib: int
    architecture: int  # NVML_DEVICE_ARCH_*
    brand: int  # NVML_BRAND_*
    compute_capability: tuple[int, int]
    multiprocessor_count: int
    ecc: bool
    has_serial: bool
    row_remapping: bool
    page_retirement: bool
    nvlinks: int
    nvlink_fabric: str | None  # "switch" or "bridge" (models.yaml); None without links
    nvlink_switches: int  # NVSwitch chips the links of a "switch" board are spread over
    event_types: int  # nvmlDeviceGetSupportedEventTypes on the newest driver branch
    reserved_mib: float  # memory the driver keeps for itself (not always whole MiB: H200 capture)
    idle_power_mw: int
    power_limit_mw: int
    idle_temperature_c: int
    temperature_thresholds: Mapping[int, int]  # NVML_TEMPERATURE_THRESHOLD_* -> degrees C
    mig: MigSpec | None


@dataclass(frozen=True)
class DriverBranch:
    """What NVML answers differently by driver branch (models.yaml `drivers.branches`)."""

    cuda_version: int
    nvml_major: int
    gpu_instance_profile_constants: int  # NVML_GPU_INSTANCE_PROFILE_* below this are known
    compute_instance_profile_constants: int
    profiles_with_mig_off: bool  # GI profile info / placements / capacity answer with MIG disabled
    instances_with_mig_off: bool  # nvmlDeviceGetGpuInstances answers (no instances) with MIG disabled
    event_types: int  # event type bits the branch knows


@dataclass(frozen=True)
class Catalog:
    default_driver: str
    branches: Mapping[int, DriverBranch]
    functions_added_in: Mapping[str, int]  # pynvml function -> first driver major that has it
    models: Mapping[str, GpuModel]
    fields_added_in: Mapping[int, int] = dataclasses.field(default_factory=dict)  # field id -> first major
    fabric_info_versions_added_in: Mapping[int, int] = dataclasses.field(default_factory=dict)


@functools.cache
def catalog() -> Catalog:
    text = resources.files(__package__).joinpath("models.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    ci_placements = data["compute_instance_placements"]
    models = {key: _model(key, spec, ci_placements) for key, spec in data["models"].items()}
    drivers = data["drivers"]
    return Catalog(
        default_driver=drivers["default"],
        branches={major: DriverBranch(**spec) for major, spec in drivers["branches"].items()},
        functions_added_in=dict(drivers["functions_added_in"]),
        models=models,
        fields_added_in={int(key): value for key, value in drivers.get("fields_added_in", {}).items()},
        fabric_info_versions_added_in={
            int(key): value for key, value in drivers.get("fabric_info_versions_added_in", {}).items()},
    )


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _model(key: str, spec: dict[str, Any], ci_placements: dict) -> GpuModel:
    temperatures = dict(spec["temperature_c"])
    idle_temperature = temperatures.pop("idle")
    return GpuModel(
        key=key,
        name=spec["name"],
        pci_device_id=spec["pci_device_id"],
        pci_subsystem_id=spec["pci_subsystem_id"],
        memory_mib=spec["memory_mib"],
        architecture=getattr(pynvml, "NVML_DEVICE_ARCH_" + spec["architecture"]),
        brand=getattr(pynvml, "NVML_BRAND_" + spec["brand"]),
        compute_capability=tuple(spec["compute_capability"]),
        multiprocessor_count=spec["sm_count"],
        ecc=spec["ecc"],
        has_serial=spec["serial"],
        row_remapping=spec["row_remapping"],
        page_retirement=spec["page_retirement"],
        nvlinks=spec["nvlink"]["links"],
        nvlink_fabric=spec["nvlink"].get("fabric"),
        nvlink_switches=spec["nvlink"].get("switches", 0),
        event_types=spec["event_types"],
        reserved_mib=spec["reserved_mib"],
        idle_power_mw=spec["power_mw"]["idle"],
        power_limit_mw=spec["power_mw"]["limit"],
        idle_temperature_c=idle_temperature,
        temperature_thresholds={
            getattr(pynvml, "NVML_TEMPERATURE_THRESHOLD_" + name.upper()): value
            for name, value in temperatures.items()
        },
        mig=_mig(spec["mig"], ci_placements) if "mig" in spec else None,
    )


def _mig(spec: dict[str, Any], ci_placements: dict) -> MigSpec:
    return MigSpec(
        memory_slices=spec["memory_slices"],
        needs_reset=spec["mode_change"] == "reset",
        gpu_instance_profiles=tuple(
            _gpu_instance_profile(row, ci_placements) for row in spec["gpu_instance_profiles"]
        ),
        memory_by_driver=tuple(
            MemoryOverride(version_tuple(row["from"]), dict(row["memory_mb"]))
            for row in sorted(spec.get("memory_by_driver", []), key=lambda row: version_tuple(row["from"]))
        ),
    )


def _gpu_instance_profile(row: dict[str, Any], ci_placements: dict) -> GpuInstanceProfile:
    constant = getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_" + row["constant"])
    return GpuInstanceProfile(
        constant=constant,
        id=row["id"],
        name=row["name"],
        instance_count=row["instances"],
        reported_instance_count=row.get("reported_instances", row["instances"]),
        slice_count=row["slices"],
        memory_mb=row["memory_mb"],
        multiprocessor_count=row["sm"],
        copy_engines=row["ce"],
        decoders=row["dec"],
        encoders=row["enc"],
        jpegs=row["jpeg"],
        ofas=row["ofa"],
        spans=tuple(Span(start, row["size"]) for start in row["starts"]),
        compute_profiles=tuple(
            _compute_profile(row, constant, ci_slices, starts)
            for ci_slices, starts in ci_placements[row["slices"]].items()
        ) + tuple(_extra_compute_profile(row, extra) for extra in row.get("extra_ci", [])),
    )


def _extra_compute_profile(gi: dict[str, Any], extra: dict[str, Any]) -> ComputeInstanceProfile:
    """A CI profile a real -lcip listed beyond the slice rule (models.yaml `extra_ci`)."""
    return ComputeInstanceProfile(
        id=getattr(pynvml, "NVML_COMPUTE_INSTANCE_PROFILE_" + extra["constant"]),
        name=f"{extra['slices']}c.{gi['name']}",
        slice_count=extra["slices"],
        multiprocessor_count=extra["sm"],
        spans=tuple(Span(start, extra["slices"]) for start in extra["starts"]),
    )


def _compute_profile(
    gi: dict[str, Any], gi_constant: int, slices: int, starts: list[int]
) -> ComputeInstanceProfile:
    whole_gi = slices == gi["slices"]
    return ComputeInstanceProfile(
        id=_compute_profile_constant(gi_constant, slices),
        name=gi["name"] if whole_gi else f"{slices}c.{gi['name']}",
        slice_count=slices,
        # Partial CIs get an equal share of the GI's SMs (matches A100's in the MIG user guide; inferred elsewhere).
        multiprocessor_count=gi["sm"] if whole_gi else gi["sm"] // gi["slices"] * slices,
        spans=tuple(Span(start, slices) for start in starts),
    )


def _compute_profile_constant(gi_constant: int, slices: int) -> int:
    # A double-memory 1g GI (REV2) offers its single slice as CI profile 1_SLICE_REV1 (seen once:
    # `nvidia-smi mig -cgi 15 -C` on an H100 made CI profile ID 7).
    if gi_constant == pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2:
        return pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1
    return getattr(pynvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{slices}_SLICE")
