"""Who may change the node: read routes are open to any peer that can connect to the socket (the
socket's mode and group decide that); changing routes need uid 0, gpud's own user, or the admin
group among the peer's groups. The uid, gid and supplementary groups are the kernel's record of
the peer process as it connected (SO_PEERCRED, SO_PEERGROUPS), never /etc/group read afterwards:
a user added to the group gets rights with a new login, a user taken out loses them with it, and
a process that dropped its groups (setgroups, a container) cannot claim them back."""

from __future__ import annotations

import ctypes
import errno
import functools
import grp
import os
import socket
import struct
from dataclasses import dataclass

from aiohttp import web

from gpud.api.errors import error_response

ADMIN_POLICY: web.AppKey["AdminPolicy"] = web.AppKey("admin_policy")


class AdminPolicy:
    def __init__(self, admin_group: str):
        self.admin_group = admin_group

    def allows(self, peer: PeerCredentials) -> bool:
        if peer.uid in (0, os.geteuid()):
            return True
        try:
            admin_gid = grp.getgrnam(self.admin_group).gr_gid
        except KeyError:  # no such group: no one is in it
            return False
        return admin_gid == peer.gid or admin_gid in peer.groups


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups


SO_PEERGROUPS = 59  # Linux 4.13 and later; Python's socket module does not name it
_GID_SIZE = ctypes.sizeof(ctypes.c_uint32)
_libc = ctypes.CDLL(None, use_errno=True)


def peer_credentials(request: web.Request) -> PeerCredentials | None:
    """The process on the other end of the Unix socket, as of its connect()."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return socket_peer_credentials(sock) if sock is not None else None


def socket_peer_credentials(sock: socket.socket) -> PeerCredentials | None:
    """The process on the other end of a connected Unix socket, as of its connect()."""
    if sock.family != socket.AF_UNIX:
        return None
    size = struct.calcsize("3i")
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, size))
    return PeerCredentials(pid, uid, gid, _peer_groups(sock.fileno()))


def _peer_groups(fd: int) -> tuple[int, ...]:
    """SO_PEERGROUPS through libc: Python's getsockopt takes at most 1024 bytes (256 groups), and a
    user may be in up to 65536. ERANGE says how much room the kernel needs."""
    length = ctypes.c_uint32(64 * _GID_SIZE)
    while True:
        buffer = ctypes.create_string_buffer(length.value)
        if _libc.getsockopt(fd, socket.SOL_SOCKET, SO_PEERGROUPS, buffer, ctypes.byref(length)) == 0:
            count = length.value // _GID_SIZE
            return struct.unpack(f"{count}I", buffer.raw[:count * _GID_SIZE])
        error = ctypes.get_errno()
        if error != errno.ERANGE:
            raise OSError(error, f"SO_PEERGROUPS: {os.strerror(error)}")


def admin_only(handler):
    """Refuses the request with 403 unless the peer may change the node."""

    @functools.wraps(handler)
    async def guarded(self, request: web.Request) -> web.StreamResponse:
        policy = request.app[ADMIN_POLICY]
        peer = peer_credentials(request)
        if peer is None or not policy.allows(peer):
            who = f"uid {peer.uid}" if peer else "an unknown peer"
            return error_response(403, "forbidden", f"{request.method} {request.path} changes the node: it needs "
                                                    f"root or membership of group '{policy.admin_group}' "
                                                    f"(the request came from {who})")
        return await handler(self, request)

    return guarded
