"""Who may change the node: read routes are open to any peer that can connect to the socket (the
socket's mode and group decide that); changing routes need uid 0, gpud's own user, or membership
of the admin group, checked on each request with the peer's credentials (SO_PEERCRED)."""

from __future__ import annotations

import functools
import grp
import os
import pwd
import socket
import struct

from aiohttp import web

from gpud.api.errors import error_response

ADMIN_POLICY: web.AppKey["AdminPolicy"] = web.AppKey("admin_policy")


class AdminPolicy:
    def __init__(self, admin_group: str):
        self.admin_group = admin_group

    def allows(self, uid: int, gid: int) -> bool:
        if uid in (0, os.geteuid()):
            return True
        try:
            admin_gid = grp.getgrnam(self.admin_group).gr_gid
            return admin_gid in os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)
        except KeyError:  # no such group, or a uid without a name: not an admin
            return False


def peer_credentials(request: web.Request) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the process on the other end of the Unix socket, as of its connect()."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    size = struct.calcsize("3i")
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, size))


def admin_only(handler):
    """Refuses the request with 403 unless the peer may change the node."""

    @functools.wraps(handler)
    async def guarded(self, request: web.Request) -> web.StreamResponse:
        policy = request.app[ADMIN_POLICY]
        credentials = peer_credentials(request)
        if credentials is None or not policy.allows(credentials[1], credentials[2]):
            who = f"uid {credentials[1]}" if credentials else "an unknown peer"
            return error_response(403, "forbidden", f"{request.method} {request.path} changes the node: it needs "
                                                    f"root or membership of group '{policy.admin_group}' "
                                                    f"(the request came from {who})")
        return await handler(self, request)

    return guarded
