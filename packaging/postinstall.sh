#!/bin/sh
# deb: "configure" and the version it replaces (none on a first install); rpm: 1 (install) or 2
# (upgrade, downgrade, reinstall: it runs before the old package's preremove and postremove).
set -e
getent group gpud >/dev/null || groupadd --system gpud
getent group gpud-admin >/dev/null || groupadd --system gpud-admin
# Bytecode for each interpreter gpud can run on here (python3 and every python3.X on PATH, 3.10 or
# newer), as dh_python3's py3compile makes it for Debian's own Python packages: gpud writes none at run
# time, and with it gpud starts in half the time. An interpreter the package has no compiled tree for
# runs gpud on pure/ (launch.py): that is what gets compiled for it. preremove removes it. A failure
# only costs start-up time.
interpreters=python3
old_ifs=$IFS
IFS=:
for dir in $PATH; do
    for python in "$dir"/python3.[0-9]*; do
        [ -x "$python" ] && [ ! -d "$python" ] && interpreters="$interpreters $python"
    done
done
IFS=$old_ifs
# Each answers for itself: python3.X-config is no interpreter (it fails), one older than 3.10 prints
# nothing, a free-threaded one (abiflags "t": another ABI) has no tree here and takes pure/.
for python in $interpreters; do
    command -v "$python" >/dev/null 2>&1 || continue
    abi=$("$python" -I -S -c 'import sys; print("cp%d%d%s" % (*sys.version_info[:2], sys.abiflags) if sys.version_info >= (3, 10) else "")' \
        2>/dev/null) || continue
    [ -n "$abi" ] || continue
    [ -d "/usr/lib/gpud/$abi" ] || abi=pure
    "$python" -I -m compileall -q /usr/lib/gpud/common "/usr/lib/gpud/$abi" >/dev/null 2>&1 || true
done
# A first install: here the two conventions differ, and the argument says whose script this is.
if [ "$1" = "1" ]; then
    # rpm (a first install, or one after an erase): what Fedora's %systemd_post does, the operator's
    # presets decide and nothing starts (systemd's src/rpm/macros.systemd.in: `systemctl --no-reload
    # preset` on $1 = 1, through systemd-update-helper; Fedora's packaging guidelines, "Systemd").
    # Fedora's and RHEL's default preset is `disable *`: `systemctl enable --now gpud` turns it on, or
    # a preset file (/etc/systemd/system-preset/80-gpud.preset: `enable gpud.service`) before install.
    # gpud.socket and the two Kubernetes plugins are left as they are, as on Debian.
    rm -f /var/lib/gpud/enabled-at-removal
    systemctl --no-reload preset gpud.service >/dev/null 2>&1 || :
elif [ "$1" = "configure" ] && { [ -z "$2" ] || [ -e /var/lib/gpud/enabled-at-removal ]; }; then
    # deb: a first install, or one after a removal that left gpud's configuration ("configure" with
    # the removed version) where gpud was enabled until the removal (preremove's mark). Debian's
    # convention (dh_installsystemd): enabled and started.
    rm -f /var/lib/gpud/enabled-at-removal
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload
        systemctl enable --now gpud.service
    else
        # No running systemd (a chroot, an image build): enabled for the next boot only.
        systemctl enable gpud.service >/dev/null 2>&1 || true
    fi
elif [ -d /run/systemd/system ]; then
    # deb "configure <old>", rpm 2: another version replaced this one, the same for both. The units
    # stay enabled or disabled as the operator left them; a running gpud (and its plugins)
    # restarts on the new code, a stopped one stays stopped: rpm's %systemd_postun_with_restart
    # (try-restart), done here in the new package's %post so that the new version's code decides
    # how (the old package's %postun runs the old code). gpud's MPS control daemons keep
    # running (KillMode=process): the new gpud adopts them.
    systemctl daemon-reload
    # Earlier versions gave /run/gpud to group gpud. systemd, finding the runtime directory not
    # root:root as the unit says, would chown all of it to root when it starts the new gpud, the MPS
    # pipe directories of mps.user included: hand back the top directory alone, as systemd made it
    # (a real directory only, never through a link).
    if [ -d /run/gpud ] && [ ! -L /run/gpud ]; then
        chown root:root /run/gpud && chmod 0755 /run/gpud
    fi
    systemctl try-restart gpud.service gpud-device-plugin.service gpud-dra-plugin.service
fi
