"""Read-only NVML probe for real GPUs: records what the driver answers to each read gpud makes.

Prints JSON: per call, the value or the NVMLError class and code. It never calls a Set, Create,
Destroy, Reset or Clear function. Run by scripts/hw-capture; the results feed tests/fixtures/hardware.
"""
import ctypes
import json
import os


def _recorder(N, out):
    def rec(key, fn):
        try:
            value = fn()
            if isinstance(value, bytes):
                value = value.decode(errors="replace")
            if isinstance(value, ctypes.Structure):
                value = {f[0]: _plain(getattr(value, f[0])) for f in value._fields_}
            out[key] = {"ok": _plain(value)}
        except N.NVMLError as e:
            out[key] = {"nvml_error": e.value, "class": type(e).__name__, "text": str(e)}
        except Exception as e:  # noqa: BLE001
            out[key] = {"exception": type(e).__name__, "text": str(e)}

    return rec


def _plain(v):
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, ctypes.Structure):
        return {f[0]: _plain(getattr(v, f[0])) for f in v._fields_}
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return repr(v)


def probe(N) -> dict:
    """Every read, through N: the pynvml module (or an object with its surface, such as gpud's simulator)."""
    out = {"uid": os.getuid()}
    rec = _recorder(N, out)
    N.nvmlInit()
    rec("driver", N.nvmlSystemGetDriverVersion)
    rec("nvml", N.nvmlSystemGetNVMLVersion)
    rec("cuda", N.nvmlSystemGetCudaDriverVersion_v2)
    rec("count", N.nvmlDeviceGetCount)
    for i in range(N.nvmlDeviceGetCount()):
        h = N.nvmlDeviceGetHandleByIndex(i)
        p = f"gpu{i}."
        rec(p + "name", lambda: N.nvmlDeviceGetName(h))
        rec(p + "uuid", lambda: N.nvmlDeviceGetUUID(h))
        rec(p + "serial", lambda: N.nvmlDeviceGetSerial(h))
        rec(p + "pci", lambda: N.nvmlDeviceGetPciInfo_v3(h))
        rec(p + "arch", lambda: N.nvmlDeviceGetArchitecture(h))
        rec(p + "cc", lambda: N.nvmlDeviceGetCudaComputeCapability(h))
        rec(p + "mem_v1", lambda: N.nvmlDeviceGetMemoryInfo(h))
        rec(p + "mem_v2", lambda: N.nvmlDeviceGetMemoryInfo(h, N.nvmlMemory_v2))
        rec(p + "compute_mode", lambda: N.nvmlDeviceGetComputeMode(h))
        rec(p + "persistence", lambda: N.nvmlDeviceGetPersistenceMode(h))
        rec(p + "mig_mode", lambda: N.nvmlDeviceGetMigMode(h))
        rec(p + "max_mig", lambda: N.nvmlDeviceGetMaxMigDeviceCount(h))
        rec(p + "is_mig_handle", lambda: N.nvmlDeviceIsMigDeviceHandle(h))
        for c in range(N.NVML_GPU_INSTANCE_PROFILE_COUNT):
            rec(p + f"gip_v2[{c}]", lambda: N.nvmlDeviceGetGpuInstanceProfileInfo(h, c))
            rec(p + f"gip_v1[{c}]", lambda: N.nvmlDeviceGetGpuInstanceProfileInfo(h, c, 1))
        for pid in (19, 20, 15, 14, 9, 5, 0):
            def placements():
                count = ctypes.c_uint(0)
                N.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid, None, ctypes.byref(count))
                arr = (N.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
                N.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid, arr, ctypes.byref(count))
                return [(a.start, a.size) for a in arr[:count.value]]
            rec(p + f"gipp[{pid}]", placements)
            rec(p + f"remaining[{pid}]", lambda: N.nvmlDeviceGetGpuInstanceRemainingCapacity(h, pid))
        rec(p + "supported_events", lambda: N.nvmlDeviceGetSupportedEventTypes(h))
        rec(p + "temp", lambda: N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU))
        rec(p + "temp_slowdown", lambda: N.nvmlDeviceGetTemperatureThreshold(h, N.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
        rec(p + "temp_shutdown", lambda: N.nvmlDeviceGetTemperatureThreshold(h, N.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN))
        rec(p + "power", lambda: N.nvmlDeviceGetPowerUsage(h))
        rec(p + "power_limit", lambda: N.nvmlDeviceGetEnforcedPowerLimit(h))
        rec(p + "clock_reasons", lambda: N.nvmlDeviceGetCurrentClocksEventReasons(h))
        rec(p + "ecc_mode", lambda: N.nvmlDeviceGetEccMode(h))
        rec(p + "ecc_dbe_vol", lambda: N.nvmlDeviceGetTotalEccErrors(h, 1, 0))
        rec(p + "ecc_sbe_vol", lambda: N.nvmlDeviceGetTotalEccErrors(h, 0, 0))
        rec(p + "remapped", lambda: N.nvmlDeviceGetRemappedRows(h))
        rec(p + "retired_pending", lambda: N.nvmlDeviceGetRetiredPagesPendingStatus(h))
        rec(p + "pcie_replay", lambda: N.nvmlDeviceGetPcieReplayCounter(h))
        rec(p + "procs", lambda: [(x.pid, x.usedGpuMemory) for x in N.nvmlDeviceGetComputeRunningProcesses(h)])
        rec(p + "minor", lambda: N.nvmlDeviceGetMinorNumber(h))
        rec(p + "board_id", lambda: N.nvmlDeviceGetBoardId(h))
        rec(p + "multi_gpu_board", lambda: N.nvmlDeviceGetMultiGpuBoard(h))
        rec(p + "inforom_img", lambda: N.nvmlDeviceGetInforomImageVersion(h))
        rec(p + "vbios", lambda: N.nvmlDeviceGetVbiosVersion(h))
        def fabric():
            info = N.c_nvmlGpuFabricInfoV_t()
            N.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
            return {"state": info.state, "status": info.status}
        rec(p + "fabric_v", fabric)
        for link in range(N.NVML_NVLINK_MAX_LINKS):
            rec(p + f"nvlink_state[{link}]", lambda: N.nvmlDeviceGetNvLinkState(h, link))
            rec(p + f"nvlink_cap_p2p[{link}]", lambda: N.nvmlDeviceGetNvLinkCapability(h, link, N.NVML_NVLINK_CAP_P2P_SUPPORTED))
            rec(p + f"nvlink_remote[{link}]", lambda: N.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
            rec(p + f"nvlink_version[{link}]", lambda: N.nvmlDeviceGetNvLinkVersion(h, link))
        # Event registration and a short wait (read-only).
        def events():
            es = N.nvmlEventSetCreate()
            try:
                mask = N.nvmlDeviceGetSupportedEventTypes(h) & (N.nvmlEventTypeXidCriticalError | N.nvmlEventTypeSingleBitEccError | N.nvmlEventTypeDoubleBitEccError)
                N.nvmlDeviceRegisterEvents(h, mask, es)
                try:
                    N.nvmlEventSetWait_v2(es, 10)
                    return "event"
                except N.NVMLError as e:
                    return f"wait: {type(e).__name__} {e.value}"
            finally:
                N.nvmlEventSetFree(es)
        rec(p + "events", events)
        rec(p + "mig_handle0", lambda: N.nvmlDeviceGetMigDeviceHandleByIndex(h, 0))
        rec(p + "gi_instances19", lambda: N.nvmlDeviceGetGpuInstances(h, 19, (N.c_nvmlGpuInstance_t * 7)(), ctypes.byref(ctypes.c_uint(7))))
    # handle by index out of range
    rec("handle_out_of_range", lambda: N.nvmlDeviceGetHandleByIndex(99))
    rec("handle_bad_uuid", lambda: N.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000"))
    N.nvmlShutdown()
    rec("shutdown_twice", N.nvmlShutdown)
    return out


if __name__ == "__main__":
    import pynvml

    print(json.dumps(probe(pynvml), indent=1))
