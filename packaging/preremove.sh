#!/bin/sh
# deb: "remove", or "upgrade" when another version replaces this one; rpm: 0 (erase) or 1 (another
# version was just installed: its postinstall already ran). Only a removal stops and disables gpud.
set -e
# The bytecode postinstall made is no file of the package: it goes first, so that the package's
# directories can go. A deb upgrade makes it again in its postinstall; on an rpm upgrade ("1") the
# new version's postinstall has already made it for the new files.
if [ "$1" != "1" ]; then
    find /usr/lib/gpud -name __pycache__ -type d -prune -exec rm -rf {} + 2>/dev/null || true
fi
if [ "$1" = "remove" ] || [ "$1" = "0" ]; then
    # deb: installing gpud again (its configuration kept) enables it again: postinstall reads this
    # mark. rpm: the presets decide again, as on a first install (%systemd_post).
    if [ "$1" = "remove" ] && systemctl is-enabled --quiet gpud.service 2>/dev/null; then
        mkdir -p /var/lib/gpud && touch /var/lib/gpud/enabled-at-removal
    fi
    # Both conventions agree: stopped and disabled (rpm's %systemd_preun: `systemctl --no-reload
    # disable --now` where systemd runs, `--no-reload disable` where it does not; systemd's
    # src/rpm/systemd-update-helper.in, remove-system-units).
    if [ -d /run/systemd/system ]; then
        systemctl --no-reload disable --now gpud-device-plugin.service gpud-dra-plugin.service gpud.service gpud.socket >/dev/null 2>&1 || true
    else
        systemctl --no-reload disable gpud-device-plugin.service gpud-dra-plugin.service gpud.service gpud.socket >/dev/null 2>&1 || true
    fi
    # gpud leaves its MPS control daemons running across its own restarts and upgrades
    # (KillMode=process); when gpud itself goes away, they go too. Not a loop over the pipes here:
    # they are mps.user's, and gpud checks each path and runs the MPS client as its owner, not as root.
    gpud mps quit-all || true
fi
