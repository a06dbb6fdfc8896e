"""InfiniBand and RoCE ports as node_exporter's infiniband collector writes them."""

from __future__ import annotations

from typing import Iterator, Sequence

from gpud.base.samples import Family
from gpud.health.infiniband import IbPort

# node_exporter's infiniband collector, names and types as in prometheus/node_exporter
# collector/infiniband_linux.go (commit af65f85cb3c563988e47f7053800826c6d683a89), with the counter files
# as prometheus/procfs sysfs/class_infiniband.go (commit cff69b9d9aa77a0793276da74310e38422864e28) maps
# them. Labels: device, port. node_infiniband_info (board_id, fw_ver, hca_type) is not written: IbPort
# does not carry the device's attributes.
_GAUGES = {  # name suffix -> (help, value of a port)
    "state_id": ("State of the InfiniBand port (0: no change, 1: down, 2: init, 3: armed, 4: active, "
                 "5: act defer)", lambda p: p.state_id),
    "physical_state_id": ("Physical state of the InfiniBand port (1: sleep, 2: polling, 3: disabled, "
                          "4: port configuration training, 5: link up, 6: link error recovery, 7: phy test)",
                          lambda p: p.phys_state_id),
    "rate_bytes_per_second": ("The port's signalling rate in bytes per second (`rate` in Gb/s times 125000000)",
                              lambda p: None if p.rate_gbps is None else int(p.rate_gbps * 125_000_000)),
}
# counter file -> (name suffix, help, multiplier). port_rcv_data and port_xmit_data (and their 64-bit
# counters_ext twins) count 4-byte words: procfs multiplies them by 4, so do we.
_COUNTERS = {
    "port_multicast_rcv_packets": ("legacy_multicast_packets_received_total",
        "Multicast packets received (counters_ext)", 1),
    "port_multicast_xmit_packets": ("legacy_multicast_packets_transmitted_total",
        "Multicast packets transmitted (counters_ext)", 1),
    "port_rcv_data_64": ("legacy_data_received_bytes_total", "Bytes received on all links (counters_ext)", 4),
    "port_rcv_packets_64": ("legacy_packets_received_total", "Packets received on all links (counters_ext)", 1),
    "port_unicast_rcv_packets": ("legacy_unicast_packets_received_total",
        "Unicast packets received (counters_ext)", 1),
    "port_unicast_xmit_packets": ("legacy_unicast_packets_transmitted_total",
        "Unicast packets transmitted (counters_ext)", 1),
    "port_xmit_data_64": ("legacy_data_transmitted_bytes_total", "Bytes transmitted on all links (counters_ext)", 4),
    "port_xmit_packets_64": ("legacy_packets_transmitted_total",
        "Packets transmitted on all links (counters_ext)", 1),
    "excessive_buffer_overrun_errors": ("excessive_buffer_overrun_errors_total",
        "Times OverrunErrors consecutive flow control update periods each had an overrun", 1),
    "link_downed": ("link_downed_total", "Times the link failed to recover from an error and went down", 1),
    "link_error_recovery": ("link_error_recovery_total", "Times the link recovered from an error by retraining", 1),
    "local_link_integrity_errors": ("local_link_integrity_errors_total",
        "Times local physical errors exceeded the LocalPhyErrors threshold", 1),
    "multicast_rcv_packets": ("multicast_packets_received_total", "Multicast packets received, errors included", 1),
    "multicast_xmit_packets": ("multicast_packets_transmitted_total",
        "Multicast packets transmitted, errors included", 1),
    "port_rcv_constraint_errors": ("port_constraint_errors_received_total",
        "Received packets discarded by the switch port's constraints", 1),
    "port_xmit_constraint_errors": ("port_constraint_errors_transmitted_total",
        "Packets not transmitted for the switch port's constraints", 1),
    "port_rcv_data": ("port_data_received_bytes_total", "Bytes received on all links", 4),
    "port_xmit_data": ("port_data_transmitted_bytes_total", "Bytes transmitted on all links", 4),
    "port_rcv_discards": ("port_discards_received_total", "Inbound packets discarded: the port down or congested", 1),
    "port_xmit_discards": ("port_discards_transmitted_total",
        "Outbound packets discarded: the port down or congested", 1),
    "port_rcv_errors": ("port_errors_received_total", "Packets received with an error", 1),
    "port_rcv_packets": ("port_packets_received_total", "Packets received on all VLs, errors included", 1),
    "port_xmit_packets": ("port_packets_transmitted_total", "Packets transmitted on all VLs, errors included", 1),
    "port_xmit_wait": ("port_transmit_wait_total", "Ticks with data to transmit and none sent", 1),
    "unicast_rcv_packets": ("unicast_packets_received_total", "Unicast packets received, errors included", 1),
    "unicast_xmit_packets": ("unicast_packets_transmitted_total", "Unicast packets transmitted, errors included", 1),
    "port_rcv_remote_physical_errors": ("port_receive_remote_physical_errors_total",
        "Packets received marked with the EBP delimiter", 1),
    "port_rcv_switch_relay_errors": ("port_receive_switch_relay_errors_total",
        "Packets the switch could not forward", 1),
    "symbol_error": ("symbol_error_total", "Minor link errors detected on one or more physical lanes", 1),
    "VL15_dropped": ("vl15_dropped_total", "Incoming VL15 packets dropped for lack of resources", 1),
}
PREFIX = "node_infiniband_"


def collect(ports: Sequence[IbPort]) -> Iterator[Family]:
    """The ports as node_exporter's infiniband collector writes them; a value not read is left out."""
    for suffix, (help_text, value_of) in _GAUGES.items():
        family = Family(PREFIX + suffix, help_text, "gauge")
        for port in ports:
            value = value_of(port)
            if value is not None:
                family.add(_labels(port), value)
        if family.samples:
            yield family
    for counter, (suffix, help_text, multiplier) in _COUNTERS.items():
        family = Family(PREFIX + suffix, help_text, "counter")
        for port in ports:
            if counter in port.counters:
                family.add(_labels(port), port.counters[counter] * multiplier)
        if family.samples:
            yield family


def _labels(port: IbPort) -> dict[str, str]:
    return {"device": port.device, "port": str(port.port)}
