"""Dynamic MIG (dra.dynamic_mig_gpus): a DRA claim's MIG devices made at exactly the allocated placement and
destroyed again, through gpud's HTTP API on simulated HGX H100 and DGX A100 nodes; every refusal changes
nothing; other instances and their processes are untouched; static layouts and dynamic GPUs never fight."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers import cli, mig_config, put_layout, start_daemon, stop_daemon, until_async
from openapi_check import assert_matches_openapi

from gpud.model.mig import ENGINE_FIELDS, MigCapabilities, Placement
from gpud.node_operations import Operation
from gpud.nvml import mig as nvml_mig
from gpud.nvml.mig_tables import ReadTables
from gpud.nvml.reader import NodeReader
from gpud.nvml.sim.scenarios import started

H100_1G_10GB, H100_3G_40GB, A100_1G_5GB = 19, 9, 19  # NVML GPU-instance profile ids (mig-profiles.md)
CLAIM_A, CLAIM_B = "1c2d3e4f-0000-4000-8000-00000000000a", "1c2d3e4f-0000-4000-8000-00000000000b"


def dynamic_config(tmp, preset, gpus=(0, 1), **mig):
    return mig_config(tmp, preset, **mig).with_overrides(**{"dra.dynamic_mig_gpus": gpus})


async def start_converged(config, **options):
    """gpud serving, once its start-up convergence of dynamic MIG devices is over (claims wait for it: 503)."""
    node = await start_daemon(config, **options)
    await until_async(lambda: node.daemon.dynamic_mig.converged, timeout=10, what="dynamic MIG convergence")
    return node


async def call(node, method, path, body=None):
    async with node.http.request(method, f"http://localhost{path}", json=body) as response:
        return response.status, await response.json()


def device(gpu, profile_id, start):
    return {"gpu": gpu, "gi_profile_id": profile_id, "placement_start": start}


async def gpu_uuid(node, index):
    return (await node.get(f"/v1/gpus/{index}"))[1]["uuid"]


async def mig_devices(node, index):
    _, gpu = await node.get(f"/v1/gpus/{index}")
    return gpu["mig"]["mode"], {d["uuid"]: (d["placement"]["start"], d["profile"]) for d in gpu["mig"]["devices"]}


async def test_h100_claims_get_their_exact_placements_and_leave_others_untouched(short_tmp):
    node = await start_converged(dynamic_config(short_tmp, "hgx-h100"))
    try:
        status, view = await node.get("/v1/mig/dynamic")
        assert status == 200 and [g["index"] for g in view["gpus"]] == [0, 1] and view["instances"] == []
        assert_matches_openapi("GET", "/v1/mig/dynamic", 200, view)
        gpu0 = view["gpus"][0]
        assert gpu0["mig_mode"] == "disabled" and gpu0["mode_toggle_without_reset"] is True
        offered = {p["name"]: [x["start"] for x in p["placements"]] for p in gpu0["profiles"]}
        assert offered["1g.10gb"] == [0, 1, 2, 3, 4, 5, 6] and offered["3g.40gb"] == [0, 4]
        uuid = gpu0["uuid"]

        status, a = await call(node, "PUT", f"/v1/mig/dynamic/{CLAIM_A}", {"devices": [device(uuid, H100_1G_10GB, 3)]})
        assert status == 200, a
        assert_matches_openapi("PUT", "/v1/mig/dynamic/{uid}", 200, a)
        made_a = a["devices"][0]
        assert made_a["profile"] == "1g.10gb" and made_a["uuid"].startswith("MIG-")
        _, cdi = await node.get("/v1/cdi")  # read right after the answer, as the DRA plugin does
        assert made_a["uuid"] in cdi["devices"]
        mode, devices = await mig_devices(node, 0)
        assert mode == "enabled" and devices == {made_a["uuid"]: (3, "1g.10gb")}
        await node.post("/v1/sim/processes", {"gpu": made_a["uuid"], "pids": [4242]})

        status, b = await call(node, "PUT", f"/v1/mig/dynamic/{CLAIM_B}", {"devices": [device(uuid, H100_3G_40GB, 4)]})
        assert status == 200, b
        made_b = b["devices"][0]
        assert made_b["profile"] == "3g.40gb"
        _, devices = await mig_devices(node, 0)
        assert devices == {made_a["uuid"]: (3, "1g.10gb"), made_b["uuid"]: (4, "3g.40gb")}

        # the same body again: the same answer, nothing changed on the GPU
        state = (short_tmp / "sim.json").read_bytes()
        assert await call(node, "PUT", f"/v1/mig/dynamic/{CLAIM_B}", {"devices": [device(uuid, H100_3G_40GB, 4)]}) \
            == (200, b)
        assert (short_tmp / "sim.json").read_bytes() == state
        status, body = await call(node, "PUT", f"/v1/mig/dynamic/{CLAIM_B}",
                                  {"devices": [device(uuid, H100_1G_10GB, 0)]})
        assert status == 409 and body["error"]["code"] == "dynamic-claim-differs"

        _, view = await node.get("/v1/mig/dynamic")
        assert {(i["claim"], i["uuid"], i["state"]) for i in view["instances"]} == {
            (CLAIM_A, made_a["uuid"], "present"), (CLAIM_B, made_b["uuid"], "present")}
        assert view["gpus"][0]["mig_mode"] == "enabled"
        assert all(p["multiprocessors"] > 0 for p in view["gpus"][0]["profiles"])  # read from NVML in MIG mode

        # B goes: A keeps its UUID and its process
        status, body = await call(node, "DELETE", f"/v1/mig/dynamic/{CLAIM_B}")
        assert status == 200 and body == {"claim": CLAIM_B, "destroyed": [made_b["uuid"]]}
        assert_matches_openapi("DELETE", "/v1/mig/dynamic/{uid}", 200, body)
        _, gpu = await node.get("/v1/gpus/0")
        assert [(d["uuid"], d["pids"]) for d in gpu["mig"]["devices"]] == [(made_a["uuid"], [4242])]
        _, cdi = await node.get("/v1/cdi")
        assert made_b["uuid"] not in cdi["devices"]

        # A's process holds it: the kubelet retries Unprepare until it ended
        status, body = await call(node, "DELETE", f"/v1/mig/dynamic/{CLAIM_A}")
        assert status == 409 and body["error"]["code"] == "instance-in-use" and "4242" in body["error"]["message"]
        await node.post("/v1/sim/processes", {"gpu": made_a["uuid"], "pids": []})
        status, body = await call(node, "DELETE", f"/v1/mig/dynamic/{CLAIM_A}")
        assert status == 200 and body["destroyed"] == [made_a["uuid"]]
        assert await mig_devices(node, 0) == ("disabled", {})  # Hopper: the whole GPU is usable again
        assert await call(node, "DELETE", f"/v1/mig/dynamic/{CLAIM_A}") == (200, {"claim": CLAIM_A, "destroyed": []})
        _, metrics_view = await node.get("/v1/mig/dynamic")
        assert metrics_view["instances"] == []
    finally:
        await stop_daemon(node)


async def test_a100_1g5gb_and_its_mode_stays_on_where_leaving_needs_a_reset(short_tmp):
    node = await start_converged(dynamic_config(short_tmp, "dgx-a100", ("all",)))
    try:
        _, view = await node.get("/v1/mig/dynamic")
        assert len(view["gpus"]) == 8 and view["gpus"][5]["mode_toggle_without_reset"] is False
        uuid = view["gpus"][5]["uuid"]
        status, body = await call(node, "PUT", f"/v1/mig/dynamic/{CLAIM_A}", {"devices": [device(uuid, A100_1G_5GB, 6)]})
        assert status == 200, body
        assert body["devices"][0]["profile"] == "1g.5gb"
        assert await mig_devices(node, 5) == ("enabled", {body["devices"][0]["uuid"]: (6, "1g.5gb")})
        assert (await call(node, "DELETE", f"/v1/mig/dynamic/{CLAIM_A}"))[0] == 200
        assert await mig_devices(node, 5) == ("enabled", {})  # Ampere: leaving MIG mode takes a reset
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize("body, code", [
    ({}, "missing-field"),
    ({"devices": []}, "invalid-field"),
    ({"devices": "GPU-0"}, "invalid-field"),
    ({"devices": [{"gpu": "GPU-0", "gi_profile_id": 19}]}, "invalid-field"),
    ({"devices": [{"gpu": "GPU-0", "gi_profile_id": 19, "placement_start": 0, "extra": 1}]}, "invalid-field"),
    ({"devices": [{"gpu": "GPU-0", "gi_profile_id": "19", "placement_start": 0}]}, "invalid-field"),
    ({"devices": [{"gpu": "GPU-0", "gi_profile_id": True, "placement_start": 0}]}, "invalid-field"),
    ({"devices": [{"gpu": "GPU-0", "gi_profile_id": 19, "placement_start": -1}]}, "invalid-field"),
    ({"devices": [{"gpu": 7, "gi_profile_id": 19, "placement_start": 0}]}, "invalid-field"),
    ({"devices": [{"gpu": "GPU-0", "gi_profile_id": 19, "placement_start": 1.5}]}, "invalid-field"),
    ({"devices": [["GPU-0", 19, 0]]}, "invalid-field"),
    ({"devices": [device("GPU-0", 19, 0)] * 2}, "invalid-field"),
    ({"devices": [device("GPU-0", 19, n) for n in range(17)]}, "invalid-field"),
    ({"devices": [device("GPU-0", 19, 0)], "sharing": None}, "unknown-field"),
])
async def test_malformed_bodies_are_refused(short_tmp, body, code):
    node = await start_converged(dynamic_config(short_tmp, "hgx-h100"))
    try:
        status, answer = await call(node, "PUT", f"/v1/mig/dynamic/{CLAIM_A}", body)
        assert (status, answer["error"]["code"]) == (400, code), answer
        assert_matches_openapi("PUT", "/v1/mig/dynamic/{uid}", 400, answer)
        _, view = await node.get("/v1/mig/dynamic")
        assert view["instances"] == [] and not (short_tmp / "state" / "mig-dynamic.json").exists()
    finally:
        await stop_daemon(node)


async def test_every_refusal_changes_nothing(short_tmp):
    node = await start_converged(dynamic_config(short_tmp, "hgx-h100"))
    try:
        uuid, other, static = await gpu_uuid(node, 0), await gpu_uuid(node, 1), await gpu_uuid(node, 2)
        put = lambda claim, *devices: call(node, "PUT", f"/v1/mig/dynamic/{claim}", {"devices": list(devices)})  # noqa: E731

        async def refused(status, code, *devices, claim=CLAIM_B, says=()):
            answer = await put(claim, *devices)
            assert answer[0] == status and answer[1]["error"]["code"] == code, answer
            assert all(word in answer[1]["error"]["message"] for word in says), answer
            assert_matches_openapi("PUT", "/v1/mig/dynamic/{uid}", status, answer[1])
            return answer[1]["error"]

        await refused(400, "invalid-uid", device(uuid, 19, 0), claim="not_a_uid!")
        await refused(404, "gpu-not-found", device("GPU-00000000-0000-0000-0000-000000000000", 19, 0))
        await refused(409, "gpu-not-dynamic", device(static, 19, 0), says=("GPU 2", "dra.dynamic_mig_gpus"))
        await refused(422, "bad-placement", device(uuid, 77, 0), says=("77", "1g.10gb"))
        error = await refused(422, "bad-placement", device(uuid, H100_3G_40GB, 2), says=("3g.40gb",))
        assert error["valid_starts"] == [0, 4]
        # a process on the whole GPU: its MIG mode is not switched on under it
        await node.post("/v1/sim/processes", {"gpu": uuid, "pids": [5151]})
        await refused(409, "gpu-in-use", device(uuid, 19, 0), says=("GPU 0", "5151"))
        assert await mig_devices(node, 0) == ("disabled", {})
        await node.post("/v1/sim/processes", {"gpu": uuid, "pids": []})

        assert (await put(CLAIM_A, device(uuid, H100_3G_40GB, 4)))[0] == 200
        await refused(409, "placement-taken", device(uuid, 19, 5), says=(CLAIM_A,))
        await refused(409, "placement-taken", device(other, 19, 1), device(other, 14, 0), says=("this request",))
        # an instance someone made behind gpud's back (nvidia-smi mig -cgi) is named as such
        await node.daemon.session.call(nvml_mig.create_gpu_instance, 0, 19, Placement(0, 1))
        await node.daemon.inventory.refresh("test")
        await refused(409, "placement-taken", device(uuid, 14, 0), says=("an instance gpud did not make",))
        # another change holds the node
        node.daemon.node_operations.claim(Operation.APPLY, layout="all-1g.10gb")
        try:
            await refused(409, "apply-in-progress", device(uuid, 19, 2), says=("MIG apply",))
            status, body = await call(node, "DELETE", f"/v1/mig/dynamic/{CLAIM_A}")
            assert status == 409 and body["error"]["code"] == "apply-in-progress"
        finally:
            node.daemon.node_operations.release()
        _, view = await node.get("/v1/mig/dynamic")
        assert [i["claim"] for i in view["instances"]] == [CLAIM_A]
        assert (await mig_devices(node, 1)) == ("disabled", {})
    finally:
        await stop_daemon(node)


async def test_static_layouts_and_dynamic_gpus_never_fight(short_tmp):
    layouts = """
version: v1
mig-configs:
  gpu0-only:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
  all-1g:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
"""
    node = await start_converged(mig_config(short_tmp, "hgx-h100", layouts).with_overrides(
        **{"dra.dynamic_mig_gpus": (0,)}))
    try:
        status, body = await put_layout(node, "gpu0-only")
        assert status == 409 and body["error"]["code"] == "gpu-is-dynamic"
        assert "GPU 0" in body["error"]["message"] and "dra.dynamic_mig_gpus" in body["error"]["message"]
        status, body = await put_layout(node, "all-1g")
        assert status == 200 and body["state"] == "success", body
        assert [g["dynamic"] for g in body["gpus"]] == [True] + [False] * 7
        assert body["gpus"][0]["desired"] is None and body["gpus"][1]["desired"]["devices"] == {"1g.10gb": 7}
        assert await mig_devices(node, 0) == ("disabled", {})
        status, body = await call(node, "PUT", f"/v1/mig/dynamic/{CLAIM_A}",
                                  {"devices": [device(await gpu_uuid(node, 1), 19, 0)]})
        assert status == 409 and body["error"]["code"] == "gpu-not-dynamic"
        status, body = await call(node, "PUT", f"/v1/mig/dynamic/{CLAIM_A}",
                                  {"devices": [device(await gpu_uuid(node, 0), 19, 0)]})
        assert status == 200, body
    finally:
        await stop_daemon(node)


async def test_a_layout_persisted_before_a_gpu_became_dynamic_leaves_it_out(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "hgx-h100"))
    try:
        assert (await put_layout(node, "all-1g.10gb"))[0] == 200
        _, gpu1 = await node.get("/v1/gpus/1")
        await node.post("/v1/sim/processes", {"gpu": gpu1["mig"]["devices"][2]["uuid"], "pids": [6161]})
    finally:
        await stop_daemon(node)
    node = await start_converged(dynamic_config(short_tmp, "hgx-h100"))
    try:
        mode, devices = await mig_devices(node, 0)
        assert (mode, devices) == ("disabled", {})  # no claim made them: gone, and the whole GPU back
        _, devices = await mig_devices(node, 1)
        assert list(devices) == [gpu1["mig"]["devices"][2]["uuid"]]  # processes run on it: kept
        _, health = await node.get("/healthz")
        problems = " ".join(health.get("problems", []))
        assert "covers GPU 0" in problems and "no DRA claim made" in problems and "6161" in problems
        _, mig = await node.get("/v1/mig")
        assert mig["in_sync"] is True and mig["gpus"][0]["desired"] is None and mig["gpus"][0]["dynamic"]
        assert (await mig_devices(node, 2))[0] == "enabled"  # GPUs not dynamic keep the layout
    finally:
        await stop_daemon(node)


async def test_a_corrupt_record_file_is_set_aside_and_reported(short_tmp):
    (short_tmp / "state").mkdir(mode=0o700)
    (short_tmp / "state" / "mig-dynamic.json").write_text('{"boot_id": "x", "devices": [{"claim": 1}]}')
    node = await start_converged(dynamic_config(short_tmp, "hgx-h100"), healthy=False)
    try:
        _, health = await node.get("/healthz")
        assert any("mig-dynamic.json is corrupt" in p for p in health.get("problems", [])), health
        assert (short_tmp / "state" / "mig-dynamic.json.corrupt").exists()
        _, view = await node.get("/v1/mig/dynamic")
        assert view["instances"] == []
    finally:
        await stop_daemon(node)


async def test_records_of_an_earlier_boot_are_dropped(short_tmp):
    node = await start_converged(dynamic_config(short_tmp, "hgx-h100"))
    try:
        uuid = await gpu_uuid(node, 0)
        assert (await call(node, "PUT", f"/v1/mig/dynamic/{CLAIM_A}", {"devices": [device(uuid, 19, 3)]}))[0] == 200
    finally:
        await stop_daemon(node)
    path = short_tmp / "state" / "mig-dynamic.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "boot_id": "an-earlier-boot"}))
    node = await start_converged(dynamic_config(short_tmp, "hgx-h100"))
    try:
        _, view = await node.get("/v1/mig/dynamic")
        assert view["instances"] == []
        assert await mig_devices(node, 0) == ("disabled", {})  # what the record named is no claim's any more
    finally:
        await stop_daemon(node)


def test_a_profile_table_stored_without_engine_counts_reads_zero_until_nvml_answers_again(tmp_path):
    state = tmp_path / "sim.json"
    sim = started("H100-SXM5-80GB:1", state, driver="580.65.06")
    try:
        handle = sim.nvmlDeviceGetHandleByIndex(0)
        uuid = sim.nvmlDeviceGetUUID(handle)
        read = nvml_mig.read_capabilities(sim, handle, 81559)
        assert all(getattr(p, field) > 0 for p in read.gi_profiles for field in ("multiprocessors", "copy_engines"))
        assert MigCapabilities.from_document(read.to_document()) == read
        old = read.to_document()
        for profile in old["gi_profiles"]:
            for field in ENGINE_FIELDS:
                del profile[field]
        assert all(getattr(p, f) == 0 for p in MigCapabilities.from_document(old).gi_profiles for f in ENGINE_FIELDS)
        tables = tmp_path / "mig-profiles.json"
        tables.write_text(json.dumps({uuid: {"table": old}}))
        NodeReader(profiles_path=tables).read(sim, {})  # R580 answers the table with MIG off
        stored = ReadTables(tables).get(uuid)
        assert stored is not None and all(p.multiprocessors > 0 for p in stored.gi_profiles)
    finally:
        sim.nvmlShutdown()


async def test_gpud_mig_status_shows_the_dynamic_devices(short_tmp):
    config = dynamic_config(short_tmp, "hgx-h100", (0,))
    node = await start_converged(config)
    try:
        uuid = await gpu_uuid(node, 0)
        _, made = await call(node, "PUT", f"/v1/mig/dynamic/{CLAIM_A}", {"devices": [device(uuid, H100_3G_40GB, 4)]})
        status = await asyncio.to_thread(cli, "mig", "status", socket=config.socket_path)
        assert status.returncode == 0, status.stderr
        assert "dynamic (DRA claims)" in status.stdout
        row = next(line.split() for line in status.stdout.splitlines() if made["devices"][0]["uuid"] in line)
        assert row == ["0", "3g.40gb", "4+4", "present", made["devices"][0]["uuid"], CLAIM_A]
        as_json = json.loads((await asyncio.to_thread(cli, "mig", "status", "--json", socket=config.socket_path)).stdout)
        assert as_json["dynamic_mig"]["instances"][0]["claim"] == CLAIM_A
    finally:
        await stop_daemon(node)


async def test_a_create_that_fails_half_way_is_undone(short_tmp):
    node = await start_converged(dynamic_config(short_tmp, "hgx-h100"))
    try:
        uuid = await gpu_uuid(node, 0)
        _, kept = await call(node, "PUT", f"/v1/mig/dynamic/{CLAIM_A}", {"devices": [device(uuid, 19, 0)]})
        node.daemon.session.nvml.sim_fail_mig_call(after=2)  # the GI is made, its compute instance refused
        status, body = await call(node, "PUT", f"/v1/mig/dynamic/{CLAIM_B}", {"devices": [device(uuid, 19, 3)]})
        assert status == 500 and body["error"]["code"] == "dynamic-mig-failed", body
        assert "undone" in body["error"]["message"]
        assert await mig_devices(node, 0) == ("enabled", {kept["devices"][0]["uuid"]: (0, "1g.10gb")})
        _, view = await node.get("/v1/mig/dynamic")
        assert [i["claim"] for i in view["instances"]] == [CLAIM_A]
        status, body = await call(node, "PUT", f"/v1/mig/dynamic/{CLAIM_B}", {"devices": [device(uuid, 19, 3)]})
        assert status == 200, body  # the kubelet's retry
    finally:
        await stop_daemon(node)


async def test_the_dynamic_instances_gauge_counts_each_dynamic_gpus_devices(short_tmp):
    config = dynamic_config(short_tmp, "hgx-h100", (0, 1))
    node = await start_converged(config)
    try:
        uuid = await gpu_uuid(node, 0)
        status, _ = await call(node, "PUT", f"/v1/mig/dynamic/{CLAIM_A}", {"devices": [
            device(uuid, H100_1G_10GB, 0), device(uuid, H100_1G_10GB, 1)]})
        assert status == 200
        async with node.http.get("http://localhost/metrics") as response:
            metrics = await response.text()
        values = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("gpud_mig_dynamic_instances{")}
        by_gpu = {next(p.split("=")[1].strip('"') for p in labels.split(",") if p.startswith("gpu=")): value
                  for labels, value in values.items()}
        assert by_gpu == {"0": 2.0, "1": 0.0}, metrics
    finally:
        await stop_daemon(node)
