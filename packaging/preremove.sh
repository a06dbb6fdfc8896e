#!/bin/sh
# deb: "remove" or "upgrade"; rpm: 0 (erase) or 1 (upgrade). Stop only when gpud goes away.
set -e
if [ "$1" = "remove" ] || [ "$1" = "0" ]; then
    if [ -d /run/systemd/system ]; then
        systemctl disable --now gpud-device-plugin.service gpud.service gpud.socket >/dev/null 2>&1 || true
    else
        systemctl disable gpud-device-plugin.service gpud.service >/dev/null 2>&1 || true
    fi
    # gpud leaves its MPS control daemons running across its own restarts (KillMode=process);
    # when gpud itself goes away, they go too.
    for pipe in /run/gpud/mps/*/pipe; do
        [ -S "$pipe/control" ] || continue
        echo quit | CUDA_MPS_PIPE_DIRECTORY="$pipe" timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1 || true
    done
fi
