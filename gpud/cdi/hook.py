"""gpud's OCI hook for the driver files of its CDI spec, in place of NVIDIA's nvidia-cdi-hook.

The runtime runs it as a createContainer hook (OCI runtime spec, config.md "createContainer Hooks": in
the container's namespaces, before pivot_root, with the container's state on stdin), as
`python3 -I <this file> COMMAND ...`: it is run as a file, so it imports nothing of gpud and only the
standard library, and -I keeps the environment out.

  create-symlinks --link TARGET::LINK ...           LINK (a container path) becomes a link to TARGET
  update-ldcache --ldconfig PATH --folder DIR ...   DIRs go in the container's /etc/ld.so.conf.d and
                                                    the host's ldconfig rebuilds its /etc/ld.so.cache

The same commands and arguments as nvidia-cdi-hook (cmd/nvidia-cdi-hook create-symlinks and
update-ldcache). Every container path is resolved inside the container's root, links included, so an
image's own links cannot point the hook at the host's files."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

LD_SO_CONF = "/etc/ld.so.conf.d/00-gpud-cdi.conf"
# The container's state on stdin and its bundle's config.json are a few KiB (OCI runtime spec
# runtime.md "State", config.md); read no more than this of either. JSON nested deeper than Python's
# recursion limit raises RecursionError, caught as a refusal like any malformed document.
MAX_JSON_BYTES = 4 << 20


def _read_json(stream, what: str):
    raw = stream.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise ValueError(f"{what} is over {MAX_JSON_BYTES} bytes")
    return json.loads(raw)


def resolve_in(root: str, path: str) -> str:
    """What path resolves to with root as /, as a path inside root: every directory on the way and the
    file itself may be links, absolute ones taken from root, ".." never above it."""
    for _ in range(40):  # the kernel's limit on links in one lookup
        parent, name = os.path.split(os.path.normpath(path))
        if parent != "/":
            parent = resolve_in(root, parent)
        path = os.path.join(parent, name)
        if not os.path.islink(os.path.join(root, path.lstrip("/"))):
            return path
        path = os.path.join(parent, os.readlink(os.path.join(root, path.lstrip("/"))))
    raise OSError(f"too many levels of links in {path} under {root}")


def container_root(state: dict) -> str:
    """The container's root directory: config.json's root.path, relative to the bundle unless absolute."""
    with open(os.path.join(state["bundle"], "config.json"), "rb") as config:
        root = _read_json(config, "the bundle's config.json")["root"]["path"]
    return os.path.normpath(os.path.join(state["bundle"], root))


def _host_path(root: str, path: str) -> str:
    """A container path's place on the host: its directory resolved inside root (not the file itself)."""
    parent, name = os.path.split(path)
    return os.path.join(root, resolve_in(root, parent).lstrip("/"), name)


def create_symlinks(root: str, links: list[str]) -> None:
    for pair in links:
        target, separator, link = pair.partition("::")
        if not separator or not target or not link.startswith("/"):
            raise ValueError(f"--link {pair!r}: want TARGET::/container/path")
        place = _host_path(root, link)
        if os.path.islink(place) and os.readlink(place) == target:
            continue
        os.makedirs(os.path.dirname(place), exist_ok=True)
        if os.path.islink(place):
            os.unlink(place)  # a link to another version: the host's driver wins
        elif os.path.lexists(place):
            continue  # the image's own file stays
        os.symlink(target, place)


def update_ldcache(root: str, ldconfig: str, folders: list[str]) -> None:
    conf = _host_path(root, LD_SO_CONF)
    os.makedirs(os.path.dirname(conf), exist_ok=True)
    with open(conf, "w") as listed:  # so an ldconfig run later in the container keeps them
        listed.write("".join(f"{folder}\n" for folder in folders))
    # ldconfig prints nothing but its errors; they go to the runtime's log as the hook's own stderr.
    done = subprocess.run([ldconfig, "-r", root, *folders], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          timeout=60)
    if done.returncode != 0:
        raise OSError(f"{ldconfig} -r {root} failed (exit status {done.returncode})")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpud-cdi-hook")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("create-symlinks").add_argument("--link", action="append", default=[])
    ldcache = commands.add_parser("update-ldcache")
    ldcache.add_argument("--ldconfig", required=True)
    ldcache.add_argument("--folder", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        root = container_root(_read_json(sys.stdin.buffer, "the container's state on stdin"))
        if args.command == "create-symlinks":
            create_symlinks(root, args.link)
        else:
            update_ldcache(root, args.ldconfig, args.folder)
    except (OSError, ValueError, KeyError, TypeError, RecursionError, subprocess.TimeoutExpired) as exc:
        print(f"gpud-cdi-hook {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
