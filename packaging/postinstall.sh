#!/bin/sh
# deb: "configure [old-version]"; rpm: 1 (install) or 2 (upgrade).
set -e
getent group gpud >/dev/null || groupadd --system gpud
getent group gpud-admin >/dev/null || groupadd --system gpud-admin
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    if [ "$1" = "configure" ] && [ -z "$2" ] || [ "$1" = "1" ]; then
        systemctl enable --now gpud.service
    else
        # An upgrade: gpud restarts; MPS daemons and the socket's clients are kept (KillMode=process).
        systemctl try-restart gpud.service
    fi
else
    # No running systemd (a chroot, an image build): enable for the next boot only.
    systemctl enable gpud.service >/dev/null 2>&1 || true
fi
