"""What MIG looks like to gpud: a GPU's MIG capabilities, its current instances, and plans.

Plain immutable data shared by the NVML reader (which fills it), the planner (which reasons on it)
and the reconciler (which carries plans out through NVML).

Units: a GPU-instance placement is in memory slices (8 on A100/H100/H200, 4 on A30); a
compute-instance placement is in compute slices inside its GPU instance.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    start: int
    size: int


@dataclass(frozen=True)
class CiProfile:
    """A compute-instance size a GPU instance offers."""

    constant: int  # NVML_COMPUTE_INSTANCE_PROFILE_* (the profile id NVML reports equals it)
    slices: int  # compute slices
    starts: tuple[int, ...]  # where inside the GPU instance it may start (in compute slices)


@dataclass(frozen=True)
class GiProfile:
    """A GPU-instance profile of one GPU model, as NVML reports it."""

    id: int  # the NVML profile id (info.id), which every call after GetGpuInstanceProfileInfo takes
    constant: int  # NVML_GPU_INSTANCE_PROFILE_*
    name: str  # canonical name, e.g. "3g.20gb", "1g.5gb+me"
    slices: int  # compute slices
    memory_mib: int
    instance_count: int  # at most this many at once on the GPU
    placements: tuple[Placement, ...]  # valid placements, in memory slices
    ci_profiles: tuple[CiProfile, ...]  # smallest first; the last takes the whole GPU instance
    # "nvml": read through a GPU instance of this profile; "derived": gpud's rule (capabilities.py),
    # until a GPU instance of the profile exists to ask (NVML tells CI profiles only through one).
    ci_source: str = "derived"
    # The GPU instance's share of the GPU (nvmlGpuInstanceProfileInfo_t: multiprocessorCount,
    # copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount): the counters a DRA
    # partitionable device consumes. 0 where unknown (a table stored before gpud read them, a shipped one).
    multiprocessors: int = 0
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0

    @property
    def whole_ci(self) -> CiProfile:
        return self.ci_profiles[-1]


ENGINE_FIELDS = ("multiprocessors", "copy_engines", "decoders", "encoders", "jpeg_engines", "ofa_engines")


@dataclass(frozen=True)
class MigCapabilities:
    memory_slices: int
    gi_profiles: tuple[GiProfile, ...]

    def gi_profile(self, name: str) -> GiProfile | None:
        return next((p for p in self.gi_profiles if p.name == name), None)

    def gi_profile_by_id(self, profile_id: int) -> GiProfile | None:
        return next((p for p in self.gi_profiles if p.id == profile_id), None)

    def to_document(self) -> dict:
        """Plain JSON data, for the table gpud keeps of each GPU (state_dir/mig-profiles.json)."""
        return {"memory_slices": self.memory_slices, "gi_profiles": [
            {"id": p.id, "constant": p.constant, "name": p.name, "slices": p.slices, "memory_mib": p.memory_mib,
             "instance_count": p.instance_count, "placements": [[x.start, x.size] for x in p.placements],
             "ci_source": p.ci_source, **{name: getattr(p, name) for name in ENGINE_FIELDS},
             "ci_profiles": [{"constant": c.constant, "slices": c.slices, "starts": list(c.starts)}
                             for c in p.ci_profiles]}
            for p in self.gi_profiles]}

    @classmethod
    def from_document(cls, document: dict) -> MigCapabilities:
        """The inverse of to_document. KeyError, TypeError or ValueError for a document that is not one."""
        profiles = tuple(GiProfile(
            id=int(p["id"]), constant=int(p["constant"]), name=str(p["name"]), slices=int(p["slices"]),
            memory_mib=int(p["memory_mib"]), instance_count=int(p["instance_count"]),
            placements=tuple(Placement(int(start), int(size)) for start, size in p["placements"]),
            ci_profiles=tuple(CiProfile(int(c["constant"]), int(c["slices"]), tuple(int(s) for s in c["starts"]))
                              for c in p["ci_profiles"]),
            ci_source=str(p.get("ci_source", "derived")),
            # absent from tables stored before gpud read them: 0 until NVML answers the table again
            **{name: int(p.get(name, 0)) for name in ENGINE_FIELDS})
            for p in document["gi_profiles"])
        if not profiles or any(not p.ci_profiles for p in profiles):
            raise ValueError("a MIG table needs GPU-instance profiles, each with compute-instance profiles")
        return cls(memory_slices=int(document["memory_slices"]), gi_profiles=profiles)


@dataclass(frozen=True)
class ComputeInstanceState:
    ci_id: int
    profile_id: int
    start: int  # compute slice inside the GPU instance
    slices: int
    uuid: str  # the MIG device UUID
    pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GpuInstanceState:
    gi_id: int
    profile_id: int
    placement: Placement
    compute_instances: tuple[ComputeInstanceState, ...] = ()


@dataclass(frozen=True)
class GpuMigState:
    """One GPU as the MIG planner sees it."""

    index: int
    uuid: str
    pci_device_id: str  # "0x20B010DE"
    capable: bool
    mode_enabled: bool
    capabilities: MigCapabilities | None  # None when not MIG-capable
    instances: tuple[GpuInstanceState, ...] = ()


# -- plans -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CiTarget:
    """A compute instance of the target layout: an existing one kept, or one to create."""

    name: str  # MIG device profile, e.g. "1c.3g.20gb" or "3g.20gb"
    constant: int
    slices: int
    start: int
    keep_ci_id: int | None = None


@dataclass(frozen=True)
class GiTarget:
    """A GPU instance of the target layout: an existing one kept, or one to create."""

    profile_id: int
    name: str
    placement: Placement
    compute_instances: tuple[CiTarget, ...]
    keep_gi_id: int | None = None


@dataclass(frozen=True)
class GpuPlan:
    """The smallest set of changes that turns a GPU's current instances into the target."""

    index: int
    uuid: str
    target: tuple[GiTarget, ...]
    destroy_cis: tuple[tuple[int, int], ...] = ()  # (gi_id, ci_id), all before any GI is destroyed
    destroy_gis: tuple[int, ...] = ()
    create_cis: tuple[tuple[int, CiTarget], ...] = ()  # new compute instances in kept GPU instances
    create_gis: tuple[GiTarget, ...] = ()  # new GPU instances, each with all its compute instances

    @property
    def mutations(self) -> int:
        """NVML calls that change the GPU: one per destroy and per create."""
        return (len(self.destroy_cis) + len(self.destroy_gis) + len(self.create_cis)
                + sum(1 + len(gi.compute_instances) for gi in self.create_gis))

    @property
    def kept(self) -> int:
        """Compute instances (MIG devices) left untouched."""
        return sum(ci.keep_ci_id is not None for gi in self.target for ci in gi.compute_instances)


class PlanError(ValueError):
    """A layout that cannot be put on a GPU, with the reason."""

    def __init__(self, message: str, gpu_index: int | None = None):
        super().__init__(message)
        self.gpu_index = gpu_index
