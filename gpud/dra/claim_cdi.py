"""One CDI spec per prepared claim, made of gpud's node spec (GET /v1/cdi): each allocated device's own
edits (its device nodes; a MIG device's parent node and capability nodes) and the spec's common edits
(control nodes, the driver's files and hooks), as gpud hands them to every runtime.

Named as NVIDIA's DRA driver names them (cmd/gpu-kubelet-plugin/cdi.go): vendor `k8s.<driver>`, class
`claim`, device `<claim UID>-<device name>`, so the kubelet passes `k8s.gpu.nvidia.com/claim=<uid>-gpu-0`;
the file is the CDI library's transient spec name (container-device-interface pkg/cdi
GenerateTransientSpecName: `<vendor>-<class>_<id>`). NVIDIA_VISIBLE_DEVICES=void keeps NVIDIA's legacy
runtime hook, which reads the image's NVIDIA_VISIBLE_DEVICES=all, from adding every GPU (nvidia-container-
toolkit pkg/nvcdi common edits set the same).
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

from gpud.base import bounded_json
from gpud.base.persist import write_text_atomic

CLASS = "claim"
VISIBLE_DEVICES_VOID = "NVIDIA_VISIBLE_DEVICES=void"
MAX_SPEC_BYTES = 4 << 20  # a claim's spec is a few KiB: a larger file is no spec this plugin wrote
CLAIM_UID = re.compile(r"[0-9a-fA-F][0-9a-fA-F-]{0,62}")  # a Kubernetes UID (a UUID): safe in a file name


class ClaimSpecError(Exception):
    """The claim's spec cannot be made: what is missing, in words."""


def vendor(driver: str) -> str:
    return f"k8s.{driver}"


def spec_path(cdi_dir: Path, driver: str, claim_uid: str) -> Path:
    return cdi_dir / f"{vendor(driver)}-{CLASS}_{claim_uid}.json"


def cdi_device_id(driver: str, claim_uid: str, device_name: str) -> str:
    return f"{vendor(driver)}/{CLASS}={claim_uid}-{device_name}"


def claim_spec(node_spec: dict, driver: str, claim_uid: str, devices: list[tuple[str, str]],
               extra: dict[str, dict] | None = None) -> dict:
    """The claim's spec: `devices` are (device name in the pool, GPU or MIG UUID); each takes the edits of
    gpud's device of that UUID, and `extra` edits by UUID (env and mounts: an MPS client's). ClaimSpecError
    when gpud's spec has none (a device node missing)."""
    by_name = {d["name"]: d for d in node_spec.get("devices") or []}
    entries = []
    for name, uuid in devices:
        if uuid not in by_name:
            raise ClaimSpecError(f"gpud's CDI spec has no device {uuid} for {name} (GET /v1/cdi lists the "
                                 "devices it left out, and why)")
        edits = copy.deepcopy(by_name[uuid]["containerEdits"])
        for key, values in ((extra or {}).get(uuid) or {}).items():
            edits[key] = [*edits.get(key, []), *values]
        entries.append({"name": f"{claim_uid}-{name}", "containerEdits": edits})
    common = copy.deepcopy(node_spec.get("containerEdits") or {})
    common["env"] = [e for e in common.get("env") or [] if not e.startswith("NVIDIA_VISIBLE_DEVICES=")] + \
        [VISIBLE_DEVICES_VOID]
    return {"cdiVersion": node_spec["cdiVersion"], "kind": f"{vendor(driver)}/{CLASS}", "devices": entries,
            "containerEdits": common}


def write_claim_spec(cdi_dir: Path, driver: str, claim_uid: str, spec: dict) -> Path:
    """Written whole by rename, readable by the runtime (0644); not fsynced: /var/run/cdi does not outlive a
    boot, and neither does the claim."""
    path = spec_path(cdi_dir, driver, claim_uid)
    write_text_atomic(path, json.dumps(spec, indent=2) + "\n", mode=0o644, durable=False)
    return path


def remove_claim_spec(cdi_dir: Path, driver: str, claim_uid: str) -> bool:
    try:
        os.unlink(spec_path(cdi_dir, driver, claim_uid))
        return True
    except FileNotFoundError:
        return False


def claim_specs_on_disk(cdi_dir: Path, driver: str) -> dict[str, dict]:
    """The claim specs this driver left in cdi_dir, by claim UID (for a restart without a checkpoint);
    a file that is no readable spec (no JSON object, or one nested deeper than bounded_json allows), or
    too large to be one, is skipped."""
    prefix, found = f"{vendor(driver)}-{CLASS}_", {}
    try:
        names = os.listdir(cdi_dir)
    except OSError:
        return found
    for name in names:
        uid = name[len(prefix):-len(".json")] if name.startswith(prefix) and name.endswith(".json") else ""
        if not CLAIM_UID.fullmatch(uid):
            continue
        try:
            with open(os.open(cdi_dir / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as file:
                text = file.read(MAX_SPEC_BYTES + 1)
            spec = bounded_json.loads(text, what=name) if len(text) <= MAX_SPEC_BYTES else None
        except (OSError, ValueError):
            continue
        if isinstance(spec, dict):
            found[uid] = spec
    return found
