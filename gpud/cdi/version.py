"""The lowest cdiVersion a CDI spec may declare for what it uses: a port of the CDI library's
MinimumRequiredVersion (cncf-tags/container-device-interface specs-go/version.go, requiresV040 ..
requiresV110). Since library v0.5.4, pkg/cdi refuses a spec that declares less ("the spec version must
be at least v0.5.0"); declaring more than needed locks out older readers (Debian 12's podman 4.3 knows
no version above 0.5.0). So a spec declares exactly this."""

from __future__ import annotations

EARLIEST = "0.3.0"  # vEarliest: the lowest version the library accepts


def minimum_version(spec: dict) -> str:
    """The highest version whose requiresVxxx rule the spec meets, else EARLIEST (requiredVersion)."""
    for version, required in _RULES:  # highest first
        if required(spec):
            return version
    return EARLIEST


def _all_edits(spec: dict) -> list[dict]:
    return [device.get("containerEdits") or {} for device in spec.get("devices", [])] + [spec.get("containerEdits") or {}]


def _is_letter(character: str) -> bool:
    return "A" <= character <= "Z" or "a" <= character <= "z"  # specs-go isLetter: ASCII letters only


def _requires_v110(spec: dict) -> bool:
    # intelRdt's schemata or enableMonitoring, or netDevices, anywhere
    return any((edits.get("intelRdt") or {}).get("schemata") is not None
               or (edits.get("intelRdt") or {}).get("enableMonitoring") or edits.get("netDevices")
               for edits in _all_edits(spec))


def _requires_v070(spec: dict) -> bool:
    # intelRdt or additionalGids, at spec or device level
    return any(edits.get("intelRdt") is not None or edits.get("additionalGids") for edits in _all_edits(spec))


def _requires_v060(spec: dict) -> bool:
    # annotations at spec or device level, or a "." in the kind's class (after "vendor/")
    if spec.get("annotations") or any(device.get("annotations") for device in spec.get("devices", [])):
        return True
    vendor, _, kind_class = spec.get("kind", "").partition("/")
    return bool(vendor) and "." in kind_class


def _requires_v050(spec: dict) -> bool:
    # a device name that does not start with a letter, or a device node's hostPath
    if any(device.get("name") and not _is_letter(device["name"][0]) for device in spec.get("devices", [])):
        return True
    return any(node.get("hostPath") for edits in _all_edits(spec) for node in edits.get("deviceNodes") or [])


def _requires_v040(spec: dict) -> bool:
    # a mount's type
    return any(mount.get("type") for edits in _all_edits(spec) for mount in edits.get("mounts") or [])


# v0.8.0 and v1.0.0 changed the library, not the spec: their rules never match (requiresV080, requiresV100).
_RULES = (("1.1.0", _requires_v110), ("0.7.0", _requires_v070), ("0.6.0", _requires_v060),
          ("0.5.0", _requires_v050), ("0.4.0", _requires_v040))
