#!/bin/sh
# deb: "configure" and the version it replaces (none on a first install); rpm: 1 (install) or 2
# (upgrade, downgrade, reinstall: it runs before the old package's preremove and postremove).
set -e
getent group gpud >/dev/null || groupadd --system gpud
getent group gpud-admin >/dev/null || groupadd --system gpud-admin
# A first install, or one after a removal that left gpud's configuration (deb: "configure" with the
# removed version; rpm: 1) where gpud was enabled until the removal (preremove's mark).
if [ "$1" = "1" ] || { [ "$1" = "configure" ] && [ -z "$2" ]; } || [ -e /var/lib/gpud/enabled-at-removal ]; then
    rm -f /var/lib/gpud/enabled-at-removal
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload
        systemctl enable --now gpud.service
    else
        # No running systemd (a chroot, an image build): enabled for the next boot only.
        systemctl enable gpud.service >/dev/null 2>&1 || true
    fi
elif [ -d /run/systemd/system ]; then
    # Another version replaced this one. The units stay enabled or disabled as the operator left
    # them; a running gpud (and device plugin) restarts on the new code, a stopped one stays stopped.
    # gpud's MPS control daemons keep running (KillMode=process): the new gpud adopts them.
    systemctl daemon-reload
    systemctl try-restart gpud.service gpud-device-plugin.service
fi
