"""Prepare and Unprepare of one claim (gpud/dra/prepare.py) on a simulated node's real devices and CDI spec:
the claim's spec, idempotence, conflicts, hostile and malformed claims, NVIDIA's opaque configs decoded
strictly, and the checkpoint after a kill at each step (every state the files can be left in) converging
when the plugin starts again."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import replace

import pytest
from helpers import mig_config, put_layout, start_daemon, stop_daemon

from gpud.dra.checkpoint import FILE_NAME, PREPARED, PREPARING, load
from gpud.dra.claim_cdi import spec_path
from gpud.dra.config import ConfigError, parse
from gpud.dra.devices import node_devices
from gpud.dra.prepare import ClaimRef, PoolView, PrepareError, Preparer

DRIVER, POOL = "gpu.nvidia.com", "node-1"
BOOT = "boot-1"


async def _view(tmp, layout=None) -> PoolView:
    """The simulated node's devices and gpud's CDI spec (gpud's files under tmp/g, apart from the plugin's)."""
    (tmp / "g").mkdir()
    node = await start_daemon(mig_config(tmp / "g", "hgx-a100-4gpu"))
    try:
        if layout:
            status, answer = await put_layout(node, layout)
            assert status == 200, answer
        (_, gpus), (_, info), (_, cdi) = [await node.get(p) for p in ("/v1/gpus", "/v1/node", "/v1/cdi")]
        for _ in range(200):  # the spec is written shortly after start, and rewritten after a layout change
            migs = sum(len(g["mig"]["devices"]) for g in gpus["gpus"])
            if cdi["spec"] is not None and len([d for d in cdi["devices"] if d.startswith("MIG-")]) == migs:
                break
            await asyncio.sleep(0.02)
            _, cdi = await node.get("/v1/cdi")
    finally:
        await stop_daemon(node)
    devices, _ = node_devices(gpus, info)
    return PoolView({d.name: d for d in devices}, cdi["spec"])


@pytest.fixture
async def view(short_tmp) -> PoolView:
    return await _view(short_tmp)


def _preparer(tmp) -> Preparer:
    (tmp / "cdi").mkdir(exist_ok=True)
    checkpoint, corrupt, _ = load(tmp / "plugin" / FILE_NAME, BOOT)
    assert corrupt is None
    return Preparer(DRIVER, POOL, tmp / "cdi", checkpoint)


def claim(devices: list[str], *, uid: str | None = None, driver: str = DRIVER, pool: str = POOL,
          config: list[dict] | None = None, name: str = "c") -> tuple[ClaimRef, dict]:
    uid = uid or str(uuid.uuid4())
    results = [{"request": f"r{i}", "driver": driver, "pool": pool, "device": d} for i, d in enumerate(devices)]
    document = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": "ns", "uid": uid},
                "status": {"allocation": {"devices": {"results": results, "config": config or []}}}}
    return ClaimRef("ns", name, uid), document


def gpu_config(sharing: dict | None = None, kind: str = "GpuConfig", **extra) -> dict:
    parameters = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": kind, **extra}
    if sharing is not None:
        parameters["sharing"] = sharing
    return {"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": parameters}}


async def test_a_claim_gets_its_own_spec_with_gpuds_edits(view, short_tmp):
    preparer = _preparer(short_tmp)
    ref, document = claim(["gpu-0", "gpu-2"])
    prepared = preparer.prepare(ref, document, view)
    assert [(d.device, d.cdi_device_ids) for d in prepared.devices] == [
        ("gpu-0", (f"k8s.gpu.nvidia.com/claim={ref.uid}-gpu-0",)),
        ("gpu-2", (f"k8s.gpu.nvidia.com/claim={ref.uid}-gpu-2",))]
    assert [d.request_names for d in prepared.devices] == [("r0",), ("r1",)]
    spec = json.loads(spec_path(short_tmp / "cdi", DRIVER, ref.uid).read_text())
    assert spec["kind"] == "k8s.gpu.nvidia.com/claim" and spec["cdiVersion"] == view.node_spec["cdiVersion"]
    node_devices_by_name = {d["name"]: d for d in view.node_spec["devices"]}
    for entry, device in zip(spec["devices"], ("gpu-0", "gpu-2")):
        assert entry["name"] == f"{ref.uid}-{device}"
        assert entry["containerEdits"] == node_devices_by_name[view.devices[device].uuid]["containerEdits"]
    assert spec["containerEdits"]["deviceNodes"] == view.node_spec["containerEdits"]["deviceNodes"]
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["containerEdits"]["env"]
    assert oct(spec_path(short_tmp / "cdi", DRIVER, ref.uid).stat().st_mode & 0o777) == "0o644"
    # the record survives a restart
    assert load(short_tmp / "plugin" / FILE_NAME, BOOT)[0].claims[ref.uid].state == PREPARED


async def test_prepare_and_unprepare_are_idempotent(view, short_tmp):
    preparer = _preparer(short_tmp)
    ref, document = claim(["gpu-1"])
    first = preparer.prepare(ref, document, view)
    assert preparer.prepare(ref, {}, view) == first  # a retry is answered from the record, not the claim
    preparer.unprepare(ref)
    assert not spec_path(short_tmp / "cdi", DRIVER, ref.uid).exists() and ref.uid not in preparer.checkpoint.claims
    preparer.unprepare(ref)  # again: nothing to do, success
    preparer.unprepare(ClaimRef("ns", "never", str(uuid.uuid4())))  # never prepared: success


async def test_a_device_held_by_another_claim_is_refused_naming_the_holder(view, short_tmp):
    preparer = _preparer(short_tmp)
    first, document = claim(["gpu-3"], name="first")
    preparer.prepare(first, document, view)
    second, document = claim(["gpu-3"], name="second")
    with pytest.raises(PrepareError, match=f"held by claim ns/first \\({first.uid}\\)"):
        preparer.prepare(second, document, view)
    assert second.uid not in preparer.checkpoint.claims
    # both asking to time-slice it: shared by design
    shared = {"strategy": "TimeSlicing"}
    a, document = claim(["gpu-1"], name="a", config=[gpu_config(shared)])
    preparer.prepare(a, document, view)
    b, document = claim(["gpu-1"], name="b", config=[gpu_config(shared)])
    preparer.prepare(b, document, view)
    c, document = claim(["gpu-1"], name="c")
    with pytest.raises(PrepareError, match="held by claim ns/a"):
        preparer.prepare(c, document, view)


async def test_a_mig_device_and_its_gpu_are_one_holding(short_tmp):
    view = await _view(short_tmp, "all-balanced")
    preparer = _preparer(short_tmp)
    migs = sorted(n for n, d in view.devices.items() if d.gpu_index == 0)
    ref, document = claim([migs[0]])
    prepared = preparer.prepare(ref, document, view)
    spec = json.loads(spec_path(short_tmp / "cdi", DRIVER, ref.uid).read_text())
    mig_uuid = view.devices[migs[0]].uuid
    assert spec["devices"][0]["containerEdits"] == {d["name"]: d for d in view.node_spec["devices"]}[mig_uuid]["containerEdits"]
    assert prepared.devices[0].gpu_uuid == view.devices[migs[0]].gpu_uuid
    other, document = claim([migs[1]])  # another MIG device of the same GPU: no conflict
    preparer.prepare(other, document, view)


@pytest.mark.parametrize("change, message", [
    (lambda d: d["metadata"].update(uid=str(uuid.uuid4())), "deleted and created again"),
    (lambda d: d["status"].pop("allocation"), "is not allocated"),
    (lambda d: d["status"]["allocation"]["devices"]["results"][0].update(driver="other.example.com"),
     "has no device of driver gpu.nvidia.com"),
    (lambda d: d["status"]["allocation"]["devices"]["results"][0].update(pool="another-node"), "is in pool another-node"),
    (lambda d: d["status"]["allocation"]["devices"]["results"][0].update(device="gpu-99"), "not in this node's pool"),
    (lambda d: d["status"]["allocation"]["devices"]["config"].append(gpu_config(sharing={"strategy": "TimeSlicing",
                                                                                         "replicas": 4})),
     "unknown field 'replicas'"),
    (lambda d: d["status"]["allocation"]["devices"]["config"].append(gpu_config(kind="MigDeviceConfig")),
     "a MigDeviceConfig does not apply"),
    (lambda d: d["status"]["allocation"]["devices"]["config"].append(gpu_config(sharing={"strategy": "Timeslicing"})),
     "'Timeslicing' is not 'TimeSlicing' or 'MPS'"),
    (lambda d: d["status"]["allocation"]["devices"]["config"].append(
        {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": "{not json"}}), "parameters is not valid JSON"),
    (lambda d: d["status"]["allocation"]["devices"]["config"].append(gpu_config(sharing={"strategy": "MPS"})),
     "MPS sharing needs gpud's MPS daemons"),
])
async def test_hostile_and_malformed_claims_fail_clearly_and_hold_nothing(view, short_tmp, change, message):
    preparer = _preparer(short_tmp)
    ref, document = claim(["gpu-0"])
    change(document)
    with pytest.raises(PrepareError, match=message):
        preparer.prepare(ref, document, view)
    assert ref.uid not in preparer.checkpoint.claims and not list((short_tmp / "cdi").iterdir())


async def test_a_uid_that_is_no_uid_never_reaches_a_file_name(view, short_tmp):
    preparer = _preparer(short_tmp)
    for uid in ("../../etc/passwd", "a/b", "x" * 100, "0" * 64, "0a\n"):
        ref, document = claim(["gpu-0"], uid=uid)
        with pytest.raises(PrepareError, match="is not a Kubernetes UID"):
            preparer.prepare(ref, document, view)
        with pytest.raises(PrepareError, match="is not a Kubernetes UID"):
            preparer.unprepare(ref)


async def test_another_drivers_config_is_skipped_and_the_claims_wins_over_the_class(view, short_tmp):
    preparer = _preparer(short_tmp)
    foreign = {"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {"anything": True}}}
    from_class = {**gpu_config({"strategy": "MPS"}), "source": "FromClass"}  # MPS would be refused
    ref, document = claim(["gpu-0"], config=[gpu_config({"strategy": "TimeSlicing"}), foreign, from_class])
    assert preparer.prepare(ref, document, view).shared  # the claim's TimeSlicing applies, not the class's MPS


def test_opaque_configs_decode_as_strictly_as_nvidias():
    assert parse({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}).sharing is None
    mps = parse(json.dumps({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig", "sharing": {
        "strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"}}}))
    assert mps.sharing.mps == {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"}
    for bad, why in (
            ({"kind": "GpuConfig"}, "apiVersion"),
            ({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig"}, "VFIO"),
            ({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "metadata": {}}, "unknown field 'metadata'"),
            ({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig",
              "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {}}}, "unknown field 'timeSlicingConfig'"),
            ({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
              "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}}}, "0 to 100"),
            ({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
              "sharing": {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "lots"}}}, "not a quantity"),
            ({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
              "sharing": {"strategy": "TimeSlicing", "mpsConfig": {}}}, "cannot use mpsConfig"),
            ([], "an object was expected")):
        with pytest.raises(ConfigError, match=why):
            parse(bad)


# -- a kill at each step ---------------------------------------------------------------------------
# Prepare writes: the record (preparing), the spec, the record (prepared); Unprepare: the spec removed,
# the record removed. A kill leaves the files as they were after the last whole write (each is atomic:
# gpud/base/persist.py), so these are every state a kill can leave; each converges when the plugin starts again.

def _kill_states(preparer, ref, document, view, short_tmp):
    """(name, make the files as a kill at that point leaves them)."""
    path = spec_path(short_tmp / "cdi", DRIVER, ref.uid)

    def after_first_record():
        preparer.prepare(ref, document, view)
        path.unlink()
        _set_state(preparer, ref.uid, PREPARING)

    def after_spec():
        preparer.prepare(ref, document, view)
        _set_state(preparer, ref.uid, PREPARING)

    def after_spec_removed():
        preparer.prepare(ref, document, view)
        path.unlink()

    return {"prepare: record written": after_first_record, "prepare: spec written": after_spec,
            "unprepare: spec removed": after_spec_removed}


def _set_state(preparer, uid, state):
    preparer.checkpoint.put(replace(preparer.checkpoint.claims[uid], state=state))


@pytest.mark.parametrize("step", ["prepare: record written", "prepare: spec written", "unprepare: spec removed"])
@pytest.mark.parametrize("then", ["prepare", "unprepare"])
async def test_a_kill_at_each_step_converges_after_a_restart(view, short_tmp, step, then):
    ref, document = claim(["gpu-0"])
    _kill_states(_preparer(short_tmp), ref, document, view, short_tmp)[step]()
    restarted = _preparer(short_tmp)  # a new process: everything read back from disk
    assert ref.uid in restarted.checkpoint.claims
    other, other_document = claim(["gpu-0"], name="other")
    with pytest.raises(PrepareError, match="held by claim"):  # until the kubelet acts, the device stays held
        restarted.prepare(other, other_document, view)
    path = spec_path(short_tmp / "cdi", DRIVER, ref.uid)
    if then == "prepare":  # the kubelet retries Prepare of a claim it never saw prepared
        prepared = restarted.prepare(ref, document, view)
        assert prepared.state == PREPARED and path.exists()
        assert load(short_tmp / "plugin" / FILE_NAME, BOOT)[0].claims[ref.uid].state == PREPARED
    else:
        restarted.unprepare(ref)
        assert not path.exists() and load(short_tmp / "plugin" / FILE_NAME, BOOT)[0].claims == {}
        restarted.prepare(other, other_document, view)  # the device is free again


def test_a_checkpoint_of_an_earlier_boot_or_another_format_is_not_taken(short_tmp):
    path = short_tmp / FILE_NAME
    path.write_text(json.dumps({"format": "gpud-dra-checkpoint/v1", "boot_id": "old", "claims": {
        "u1": {"uid": "u1", "namespace": "n", "name": "c", "state": "prepared", "devices": []}}}))
    checkpoint, corrupt, dropped = load(path, "new")
    assert (checkpoint.claims, corrupt, dropped) == ({}, None, 1)
    # NVIDIA's plugin's checkpoint (checkpointv.go): another format, set aside and said, not a crash
    path.write_text(json.dumps({"checksum": 1, "v2": {"preparedClaims": {}, "nodeBootID": "x"}}))
    checkpoint, corrupt, _ = load(path, "new")
    assert checkpoint.claims == {} and "not a gpud-dra-checkpoint/v1 checkpoint" in corrupt.error
    assert corrupt.kept_as.exists() and not path.exists()
    path.write_text("{truncated")
    assert load(path, "new")[1] is not None
