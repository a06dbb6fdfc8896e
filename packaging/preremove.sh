#!/bin/sh
# deb: "remove" or "upgrade"; rpm: 0 (erase) or 1 (upgrade). Stop only when gpud goes away.
set -e
if [ "$1" = "remove" ] || [ "$1" = "0" ]; then
    if [ -d /run/systemd/system ]; then
        systemctl disable --now gpud.service gpud.socket >/dev/null 2>&1 || true
    else
        systemctl disable gpud.service >/dev/null 2>&1 || true
    fi
fi
