"""The fault matrix: NVML errors injected on every call class (init, device reads for the inventory and
the health readings, MIG changes, events) leave gpud answering. /healthz says what is wrong, reads keep
serving the last snapshot, nothing raises inside gpud, and a later recovery is picked up.

Faults come from the simulator's `sim_fail_calls` (the next N calls whose name starts with a prefix
raise an NVMLError), on the real daemon in-process on its real Unix socket."""

from __future__ import annotations

import asyncio
import logging

import pytest
import structlog
from helpers import answer_until, mig_config, mig_settled, put_layout, sim_config, start_daemon, stop_daemon
from openapi_check import assert_matches_openapi
from pynvml import (NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_GPU_IS_LOST, NVML_ERROR_INSUFFICIENT_RESOURCES,
                    NVML_ERROR_UNKNOWN, NVMLError)

from gpud.daemon import Daemon
from gpud.nvml.sim import SimError, SimulatedNvml

FOREVER = 10**9  # calls: a fault that lasts until the test clears it
READ_ROUTES = ("/v1/gpus", "/v1/health", "/v1/mig", "/v1/node")


@pytest.fixture
def raised(caplog):
    """What raised inside gpud during the test: log lines carrying an exception (aiohttp's failed
    request handler, asyncio's unretrieved task exception, a crashed MIG apply)."""
    caplog.set_level(logging.ERROR)
    with structlog.testing.capture_logs() as entries:
        yield lambda: [entry for entry in entries if "exc_info" in entry or entry.get("log_level") == "critical"] + \
            [record.getMessage() for record in caplog.records
             if record.exc_info or "request_failed" in record.getMessage() or record.name == "asyncio"]


def node_tasks_alive(daemon: Daemon) -> bool:
    """gpud's background work (the node task, health checks, MPS supervision) has not died of an error."""
    return daemon.lifecycle.tasks.crashed == {}


async def raw_get(running, path: str):
    async with running.http.get(f"http://localhost{path}") as response:
        return response.status, await response.read()


async def mig_of_gpus(running) -> list[tuple]:
    """Each GPU's MIG mode, pending mode and MIG device profiles."""
    _, body = await running.get("/v1/gpus")
    return [(gpu["mig"]["mode"], gpu["mig"]["pending_mode"], sorted(d["profile"] for d in gpu["mig"]["devices"]))
            for gpu in body["gpus"]]


# -- the simulator's control ---------------------------------------------------------------------

def test_sim_fail_calls_fails_the_next_calls_of_a_prefix_then_heals(tmp_path):
    # Guards the control the matrix relies on: only matching calls fail, exactly `count` of them,
    # with the chosen error; init can fail before NVML is up; bad arguments are refused.
    nvml = SimulatedNvml("A100-SXM4-40GB:2", tmp_path / "sim.json")
    nvml.sim_fail_calls("nvmlInit", NVML_ERROR_DRIVER_NOT_LOADED, 1)
    with pytest.raises(NVMLError) as failure:
        nvml.nvmlInit()
    assert failure.value.value == NVML_ERROR_DRIVER_NOT_LOADED
    nvml.nvmlInit()  # healed after one call
    nvml.sim_fail_calls("nvmlDeviceGetHandleByIndex", NVML_ERROR_UNKNOWN, 2)
    assert nvml.nvmlDeviceGetCount() == 2  # another call is untouched
    for _ in range(2):
        with pytest.raises(NVMLError) as failure:
            nvml.nvmlDeviceGetHandleByIndex(0)
        assert failure.value.value == NVML_ERROR_UNKNOWN
    assert nvml.nvmlDeviceGetHandleByIndex(0) is not None
    nvml.sim_fail_calls("nvmlDevice", NVML_ERROR_GPU_IS_LOST, FOREVER)
    with pytest.raises(NVMLError):
        nvml.nvmlDeviceGetCount()
    nvml.sim_fail_calls("nvmlDevice", NVML_ERROR_GPU_IS_LOST, 0)  # count 0 clears it
    assert nvml.nvmlDeviceGetCount() == 2
    for bad in (("Init", 1, 1), ("nvmlInit", 0, 1), ("nvmlInit", True, 1), ("nvmlInit", 1, -1),
                ("nvmlInit", 1, 1.5), (None, 1, 1)):
        with pytest.raises(SimError):
            nvml.sim_fail_calls(*bad)
    nvml.nvmlShutdown()


# -- the matrix ----------------------------------------------------------------------------------

async def test_nvml_init_failing_is_reported_and_its_recovery_picked_up(short_tmp, raised):
    config = sim_config(short_tmp, "A100-SXM4-40GB:2").with_overrides(
        **{"nvml.init_retry_initial_s": 0.02, "nvml.init_retry_max_s": 0.1})
    node = await start_daemon(config, healthy=False, prepare=lambda daemon: daemon.session.nvml.sim_fail_calls(
        "nvmlInit", NVML_ERROR_DRIVER_NOT_LOADED, FOREVER))
    try:
        status, health = await answer_until(node, "/healthz",
                                            lambda _, body: body["error"]["code"] == "nvml-unavailable")
        assert status == 503 and "Driver Not Loaded" in health["reason"], health
        status, body = await node.get("/v1/gpus")
        assert status == 503 and body["error"]["code"] == "nvml-unavailable"
        node.daemon.session.nvml.sim_fail_calls("nvmlInit", NVML_ERROR_DRIVER_NOT_LOADED, 0)  # the driver loads
        await answer_until(node, "/healthz", lambda status, _: status == 200)
        status, body = await node.get("/v1/gpus")
        assert status == 200 and len(body["gpus"]) == 2
        assert node_tasks_alive(node.daemon) and not raised()
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize("prefix, error", [
    ("nvmlDevice", NVML_ERROR_UNKNOWN),  # every device read
    ("nvmlDeviceGetCount", NVML_ERROR_GPU_IS_LOST),
])
async def test_node_reads_failing_keep_the_last_snapshot_served(short_tmp, raised, prefix, error):
    node = await start_daemon(sim_config(short_tmp, "A100-SXM4-40GB:2"))
    try:
        before = {path: await raw_get(node, path) for path in ("/v1/gpus", "/v1/mig")}
        node.daemon.session.nvml.sim_fail_calls(prefix, error, FOREVER)
        await node.daemon.inventory.refresh("fault matrix")
        await node.daemon.health.check_once()
        status, health = await node.get("/healthz")
        assert status == 503 and health["error"]["code"] == "inventory-failed", health
        assert health["reason"].startswith("reading the node failed: "), health
        for path, answer in before.items():
            assert await raw_get(node, path) == answer  # the last snapshot, byte for byte
        for path in READ_ROUTES + ("/metrics",):
            assert (await raw_get(node, path))[0] == 200, path
        node.daemon.session.nvml.sim_fail_calls(prefix, error, 0)
        await node.daemon.inventory.refresh("fault matrix recovery")
        await node.daemon.health.check_once()
        assert (await node.get("/healthz"))[0] == 200
        assert await raw_get(node, "/v1/gpus") == before["/v1/gpus"]
        assert node_tasks_alive(node.daemon) and not raised()
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize("prefix", ["nvmlDeviceGetHandleByIndex", "nvmlDeviceGetMigMode", "nvmlDeviceGetUUID"])
async def test_one_gpus_reads_failing_are_that_gpus_error(short_tmp, raised, prefix):
    # A read failing for each GPU (not the node's count) is each GPU's error in the snapshot, named
    # with its NVML code; once reads work again the GPUs are back as they were.
    node = await start_daemon(sim_config(short_tmp, "A100-SXM4-40GB:2"))
    try:
        before = await raw_get(node, "/v1/gpus")
        node.daemon.session.nvml.sim_fail_calls(prefix, NVML_ERROR_UNKNOWN, FOREVER)
        await node.daemon.inventory.refresh("fault matrix")
        await node.daemon.health.check_once()
        status, gpus = await node.get("/v1/gpus")
        assert_matches_openapi("GET", "/v1/gpus", status, gpus)
        assert [gpu["error"] for gpu in gpus["gpus"]] == ["Unknown Error (NVML error 999)"] * 2, gpus
        for path in READ_ROUTES + ("/metrics", "/healthz"):
            assert (await raw_get(node, path))[0] == 200, path
        node.daemon.session.nvml.sim_fail_calls(prefix, NVML_ERROR_UNKNOWN, 0)
        await node.daemon.inventory.refresh("fault matrix recovery")
        assert await raw_get(node, "/v1/gpus") == before
        assert node_tasks_alive(node.daemon) and not raised()
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize("prefix", ["nvmlDeviceGetHandleByUUID", "nvmlDeviceGetTemperature",
                                    "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetPowerUsage"])
async def test_health_readings_failing_leave_health_answering(short_tmp, raised, prefix):
    node = await start_daemon(sim_config(short_tmp, "A100-SXM4-40GB:2"))
    try:
        node.daemon.session.nvml.sim_fail_calls(prefix, NVML_ERROR_UNKNOWN, FOREVER)
        for _ in range(2):  # twice: a check compares its readings with the last ones
            await node.daemon.health.check_once()
        for path in READ_ROUTES + ("/metrics",):
            assert (await raw_get(node, path))[0] == 200, path
        status, health = await node.get("/v1/health")
        assert_matches_openapi("GET", "/v1/health", status, health)
        node.daemon.session.nvml.sim_fail_calls(prefix, NVML_ERROR_UNKNOWN, 0)
        await node.daemon.health.check_once()
        assert (await node.get("/healthz"))[0] == 200
        assert (await node.get("/v1/health"))[1]["status"] == "healthy"
        assert node_tasks_alive(node.daemon) and not raised()
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize("prefix, error", [
    ("nvmlDeviceSetMigMode", NVML_ERROR_UNKNOWN),
    ("nvmlDeviceCreateGpuInstance", NVML_ERROR_INSUFFICIENT_RESOURCES),
    ("nvmlGpuInstanceCreateComputeInstance", NVML_ERROR_UNKNOWN),
    ("nvmlGpuInstanceGetComputeInstance", NVML_ERROR_UNKNOWN),  # the reads an apply makes along the way
])
async def test_a_mig_call_failing_once_is_rolled_back_and_a_later_apply_works(short_tmp, raised, prefix, error):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:1"))
    try:
        await mig_settled(node)
        before = await mig_of_gpus(node)
        node.daemon.session.nvml.sim_fail_calls(prefix, error, 1)
        status, body = await put_layout(node, "all-balanced")
        assert status == 409 and body["error"]["code"] == "apply-failed", body
        assert "rollback failed" not in body["error"]["message"], body
        for path in READ_ROUTES + ("/metrics",):
            assert (await raw_get(node, path))[0] == 200, path
        status, mig = await node.get("/v1/mig")
        assert_matches_openapi("GET", "/v1/mig", status, mig)
        assert mig["state"] == "failed" and not mig["in_sync"]
        assert await mig_of_gpus(node) == before  # rolled back: nothing half made
        status, body = await put_layout(node, "all-balanced")
        assert status == 200 and body["in_sync"], body
        assert (await node.get("/healthz"))[0] == 200
        assert node_tasks_alive(node.daemon) and not raised()
    finally:
        await stop_daemon(node)


async def test_mig_reads_failing_during_an_apply_say_why_the_rollback_could_not_run(short_tmp, raised):
    # Guards a finding of this matrix: with the GPU's reads failing, the rollback acted on a partial
    # read (no instances seen) and reported only the driver's refusal of the mode change that
    # followed ("rollback failed: ... code 19"), not that the GPU could not be read.
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:1"))
    try:
        await mig_settled(node)
        node.daemon.session.nvml.sim_fail_calls("nvmlGpuInstanceGetComputeInstance", NVML_ERROR_UNKNOWN, FOREVER)
        status, body = await put_layout(node, "all-balanced")
        assert status == 409 and body["error"]["code"] == "apply-failed", body
        assert "rollback failed: GPU 0 could not be read: Unknown Error (NVML error 999)" in body["error"]["message"]
        for path in READ_ROUTES + ("/metrics",):
            assert (await raw_get(node, path))[0] == 200, path
        node.daemon.session.nvml.sim_fail_calls("nvmlGpuInstanceGetComputeInstance", NVML_ERROR_UNKNOWN, 0)
        status, body = await put_layout(node, "all-balanced")  # from whatever the failure left
        assert status == 200 and body["in_sync"], body
        assert node_tasks_alive(node.daemon) and not raised()
    finally:
        await stop_daemon(node)


def nvml_events_only(short_tmp):
    """A simulated node whose XIDs reach health through NVML events alone: the driver writes each to the
    kernel log too, which would report them while the events fail (tests/test_health_closed_loop.py)."""
    return sim_config(short_tmp, "A100-SXM4-40GB:2").with_overrides(**{"health.kernel_log": False})


async def xid_seen(node, gpu: int, tries: int = 150) -> bool:
    """Injects XID 79 on the GPU until health calls it unhealthy: whether NVML events arrive."""
    for _ in range(tries):
        assert (await node.post("/v1/sim/xid", {"gpu": gpu, "xid": 79}))[0] == 200
        await asyncio.sleep(0.05)
        if (await node.get("/v1/health"))[1]["gpus"][gpu]["state"] == "unhealthy":
            return True
    return False


@pytest.mark.parametrize("prefix", ["nvmlEventSetCreate", "nvmlEventSetWait"])
async def test_events_failing_are_reported_and_xids_arrive_once_they_work(short_tmp, raised, prefix):
    # Guards a finding of this matrix: with the event set failing, XIDs went unseen while /healthz
    # answered "ok"; only the log said so.
    node = await start_daemon(nvml_events_only(short_tmp))
    try:
        node.daemon.session.nvml.sim_fail_calls("nvmlEventSetWait", NVML_ERROR_UNKNOWN, 1)  # the set is made anew
        node.daemon.session.nvml.sim_fail_calls(prefix, NVML_ERROR_UNKNOWN, FOREVER)
        for _ in range(200):
            status, health = await node.get("/healthz")
            if health["status"] == "degraded":
                break
            await asyncio.sleep(0.01)
        assert status == 200 and health["status"] == "degraded", health
        assert health["problems"] == ["NVML events are not being received, XIDs go unseen: "
                                      "Unknown Error (NVML error 999)"]
        assert_matches_openapi("GET", "/healthz", status, health)
        for path in READ_ROUTES + ("/metrics",):
            assert (await raw_get(node, path))[0] == 200, path
        node.daemon.session.nvml.sim_fail_calls(prefix, NVML_ERROR_UNKNOWN, 0)
        assert await xid_seen(node, 0)  # the thread rebuilt its set once the fault healed
        assert await node.get("/healthz") == (200, {"status": "ok"})
        assert node_tasks_alive(node.daemon) and not raised()
    finally:
        await stop_daemon(node)


@pytest.mark.slow  # a GPU that could not be registered is tried again after RETRY_UNREGISTERED_S (5 s)
@pytest.mark.parametrize("prefix", ["nvmlDeviceRegisterEvents", "nvmlDeviceGetSupportedEventTypes"])
async def test_a_gpu_whose_event_registration_failed_is_registered_again(short_tmp, raised, prefix):
    node = await start_daemon(nvml_events_only(short_tmp))
    try:
        node.daemon.session.nvml.sim_fail_calls(prefix, NVML_ERROR_UNKNOWN, 1)
        node.daemon.session.nvml.sim_fail_calls("nvmlEventSetWait", NVML_ERROR_UNKNOWN, 1)  # a new set: GPU 0 fails
        assert await xid_seen(node, 1)  # the other GPU reports at once
        assert await xid_seen(node, 0)  # and GPU 0 once registered again
        assert node_tasks_alive(node.daemon) and not raised()
    finally:
        await stop_daemon(node)
