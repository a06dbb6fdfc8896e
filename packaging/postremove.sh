#!/bin/sh
# deb: "remove", "purge", "upgrade", …; rpm: 0 (erase) or 1 (the old version's files are gone after
# an upgrade). Only a purge deletes what gpud wrote.
set -e
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || true
fi
if [ "$1" = "purge" ]; then
    # What gpud itself wrote: persisted state (desired MIG layout, known GPUs) and MPS logs.
    rm -rf /var/lib/gpud /var/log/gpud /etc/gpud /run/gpud
fi
