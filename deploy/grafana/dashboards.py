#!/usr/bin/env python3
"""gpud's Grafana dashboards, built with Grafana's grafana-foundation-sdk (PyPI grafana-foundation-sdk,
github.com/grafana/grafana-foundation-sdk) rather than edited as JSON.

    python deploy/grafana/dashboards.py           writes gpud-node.json and gpud-fleet.json beside this file
    python deploy/grafana/dashboards.py --check   exits 1, naming the file, where one differs from what it builds

The queries use only series gpud writes (docs/metrics.md). Template variables appear in regex matchers
only (`hostname=~"$hostname"`), so a multi-value or "All" selection is a valid regex and a checker can
put `.*` in their place; `$__rate_interval` is the only other placeholder. The SDK release is pinned in
pyproject.toml's test extra: another release may write other JSON for the same code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders.common import ReduceDataOptions, VizLegendOptions
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (BigValueColorMode, BigValueGraphMode, BigValueTextMode,
                                                  LegendDisplayMode, LegendPlacement)
from grafana_foundation_sdk.models.dashboard import (DashboardCursorSync, DataSourceRef, DataTransformerConfig,
                                                     Threshold, ThresholdsMode, ValueMap, ValueMappingResult,
                                                     VariableRefresh, VariableSort)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

HERE = Path(__file__).resolve().parent
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")

# Matchers every query of a dashboard starts with.
HOST = 'hostname=~"$hostname"'
HOST_GPU = 'hostname=~"$hostname", gpu=~"$gpu"'
WHOLE_GPU = 'GPU_I_ID=""'  # the GPU's own series: a MIG instance's carry GPU_I_ID (docs/metrics.md, "MIG")
MIG_INSTANCE = 'GPU_I_ID!=""'
MIB = 1048576  # DCGM's framebuffer fields are in MiB (dcgm-exporter's default-counters.csv)
# One legend for per-GPU and per-MIG-instance series: Grafana leaves a label a series lacks empty.
DEVICE_LEGEND = "GPU {{gpu}} {{GPU_I_PROFILE}} {{GPU_I_ID}}"


def node_series(selector: str) -> str:
    """The node-level series gpud writes without a hostname label (gpud_health…), given the hostname of
    the gpud the same target serves: gpud_http_requests_total carries it and is always written."""
    return (f"{selector} * on (job, instance) group_left (hostname) "
            f"group by (job, instance, hostname) (gpud_http_requests_total{{{HOST}}})")


def query(ref_id: str, expr: str, legend: str = "", instant: bool = False) -> prometheus.Dataquery:
    q = prometheus.Dataquery().ref_id(ref_id).expr(expr).datasource(DATASOURCE)
    if legend:
        q = q.legend_format(legend)
    if instant:
        q = q.instant().format(PromQueryFormat.TABLE)
    else:
        q = q.range()
    return q


def mapping(states: dict[int, tuple[str, str]]) -> list[ValueMap]:
    """Value -> (text, colour): how a state gauge is shown."""
    return [ValueMap({str(value): ValueMappingResult(text=text, color=color, index=i)
                      for i, (value, (text, color)) in enumerate(states.items())})]


HEALTH = mapping({0: ("healthy", "green"), 1: ("degraded", "orange"), 2: ("unhealthy", "red")})
# nvml.h NVML_GPU_RECOVERY_ACTION_*; gpud writes the name as the `action` label and the number as value.
RECOVERY = mapping({0: ("none", "green"), 1: ("GPU reset", "orange"), 2: ("node reboot", "red"),
                    3: ("drain P2P", "orange"), 4: ("drain and reset", "red")})
# gpud's suggested action, valued by rank (gpud/health/states.py Action, weakest first).
SUGGESTED = mapping({0: ("none", "green"), 1: ("restart the application", "yellow"), 2: ("fix a service", "yellow"),
                     3: ("reset the GPU", "orange"), 4: ("reboot", "red"), 5: ("inspect the hardware", "purple")})
FABRIC = mapping({1: ("not started", "orange"), 2: ("in progress", "orange"), 3: ("completed", "green")})
UP = mapping({0: ("down", "red"), 1: ("running", "green")})
IN_SYNC = mapping({0: ("not in sync", "orange"), 1: ("in sync", "green")})


def thresholds(*steps: tuple[float | None, str]) -> dashboard.ThresholdsConfig:
    return dashboard.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(
        [Threshold(value=value, color=color) for value, color in steps])


OK_AT_ZERO = thresholds((None, "green"), (1, "red"))


def timeseries_panel(title: str, description: str, unit: str, *queries: prometheus.Dataquery,
                     width: int = 12, height: int = 8, max_value: float | None = None) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).datasource(DATASOURCE).unit(unit)
             .min(0).span(width).height(height).fill_opacity(10)
             .legend(VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST)
                     .placement(LegendPlacement.BOTTOM)))
    if max_value is not None:
        panel = panel.max(max_value)
    return panel.targets(list(queries))


def stat_panel(title: str, description: str, *queries: prometheus.Dataquery, unit: str = "none",
               mappings: list[ValueMap] | None = None, steps: dashboard.ThresholdsConfig = OK_AT_ZERO,
               no_value: str | None = None, text_mode: BigValueTextMode | None = None, width: int = 6,
               height: int = 5) -> stat.Panel:
    panel = (stat.Panel().title(title).description(description).datasource(DATASOURCE).unit(unit)
             .span(width).height(height).thresholds(steps)
             .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
             .graph_mode(BigValueGraphMode.NONE).color_mode(BigValueColorMode.BACKGROUND)
             .text_mode(text_mode or (BigValueTextMode.VALUE_AND_NAME if any(q.build().legend_format for q in queries)
                                      else BigValueTextMode.VALUE)))
    if mappings:
        panel = panel.mappings(mappings)
    if no_value is not None:
        panel = panel.no_value(no_value)
    return panel.targets(list(queries))


def table_panel(title: str, description: str, *queries: prometheus.Dataquery, rename: dict[str, str],
                unit: str = "none", mappings: list[ValueMap] | None = None, no_value: str | None = None,
                width: int = 12, height: int = 8) -> table.Panel:
    """Instant queries as one table: merged on their labels when there are several, the time column
    hidden and the value columns named."""
    transformations = [DataTransformerConfig(id_val="merge", options={})] if len(queries) > 1 else []
    transformations.append(DataTransformerConfig(id_val="organize", options={
        "excludeByName": {"Time": True}, "renameByName": rename}))
    panel = (table.Panel().title(title).description(description).datasource(DATASOURCE).unit(unit)
             .span(width).height(height).filterable(True).transformations(transformations))
    if mappings:
        panel = panel.mappings(mappings)
    if no_value is not None:
        panel = panel.no_value(no_value)
    return panel.targets(list(queries))


def datasource_variable() -> dashboard.DatasourceVariable:
    return dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")


def hostname_variable(multi: bool) -> dashboard.QueryVariable:
    variable = (dashboard.QueryVariable("hostname").label("Node").datasource(DATASOURCE)
                .query("label_values(gpud_http_requests_total, hostname)")
                .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC))
    if multi:
        variable = variable.multi(True).include_all(True).all_value(".*")
    return variable


def gpu_variable() -> dashboard.QueryVariable:
    return (dashboard.QueryVariable("gpu").label("GPU").datasource(DATASOURCE)
            .query(f"label_values(gpud_gpu_health{{{HOST}}}, gpu)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.NUMERICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))


def new_dashboard(uid: str, title: str, description: str) -> dashboard.Dashboard:
    return (dashboard.Dashboard(title).uid(uid).description(description).tags(["gpud", "nvidia", "gpu"])
            .editable().tooltip(DashboardCursorSync.CROSSHAIR).time("now-1h", "now").refresh("30s")
            .timezone("browser")
            .link(dashboard.DashboardLink("gpud dashboards").tags(["gpud"]).as_dropdown(True)
                  .include_vars(True).keep_time(True)))


def numbered(built) -> dict:
    """The dashboard as JSON, its panels numbered in order (Grafana needs an id unique in the dashboard)."""
    for number, panel in enumerate(built.panels, start=1):
        panel.id_val = number
    return json.loads(json.dumps(built, cls=JSONEncoder))


# -- one node ----------------------------------------------------------------------------------


def node_dashboard() -> dict:
    d = (new_dashboard("gpud-node", "gpud / Node",
                       "One node's GPUs as gpud reports them: health and the driver's recovery action, "
                       "utilisation and DCGM profiling, memory, clocks, temperature and power, MIG devices, "
                       "MPS daemons, XIDs and the pods using the GPUs.")
         .with_variable(datasource_variable()).with_variable(hostname_variable(multi=False))
         .with_variable(gpu_variable()))

    d = (d.with_row(dashboard.Row("Health"))
         .with_panel(stat_panel(
             "GPU health", "gpud's verdict per GPU (gpud_gpu_health): healthy, degraded (it still works) or "
             "unhealthy (taken out of service). GET /v1/health names the reasons and the suggested action.",
             query("A", f"gpud_gpu_health{{{HOST_GPU}, {WHOLE_GPU}}}", "GPU {{gpu}}"),
             mappings=HEALTH, steps=thresholds((None, "green"), (1, "orange"), (2, "red")), width=8))
         .with_panel(stat_panel(
             "Suggested action", "What gpud suggests doing about each GPU (gpud_gpu_suggested_action), the "
             "strongest its health reasons ask for: restart the application, fix a host service, reset the GPU, "
             "reboot, or have the hardware inspected. GET /v1/health says why.",
             query("A", f"gpud_gpu_suggested_action{{{HOST_GPU}}}", "GPU {{gpu}}"), mappings=SUGGESTED,
             steps=thresholds((None, "green"), (1, "yellow"), (3, "orange"), (4, "red"), (5, "purple")), width=8))
         .with_panel(stat_panel(
             "Driver's recovery action", "What the NVIDIA driver says a GPU needs (gpud_gpu_recovery_action, "
             "nvml.h NVML_GPU_RECOVERY_ACTION_*): a GPU reset, a node reboot or a drain. Drivers from R565.",
             query("A", f"gpud_gpu_recovery_action{{{HOST_GPU}}}", "GPU {{gpu}}"),
             mappings=RECOVERY, steps=thresholds((None, "green"), (1, "orange"), (2, "red")),
             no_value="not reported by this driver", width=8))
         .with_panel(stat_panel(
             "Lost GPUs", "GPUs NVML reports lost (fallen off the bus, gpud_gpu_lost): they need a reboot.",
             query("A", f"sum(gpud_gpu_lost{{{HOST_GPU}}})"), width=4))
         .with_panel(stat_panel(
             "Node checks", "The health of what is no GPU: the node (driver, fabric manager, peer memory) and "
             "its InfiniBand ports (gpud_health, by subject).",
             query("A", node_series("gpud_health"), "{{subject}}"),
             mappings=HEALTH, steps=thresholds((None, "green"), (1, "orange"), (2, "red")), width=10))
         .with_panel(stat_panel(
             "NVLink fabric", "Each GPU's NVLink fabric registration on NVSwitch systems (gpud_gpu_fabric_state); "
             "anything but completed leaves the GPU unable to run CUDA work.",
             query("A", f"gpud_gpu_fabric_state{{{HOST_GPU}}}", "GPU {{gpu}}"),
             mappings=FABRIC, steps=thresholds((None, "orange"), (3, "green")),
             no_value="no NVSwitch fabric", width=10)))

    def profiling(title: str, field: str, what: str) -> timeseries.Panel:
        return timeseries_panel(
            title, f"{what} ({field}, a ratio): DCGM's profiling field, read by gpud through NVML's GPM on Hopper "
                   "and later GPUs, per GPU and per MIG instance. No series on older GPUs.",
            "percentunit", query("A", f"{field}{{{HOST_GPU}}}", DEVICE_LEGEND), width=8, max_value=1)

    d = (d.with_row(dashboard.Row("Utilisation and profiling"))
         .with_panel(timeseries_panel(
             "GPU utilisation", "Share of time a kernel ran (DCGM_FI_DEV_GPU_UTIL). Not written for a GPU in MIG "
             "mode: see graphics engine active.",
             "percent", query("A", f"DCGM_FI_DEV_GPU_UTIL{{{HOST_GPU}}}", "GPU {{gpu}}"), width=8, max_value=100))
         .with_panel(profiling("Graphics engine active", "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
                               "Share of time the graphics or compute engine was busy"))
         .with_panel(profiling("SM active", "DCGM_FI_PROF_SM_ACTIVE",
                               "Share of time at least one warp was resident on an SM, averaged over the SMs"))
         .with_panel(profiling("SM occupancy", "DCGM_FI_PROF_SM_OCCUPANCY",
                               "Resident warps as a share of the most an SM holds"))
         .with_panel(profiling("Tensor pipe active", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
                               "Share of cycles the tensor cores were busy"))
         .with_panel(profiling("DRAM active", "DCGM_FI_PROF_DRAM_ACTIVE",
                               "Share of cycles the device memory interface was busy"))
         .with_panel(timeseries_panel(
             "FP64, FP32 and FP16 pipes active", "Share of cycles each floating-point pipe was busy "
             "(DCGM_FI_PROF_PIPE_FP64_ACTIVE, _FP32_, _FP16_): Hopper and later GPUs, per GPU and MIG instance.",
             "percentunit",
             *(query(ref, f"DCGM_FI_PROF_PIPE_{pipe}_ACTIVE{{{HOST_GPU}}}", f"{DEVICE_LEGEND} {pipe}")
               for ref, pipe in (("A", "FP64"), ("B", "FP32"), ("C", "FP16"))), width=8, max_value=1))
         .with_panel(timeseries_panel(
             "PCIe traffic", "Bytes per second over PCIe (DCGM_FI_PROF_PCIE_TX_BYTES, _RX_BYTES): Hopper and "
             "later GPUs.", "Bps",
             query("A", f"DCGM_FI_PROF_PCIE_TX_BYTES{{{HOST_GPU}}}", f"{DEVICE_LEGEND} sent"),
             query("B", f"DCGM_FI_PROF_PCIE_RX_BYTES{{{HOST_GPU}}}", f"{DEVICE_LEGEND} received"), width=8))
         .with_panel(timeseries_panel(
             "NVLink traffic", "Bytes per second over NVLink (DCGM_FI_PROF_NVLINK_TX_BYTES, _RX_BYTES): Hopper "
             "and later GPUs with NVLink.", "Bps",
             query("A", f"DCGM_FI_PROF_NVLINK_TX_BYTES{{{HOST_GPU}}}", f"{DEVICE_LEGEND} sent"),
             query("B", f"DCGM_FI_PROF_NVLINK_RX_BYTES{{{HOST_GPU}}}", f"{DEVICE_LEGEND} received"), width=8))
         .with_panel(timeseries_panel(
             "NVLink bandwidth, all links", "Received and sent over all NVLinks, in DCGM's MiB/s "
             "(DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL): every GPU with NVLink, profiling or not.",
             "MiBs", query("A", f"DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL{{{HOST_GPU}}}", "GPU {{gpu}}"), width=8))
         .with_panel(timeseries_panel(
             "Copy, encoder and decoder utilisation", "Share of time the memory copy engines, the video encoder "
             "and the decoder were busy (DCGM_FI_DEV_MEM_COPY_UTIL, _ENC_UTIL, _DEC_UTIL); not in MIG mode.",
             "percent",
             query("A", f"DCGM_FI_DEV_MEM_COPY_UTIL{{{HOST_GPU}}}", "GPU {{gpu}} copy"),
             query("B", f"DCGM_FI_DEV_ENC_UTIL{{{HOST_GPU}}}", "GPU {{gpu}} encoder"),
             query("C", f"DCGM_FI_DEV_DEC_UTIL{{{HOST_GPU}}}", "GPU {{gpu}} decoder"), width=8, max_value=100)))

    d = (d.with_row(dashboard.Row("Memory"))
         .with_panel(timeseries_panel(
             "Framebuffer used", "Device memory in use (DCGM_FI_DEV_FB_USED), per GPU and per MIG instance: a "
             "GPU in MIG mode shows its total beside its instances.",
             "bytes", query("A", f"DCGM_FI_DEV_FB_USED{{{HOST_GPU}}} * {MIB}", DEVICE_LEGEND), width=8))
         .with_panel(timeseries_panel(
             "Framebuffer free", "Device memory free (DCGM_FI_DEV_FB_FREE), per GPU and per MIG instance.",
             "bytes", query("A", f"DCGM_FI_DEV_FB_FREE{{{HOST_GPU}}} * {MIB}", DEVICE_LEGEND), width=8))
         .with_panel(timeseries_panel(
             "Framebuffer used, share", "Used as a share of used and free (what the driver reserves left out).",
             "percentunit",
             query("A", f"DCGM_FI_DEV_FB_USED{{{HOST_GPU}}} / (DCGM_FI_DEV_FB_USED{{{HOST_GPU}}} + "
                        f"DCGM_FI_DEV_FB_FREE{{{HOST_GPU}}})", DEVICE_LEGEND), width=8, max_value=1)))

    d = (d.with_row(dashboard.Row("Clocks, temperature and power"))
         .with_panel(timeseries_panel(
             "Clocks", "SM and memory clocks (DCGM_FI_DEV_SM_CLOCK, _MEM_CLOCK, MHz).", "hertz",
             query("A", f"DCGM_FI_DEV_SM_CLOCK{{{HOST_GPU}}} * 1000000", "GPU {{gpu}} SM"),
             query("B", f"DCGM_FI_DEV_MEM_CLOCK{{{HOST_GPU}}} * 1000000", "GPU {{gpu}} memory"), width=6))
         .with_panel(timeseries_panel(
             "Temperature", "GPU and memory temperature (DCGM_FI_DEV_GPU_TEMP, _MEMORY_TEMP: HBM boards only).",
             "celsius",
             query("A", f"DCGM_FI_DEV_GPU_TEMP{{{HOST_GPU}}}", "GPU {{gpu}}"),
             query("B", f"DCGM_FI_DEV_MEMORY_TEMP{{{HOST_GPU}}}", "GPU {{gpu}} memory"), width=6))
         .with_panel(timeseries_panel(
             "Power", "Power drawn (DCGM_FI_DEV_POWER_USAGE).", "watt",
             query("A", f"DCGM_FI_DEV_POWER_USAGE{{{HOST_GPU}}}", "GPU {{gpu}}"), width=6))
         .with_panel(timeseries_panel(
             "PCIe replays", "PCIe replays per second (DCGM_FI_DEV_PCIE_REPLAY_COUNTER): a rising rate points "
             "at a bad link or riser.", "cps",
             query("A", f"rate(DCGM_FI_DEV_PCIE_REPLAY_COUNTER{{{HOST_GPU}}}[$__rate_interval])", "GPU {{gpu}}"),
             width=6)))

    d = (d.with_row(dashboard.Row("MIG devices"))
         .with_panel(stat_panel(
             "MIG layout", "Whether every GPU has the MIG layout gpud was asked for (gpud_mig_in_sync); GET "
             "/v1/mig says what is pending or failed.",
             query("A", f"gpud_mig_in_sync{{{HOST}}}"), mappings=IN_SYNC,
             steps=thresholds((None, "orange"), (1, "green")), width=4, height=8))
         .with_panel(stat_panel(
             "MIG apply", "The state of gpud's last MIG apply (gpud_mig_apply_state): success, pending, applying, "
             "failed, or reset-required (a mode change waits for a GPU reset or a reboot).",
             query("A", f"gpud_mig_apply_state{{{HOST}}} == 1", "{{state}}"),
             steps=thresholds((None, "blue")), text_mode=BigValueTextMode.NAME, width=4, height=8))
         .with_panel(table_panel(
             "MIG devices", "Each MIG device: its GPU, profile, GPU instance and UUID, and its health.",
             query("A", f"max by (gpu, GPU_I_PROFILE, GPU_I_ID, mig_uuid) "
                        f"(gpud_gpu_health{{{HOST_GPU}, {MIG_INSTANCE}}})", instant=True),
             rename={"Value": "health", "GPU_I_PROFILE": "profile", "GPU_I_ID": "GPU instance",
                     "mig_uuid": "MIG device"},
             mappings=HEALTH, no_value="no GPU in MIG mode", width=8))
         .with_panel(timeseries_panel(
             "MIG device memory used", "Device memory in use per MIG instance (DCGM_FI_DEV_FB_USED with GPU_I_ID).",
             "bytes", query("A", f"DCGM_FI_DEV_FB_USED{{{HOST_GPU}, {MIG_INSTANCE}}} * {MIB}", DEVICE_LEGEND),
             width=8)))

    d = (d.with_row(dashboard.Row("MPS"))
         .with_panel(stat_panel(
             "MPS daemons", "Each MPS control daemon gpud runs (gpud_mps_daemon_up), one per GPU or MIG device.",
             query("A", f"gpud_mps_daemon_up{{{HOST}}}", "{{daemon}}"), mappings=UP,
             steps=thresholds((None, "red"), (1, "green")), no_value="MPS not enabled", width=8, height=8))
         .with_panel(stat_panel(
             "MPS daemon restarts", "Restarts of each MPS control daemon since gpud started "
             "(gpud_mps_daemon_restarts_total).",
             query("A", f"gpud_mps_daemon_restarts_total{{{HOST}}}", "{{daemon}}"),
             steps=thresholds((None, "green"), (1, "orange")), no_value="MPS not enabled", width=4, height=8))
         .with_panel(timeseries_panel(
             "Compute processes", "Compute processes on each GPU and MIG device (gpud_device_compute_processes), "
             "the clients of its MPS daemon among them.",
             "none", query("A", f"gpud_device_compute_processes{{{HOST_GPU}}}", DEVICE_LEGEND), width=12))
         .with_panel(table_panel(
             "Processes on the GPUs", "GPU memory per compute process, with its owner: container or systemd "
             "unit (gpud_process_gpu_memory_used_bytes). Scraped over metrics.listen only with "
             "metrics.listen_process_series: true.",
             query("A", f"max by (gpu, GPU_I_ID, pid, comm, owner, container_id, pod_uid, systemd_unit) "
                        f"(gpud_process_gpu_memory_used_bytes{{{HOST_GPU}}})", instant=True),
             rename={"Value": "GPU memory", "GPU_I_ID": "GPU instance"}, unit="bytes",
             no_value="no compute process, or process series not scraped", width=24)))

    d = (d.with_row(dashboard.Row("XIDs and memory errors"))
         .with_panel(timeseries_panel(
             "XIDs per second", "XID errors per GPU and XID (DCGM_EXP_XID_ERRORS_TOTAL); docs/health.md says "
             "what each asks for.", "cps",
             query("A", f"sum by (gpu, xid) (rate(DCGM_EXP_XID_ERRORS_TOTAL{{{HOST_GPU}}}[$__rate_interval]))",
                   "GPU {{gpu}} XID {{xid}}"), width=12))
         .with_panel(table_panel(
             "Last XID", "The last XID seen on each GPU (DCGM_FI_DEV_XID_ERRORS, err_code 0: none).",
             query("A", f"max by (gpu, err_code, err_msg) (DCGM_FI_DEV_XID_ERRORS{{{HOST_GPU}}})", instant=True),
             rename={"Value": "XID", "err_code": "code", "err_msg": "meaning"}, width=12))
         .with_panel(table_panel(
             "Memory errors", "Volatile ECC errors and row remapping per GPU (DCGM_FI_DEV_ECC_SBE_VOL_TOTAL, "
             "_ECC_DBE_VOL_TOTAL, _UNCORRECTABLE_REMAPPED_ROWS, _ROW_REMAP_FAILURE): a row remap failure or "
             "uncorrectable errors ask for the GPU's inspection.",
             *(query(ref, f"max by (gpu) ({series}{{{HOST_GPU}}})", instant=True) for ref, series in (
                 ("A", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"), ("B", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"),
                 ("C", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"), ("D", "DCGM_FI_DEV_ROW_REMAP_FAILURE"))),
             rename={"Value #A": "correctable (SBE)", "Value #B": "uncorrectable (DBE)",
                     "Value #C": "rows remapped, uncorrectable", "Value #D": "row remap failed"},
             width=24, height=6)))

    pods = f'{HOST_GPU}, pod!=""'
    dra = f'{HOST_GPU}, dra_claim_name!=""'
    d = (d.with_row(dashboard.Row("Pods"))
         .with_panel(table_panel(
             "Devices allocated to pods", "Each GPU and MIG device allocated to a container, from the kubelet's "
             "PodResources API (the pod, namespace and container labels, as dcgm-exporter writes them).",
             query("A", f"max by (namespace, pod, container, gpu, GPU_I_PROFILE, GPU_I_ID, UUID) "
                        f"(gpud_gpu_health{{{pods}}})", instant=True),
             rename={"Value": "health", "GPU_I_PROFILE": "profile", "GPU_I_ID": "GPU instance"},
             mappings=HEALTH, no_value="no device allocated to a pod", width=24))
         .with_panel(timeseries_panel(
             "GPU memory by pod", "Device memory in use on the devices each pod holds (DCGM_FI_DEV_FB_USED).",
             "bytes",
             query("A", f"sum by (namespace, pod) (max by (namespace, pod, UUID, GPU_I_ID) "
                        f"(DCGM_FI_DEV_FB_USED{{{pods}}})) * {MIB}", "{{namespace}}/{{pod}}")))
         .with_panel(timeseries_panel(
             "Graphics engine active by pod", "Mean busy share of the devices each pod holds "
             "(DCGM_FI_PROF_GR_ENGINE_ACTIVE: Hopper and later).", "percentunit",
             query("A", f"avg by (namespace, pod) (max by (namespace, pod, UUID, GPU_I_ID) "
                        f"(DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{pods}}}))", "{{namespace}}/{{pod}}"), max_value=1))
         .with_panel(table_panel(
             "DRA claims", "Devices allocated through Dynamic Resource Allocation: the claim, driver, pool and "
             "device (dcgm-exporter's dra_* labels).",
             query("A", "max by (dra_claim_namespace, dra_claim_name, dra_driver_name, dra_pool_name, "
                        "dra_device_name, dra_mig_profile, namespace, pod, container, gpu, GPU_I_ID) "
                        f"(gpud_gpu_health{{{dra}}})", instant=True),
             rename={"Value": "health", "GPU_I_ID": "GPU instance"}, mappings=HEALTH,
             no_value="no DRA allocation", width=24)))
    return numbered(d.build())


# -- the fleet ---------------------------------------------------------------------------------


def fleet_dashboard() -> dict:
    whole = f"{HOST}, {WHOLE_GPU}"
    d = (new_dashboard("gpud-fleet", "gpud / Fleet",
                       "Every node gpud runs on: nodes with sick or lost GPUs, the driver's recovery actions, "
                       "XID rates, utilisation, MIG and MPS state, and GPUs in use by namespace.")
         .with_variable(datasource_variable()).with_variable(hostname_variable(multi=True)))

    d = (d.with_row(dashboard.Row("Health"))
         .with_panel(stat_panel("Nodes", "Nodes whose gpud Prometheus scrapes.",
                                query("A", f"count(group by (hostname) (gpud_http_requests_total{{{HOST}}}))"),
                                steps=thresholds((None, "blue")), width=4))
         .with_panel(stat_panel("GPUs", "GPUs gpud manages (gpud_gpu_health, whole GPUs).",
                                query("A", f"count(gpud_gpu_health{{{whole}}})"),
                                steps=thresholds((None, "blue")), width=4))
         .with_panel(stat_panel("Unhealthy GPUs", "GPUs gpud found unhealthy (gpud_gpu_health 2).",
                                query("A", f"count(gpud_gpu_health{{{whole}}} == 2) or vector(0)"), width=4))
         .with_panel(stat_panel("Degraded GPUs", "GPUs gpud found degraded (gpud_gpu_health 1).",
                                query("A", f"count(gpud_gpu_health{{{whole}}} == 1) or vector(0)"),
                                steps=thresholds((None, "green"), (1, "orange")), width=4))
         .with_panel(stat_panel("Lost GPUs", "GPUs NVML reports lost (gpud_gpu_lost): each needs a reboot.",
                                query("A", f"sum(gpud_gpu_lost{{{HOST}}})"), width=4))
         .with_panel(stat_panel("MIG layouts not in sync", "Nodes whose MIG layout is pending or failed "
                                "(gpud_mig_in_sync 0).",
                                query("A", f"count(gpud_mig_in_sync{{{HOST}}} == 0) or vector(0)"),
                                steps=thresholds((None, "green"), (1, "orange")), width=4))
         .with_panel(table_panel(
             "Nodes with sick GPUs", "Nodes with a degraded or unhealthy GPU: how many, and the worst state. "
             "The node dashboard and GET /v1/health say why.",
             query("A", f"count by (hostname) (gpud_gpu_health{{{whole}}} > 0)", instant=True),
             query("B", f"max by (hostname) (gpud_gpu_health{{{whole}}}) > 0", instant=True),
             rename={"Value #A": "sick GPUs", "Value #B": "worst"}, mappings=HEALTH,
             no_value="every GPU is healthy", width=8))
         .with_panel(stat_panel(
             "GPUs by suggested action", "GPUs per action gpud suggests (gpud_gpu_suggested_action): the node "
             "dashboard and GET /v1/health say why.",
             query("A", f"count by (action) (gpud_gpu_suggested_action{{{HOST}}})", "{{action}}"),
             steps=thresholds((None, "blue")), width=8))
         .with_panel(stat_panel(
             "GPUs by the driver's recovery action", "GPUs per recovery action the NVIDIA driver asks for "
             "(gpud_gpu_recovery_action: drivers from R565).",
             query("A", f"count by (action) (gpud_gpu_recovery_action{{{HOST}}})", "{{action}}"),
             steps=thresholds((None, "blue")), no_value="not reported by these drivers", width=8))
         .with_panel(table_panel(
             "Which GPUs are lost", "Each GPU NVML reports lost (gpud_gpu_lost).",
             query("A", f"max by (hostname, gpu, UUID, pci_bus_id) (gpud_gpu_lost{{{HOST}}}) == 1", instant=True),
             rename={"Value": "lost"}, no_value="no GPU lost", width=8, height=6))
         .with_panel(table_panel(
             "Node checks failing", "What is no GPU and is not healthy: the node or an InfiniBand port "
             "(gpud_health).",
             query("A", node_series("(gpud_health > 0)"), instant=True),
             rename={"Value": "health"}, mappings=HEALTH, no_value="every node check passes", width=16,
             height=6)))

    d = (d.with_row(dashboard.Row("XIDs"))
         .with_panel(timeseries_panel(
             "XID rate by node", "XID errors per second on each node's GPUs (DCGM_EXP_XID_ERRORS_TOTAL).", "cps",
             query("A", f"sum by (hostname) (rate(DCGM_EXP_XID_ERRORS_TOTAL{{{HOST}}}[$__rate_interval]))",
                   "{{hostname}}")))
         .with_panel(table_panel(
             "XIDs in the last 5 minutes", "XIDs per node and XID over the last 5 minutes "
             "(DCGM_EXP_XID_ERRORS_COUNT).",
             query("A", f'sum by (hostname, xid) (DCGM_EXP_XID_ERRORS_COUNT{{{HOST}, xid!=""}}) > 0', instant=True),
             rename={"Value": "XIDs"}, no_value="no XID in the last 5 minutes")))

    d = (d.with_row(dashboard.Row("Utilisation"))
         .with_panel(timeseries_panel(
             "GPU utilisation by node", "Mean DCGM_FI_DEV_GPU_UTIL over each node's GPUs (GPUs in MIG mode have "
             "none).", "percent", query("A", f"avg by (hostname) (DCGM_FI_DEV_GPU_UTIL{{{HOST}}})", "{{hostname}}"),
             width=8, max_value=100))
         .with_panel(timeseries_panel(
             "Graphics engine active by node", "Mean DCGM_FI_PROF_GR_ENGINE_ACTIVE over each node's whole GPUs "
             "(Hopper and later).", "percentunit",
             query("A", f"avg by (hostname) (DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{whole}}})", "{{hostname}}"),
             width=8, max_value=1))
         .with_panel(timeseries_panel(
             "Tensor pipe active by node", "Mean DCGM_FI_PROF_PIPE_TENSOR_ACTIVE over each node's whole GPUs "
             "(Hopper and later).", "percentunit",
             query("A", f"avg by (hostname) (DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{{whole}}})", "{{hostname}}"),
             width=8, max_value=1))
         .with_panel(timeseries_panel(
             "Framebuffer used by node", "Device memory in use on each node's GPUs (DCGM_FI_DEV_FB_USED).",
             "bytes", query("A", f"sum by (hostname) (DCGM_FI_DEV_FB_USED{{{whole}}}) * {MIB}", "{{hostname}}")))
         .with_panel(timeseries_panel(
             "Power by node", "Power drawn by each node's GPUs (DCGM_FI_DEV_POWER_USAGE).", "watt",
             query("A", f"sum by (hostname) (DCGM_FI_DEV_POWER_USAGE{{{HOST}}})", "{{hostname}}"))))

    d = (d.with_row(dashboard.Row("MIG, MPS and Kubernetes"))
         .with_panel(table_panel(
             "MIG apply state", "Each node's last MIG apply (gpud_mig_apply_state: success, pending, applying, "
             "failed, reset-required) and whether its GPUs have the layout asked for (gpud_mig_in_sync).",
             query("A", f"max by (hostname, state) (gpud_mig_in_sync{{{HOST}}} * on (job, instance) "
                        f"group_left (state) (gpud_mig_apply_state{{{HOST}}} == 1))", instant=True),
             rename={"state": "last apply", "Value": "layout"}, mappings=IN_SYNC, width=6))
         .with_panel(stat_panel(
             "MIG devices by profile", "MIG devices across the nodes, per profile (gpud_gpu_health with GPU_I_ID).",
             query("A", f"count by (GPU_I_PROFILE) (gpud_gpu_health{{{HOST}, {MIG_INSTANCE}}})",
                   "{{GPU_I_PROFILE}}"),
             steps=thresholds((None, "blue")), no_value="no GPU in MIG mode", width=6, height=8))
         .with_panel(table_panel(
             "MPS daemons", "MPS control daemons per node: running, and down (gpud_mps_daemon_up).",
             query("A", f"sum by (hostname) (gpud_mps_daemon_up{{{HOST}}})", instant=True),
             query("B", f"sum by (hostname) (gpud_mps_daemon_up{{{HOST}}} == bool 0)", instant=True),
             rename={"Value #A": "running", "Value #B": "down"}, no_value="MPS not enabled", width=6))
         .with_panel(table_panel(
             "Devices in use by namespace", "GPUs and MIG devices allocated to pods, per namespace (the "
             "Kubernetes labels gpud takes from the kubelet's PodResources API).",
             query("A", f'count by (namespace) (group by (namespace, hostname, UUID, GPU_I_ID) '
                        f'(gpud_gpu_health{{{HOST}, pod!=""}}))', instant=True),
             rename={"Value": "devices"}, no_value="no device allocated to a pod", width=6)))
    return numbered(d.build())


DASHBOARDS = {"gpud-node.json": node_dashboard, "gpud-fleet.json": fleet_dashboard}


def render() -> dict[str, str]:
    """File name -> the JSON text it should hold."""
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = HERE / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    for name in stale:
        print(f"{HERE / name} differs from what {Path(__file__).name} builds: run it to rebuild", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
