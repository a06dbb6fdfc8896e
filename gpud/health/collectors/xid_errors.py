"""XIDs as dcgm-exporter counts them: the last XID of each GPU, those of the last window, and all."""

from __future__ import annotations

from typing import Iterator

from gpud.base.samples import Family
from gpud.health.collectors import LabelledGpus
from gpud.health.xid_counter import XID_WINDOW_MS, XidCounter

NO_XID = "No Error"  # dcgm-exporter's err_msg for err_code 0 (internal/pkg/collector/xid_errors.go)


def collect(gpus: LabelledGpus, xids: XidCounter) -> Iterator[Family]:
    last_xid = Family("DCGM_FI_DEV_XID_ERRORS", "The last XID error seen on the GPU (0: none).", "gauge")
    for gpu, labels in gpus:
        xid = xids.last_xid.get(gpu.uuid, (0, 0.0))[0]
        last_xid.add({**labels, "err_code": str(xid), "err_msg": xids.catalog.info(xid).name if xid else NO_XID},
                     xid)
    yield last_xid
    window = Family("DCGM_EXP_XID_ERRORS_COUNT", "XID errors seen in the last window_size_in_ms, by XID.", "gauge")
    in_window = xids.in_window()
    for gpu, labels in gpus:
        labels = {**labels, "window_size_in_ms": str(XID_WINDOW_MS)}
        counts = sorted((xid, count) for (uuid, xid), count in in_window.items() if uuid == gpu.uuid)
        for xid, count in counts or [(None, 0)]:  # a GPU without XIDs in the window counts 0, without an xid
            window.add(labels if xid is None else {**labels, "xid": str(xid)}, count)
    yield window
    totals = {"DCGM_EXP_XID_ERRORS_TOTAL": "XID errors seen, by XID.",
              "gpud_xid_errors_total": "XID errors seen, by GPU and XID (as DCGM_EXP_XID_ERRORS_TOTAL)."}
    by_uuid = {gpu.uuid: labels for gpu, labels in gpus}
    for name, help_text in totals.items():
        family = Family(name, help_text, "counter")
        for (uuid, xid), count in sorted(xids.counts.items()):
            if uuid in by_uuid:
                family.add({**by_uuid[uuid], "xid": str(xid)}, count)
        yield family
