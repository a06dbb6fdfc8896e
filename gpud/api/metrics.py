"""GET /metrics: Prometheus text, with dcgm-exporter's metric and label names where they exist,
so existing dashboards and alerts keep working; gpud's own state as gpud_* metrics."""

from __future__ import annotations

import socket

from aiohttp import web

from gpud.api.latency import BUCKETS_S, SAMPLE_EVERY, RequestLatency
from gpud.health.service import HealthService
from gpud.inventory import Gpu, InventoryService
from gpud.mig.reconciler import MigReconciler
from gpud.mps.manager import MpsManager

HEALTH_VALUES = {"healthy": 0, "degraded": 1, "unhealthy": 2}
# (metric, help, type, reading attribute)
GPU_READINGS = (
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (C).", "gauge", "temperature_c"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (W).", "gauge", "power_w"),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (MiB).", "gauge", "fb_used_mib"),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (MiB).", "gauge", "fb_free_mib"),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Single-bit ECC errors since the last reset.", "counter", "ecc_sbe_volatile"),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Double-bit ECC errors since the last reset.", "counter", "ecc_dbe_volatile"),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "Rows remapped for correctable errors.", "counter",
     "remapped_correctable"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "Rows remapped for uncorrectable errors.", "counter",
     "remapped_uncorrectable"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether row remapping has failed.", "gauge", "remap_failed"),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "PCIe replays.", "counter", "pcie_replays"),
)


class MetricsRoute:
    def __init__(self, inventory: InventoryService, health: HealthService, mig: MigReconciler, mps: MpsManager,
                 latency: RequestLatency):
        self.inventory, self.health, self.mig, self.mps, self.latency = inventory, health, mig, mps, latency
        self.hostname = socket.gethostname()

    def register(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self.get)

    async def get(self, request: web.Request) -> web.Response:
        return web.Response(text=self.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    def render(self) -> str:
        out = _Writer()
        inventory = self.inventory.current
        gpus = [g for g in (inventory.gpus if inventory else ())]
        for name, help_text, kind, attribute in GPU_READINGS:
            out.family(name, help_text, kind)
            for gpu in gpus:
                readings = self.health.readings.get(gpu.uuid)
                value = getattr(readings, attribute, None) if readings else None
                if value is not None:
                    out.sample(name, self._gpu_labels(gpu), float(value))
        out.family("DCGM_FI_DEV_XID_ERRORS", "The last XID error seen on the GPU.", "gauge")
        for gpu in gpus:
            if gpu.uuid in self.health.last_xid:
                out.sample("DCGM_FI_DEV_XID_ERRORS", self._gpu_labels(gpu), self.health.last_xid[gpu.uuid][0])
        out.family("gpud_xid_errors_total", "XID errors seen, by GPU and XID.", "counter")
        by_uuid = {g.uuid: g for g in gpus}
        for (uuid, xid), count in sorted(self.health.xid_counts.items()):
            if uuid in by_uuid:
                out.sample("gpud_xid_errors_total", {**self._gpu_labels(by_uuid[uuid]), "xid": str(xid)}, count)
        self._render_health(out, gpus)
        out.family("gpud_mig_in_sync", "1 when every GPU has the desired MIG layout.", "gauge")
        out.sample("gpud_mig_in_sync", {"hostname": self.hostname},
                   1 if self.mig.view(inventory)["in_sync"] or not self.mig.desired else 0)
        out.family("gpud_mps_daemon_up", "1 when the MPS control daemon runs.", "gauge")
        for daemon in self.mps.daemons.values():
            out.sample("gpud_mps_daemon_up", {"daemon": daemon.spec.name, "hostname": self.hostname},
                       1 if daemon.state == "running" else 0)
        out.family("gpud_mps_daemon_restarts_total", "Restarts of the MPS control daemon.", "counter")
        for daemon in self.mps.daemons.values():
            out.sample("gpud_mps_daemon_restarts_total", {"daemon": daemon.spec.name, "hostname": self.hostname},
                       daemon.restarts)
        self._render_latency(out)
        return out.text()

    def _render_latency(self, out: "_Writer") -> None:
        out.family("gpud_http_requests_total", "API requests served.", "counter")
        out.sample("gpud_http_requests_total", {"hostname": self.hostname}, self.latency.requests)
        name = "gpud_http_request_duration_seconds"
        out.family(name, f"API request latency by method and route, sampled: one request in {SAMPLE_EVERY}.",
                   "histogram")
        for (method, route), entry in sorted(self.latency.routes.items()):
            labels = {"method": method, "route": route}
            cumulative = 0
            for bound, count in zip(BUCKETS_S, entry):
                cumulative += count
                out.sample(f"{name}_bucket", {**labels, "le": f"{bound:g}"}, cumulative)
            out.sample(f"{name}_bucket", {**labels, "le": "+Inf"}, entry[-1])
            out.sample(f"{name}_sum", labels, entry[-2])
            out.sample(f"{name}_count", labels, entry[-1])

    def _render_health(self, out: "_Writer", gpus: list[Gpu]) -> None:
        states = self.health.tracker.gpu_states()
        out.family("gpud_gpu_health", "Device health: 0 healthy, 1 degraded, 2 unhealthy.", "gauge")
        for gpu in gpus:
            labels = self._gpu_labels(gpu)
            out.sample("gpud_gpu_health", labels, HEALTH_VALUES.get(states.get(gpu.uuid, "healthy"), 2))
            for dev in gpu.mig.devices:
                mig_labels = {**labels, "GPU_I_ID": str(dev.gi_id), "GPU_I_PROFILE": dev.profile, "mig_uuid": dev.uuid}
                out.sample("gpud_gpu_health", mig_labels, HEALTH_VALUES.get(states.get(dev.uuid, "healthy"), 2))
        out.family("gpud_gpu_lost", "1 when NVML reports the GPU lost.", "gauge")
        for gpu in gpus:
            out.sample("gpud_gpu_lost", self._gpu_labels(gpu), 1 if gpu.lost else 0)

    def _gpu_labels(self, gpu: Gpu) -> dict[str, str]:
        return {"gpu": str(gpu.index), "UUID": gpu.uuid, "pci_bus_id": gpu.pci_bus_id, "device": f"nvidia{gpu.index}",
                "modelName": gpu.name, "hostname": self.hostname}


class _Writer:
    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(self, name: str, help_text: str, kind: str) -> None:
        self._lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]

    def sample(self, name: str, labels: dict[str, str], value: float) -> None:
        rendered = ",".join(f'{key}="{_escape(val)}"' for key, val in labels.items())
        self._lines.append(f"{name}{{{rendered}}} {value:g}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
