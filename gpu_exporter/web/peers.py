"""Who a request comes from: the requester every per-client limit counts by.

A client on another host is its address. A client on this host is its local **user**, read
from the kernel's socket table: the uid that owns the peer's end of a loopback connection,
asked for that one socket over ``sock_diag`` netlink (what ``ss`` uses: microseconds), or,
where that is not available, found in ``/proc/net/tcp`` and ``tcp6`` (milliseconds: the
kernel writes out every socket). Counting local clients by address would give
every local user 16 million identities (all of ``127.0.0.0/8``, each source address bindable
without privilege: ``curl --interface 127.0.0.2``), and with them as many GPUs, waiters and
connections as they like. A user that basic auth proved is that user, by name.

* :meth:`PeerIdentities.identify` names a connection's peer once, when it is accepted (the
  server keeps it with the connection; the WSGI environ carries it as :data:`PEER`): the
  connection caps and the login throttle count by it.
* :func:`requester` is the one answer to "who asks": the proved user, else the peer. Lease
  limits, waiter caps, ``Idempotency-Key`` scopes, ``/leases`` and the status page use it.

A local peer the table does not name (its socket already closed: listed then with uid 0,
which is not its owner's; ``/proc`` unreadable) is ``local:?``, one identity for all of
them: never its address, and never root.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import pwd
import socket
import struct
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PEER = "gpu_exporter.peer"  # environ: the connection's peer, as :meth:`identify` named it
UNKNOWN_LOCAL = "local:?"
_TIME_WAIT = 6  # a closed socket's entry: its uid is 0, not its owner's
_LISTEN = 10  # the kernel's look-up falls back to a listener on the peer's port

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_NO_COOKIE = 0xFFFFFFFF
_UID_AT = 16 + 4 + 48 + 12  # nlmsghdr, then inet_diag_msg: family … id, expires, queues, uid

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _address(host: str) -> Address:
    """``host`` parsed, an IPv4-mapped IPv6 address as the IPv4 address it is."""
    address = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def diag_uid(peer: tuple[str, int], local: tuple[str, int]) -> int | None:
    """The uid owning the socket at ``peer`` connected to ``local``, asked of the kernel for
    that one socket (``SOCK_DIAG_BY_FAMILY``, an exact look-up); None if there is none.
    Raises OSError where netlink socket diagnostics are not available."""
    them, us = _address(peer[0]), _address(local[0])
    if them.version != us.version:
        return None
    family = socket.AF_INET if them.version == 4 else socket.AF_INET6
    sockid = struct.pack("!HH16s16s", peer[1], local[1], them.packed, us.packed)
    sockid += struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)  # any interface, any cookie
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)  # the kernel answers while sendto runs; this never waits
        nl.sendto(header + request, (0, 0))
        answer = nl.recv(8192)
    kind = struct.unpack_from("=H", answer, 4)[0]
    if kind == _NLMSG_ERROR:
        code = -struct.unpack_from("=i", answer, 16)[0]
        if code == errno.ENOENT:
            return None
        raise OSError(code, f"sock_diag: {errno.errorcode.get(code, code)}")
    if kind != _SOCK_DIAG_BY_FAMILY or len(answer) < _UID_AT + 4:
        raise OSError(errno.EPROTO, "sock_diag: an unexpected answer")
    if answer[17] in (_TIME_WAIT, _LISTEN):  # a closed socket's, or a listener's: not the peer's
        return None
    uid, inode = struct.unpack_from("=II", answer, _UID_AT)
    return None if inode == 0 else int(uid)  # inode 0: closed by its owner; uid 0 is not its


def _hex_address(address: Address) -> str:
    """``address`` as the socket table writes it: 32-bit words in host byte order."""
    packed = address.packed
    words = (packed[i : i + 4] for i in range(0, len(packed), 4))
    return "".join(f"{int.from_bytes(word, sys.byteorder):08X}" for word in words)


def _forms(host: str) -> list[tuple[str, str]]:
    """The (table, hex address) pairs a socket bound to ``host`` may be listed under: an
    IPv4 client of a dual-stack server is ``::ffff:a.b.c.d`` to the server and plain IPv4 in
    ``tcp`` (or, from an IPv6 socket, the mapped form in ``tcp6``)."""
    address = _address(host)
    if isinstance(address, ipaddress.IPv4Address):
        mapped = ipaddress.IPv6Address(f"::ffff:{address}")
        return [("tcp", _hex_address(address)), ("tcp6", _hex_address(mapped))]
    return [("tcp6", _hex_address(address))]


def is_local(peer: str, local: str) -> bool:
    """Is a peer at ``peer`` on this host? Loopback, or this connection's own address."""
    try:
        return _address(peer).is_loopback or _address(peer) == _address(local)
    except ValueError:
        return False


def table_uid(peer: tuple[str, int], local: tuple[str, int], proc: Path) -> int | None:
    """The uid owning the socket at ``peer`` connected to ``local``, from the socket table
    ``proc``/net/tcp[6]; None if no open socket of this host is listed so."""
    for (table, them), (_, us) in zip(_forms(peer[0]), _forms(local[0]), strict=True):
        try:
            text = (proc / "net" / table).read_text("ascii")
        except OSError:
            continue
        # "sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid …"
        needle = f" {them}:{peer[1]:04X} {us}:{local[1]:04X} "
        at = text.find(needle)
        if at < 0:
            continue
        fields = text[at + len(needle) : text.find("\n", at)].split()
        # st … uid timeout inode: a closed socket (TIME_WAIT, or inode 0: its owner closed it)
        # is listed with uid 0, which is not its owner's
        if len(fields) >= 7 and fields[0] != f"{_TIME_WAIT:02X}" and fields[6] != "0":
            return int(fields[4]) if fields[4].isdigit() else None
    return None


@functools.lru_cache(maxsize=1024)  # a directory service may be slow; this is the event loop
def user_name(uid: int) -> str:
    """``local:<name>`` for a local user, ``local:<uid>`` if the user database has none."""
    try:
        return f"local:{pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"local:{uid}"


class PeerIdentities:
    """Names connections' peers (see the module docstring). ``proc``: where the socket table
    is read when netlink is not available (``diag=False`` reads only that)."""

    def __init__(self, proc: str | Path = "/proc", *, diag: bool = True) -> None:
        self.proc = Path(proc)
        self.diag = diag
        self._warned = False

    def uid(self, peer: tuple[str, int], local: tuple[str, int]) -> int | None:
        """The uid owning the peer's socket, if it is on this host and still open."""
        if self.diag:
            try:
                return diag_uid(peer, local)
            except OSError as exc:
                self.diag = False
                log.info("sock_diag netlink unavailable (%s); reading %s/net/tcp", exc, self.proc)
        return table_uid(peer, local, self.proc)

    def identify(self, peer: tuple[str, int], local: tuple[str, int]) -> str:
        """``local:<user>`` for a peer on this host, else the peer's address (an IPv4 client
        of a dual-stack socket as plain IPv4)."""
        host = peer[0]
        if host.startswith("::ffff:") and "." in host:
            host = host[7:]
        if not is_local(peer[0], local[0]):
            return host
        uid = self.uid(peer, local)
        if uid is None:
            if not self._warned:
                self._warned = True
                log.warning(
                    "a local connection's owner is not in the socket table (it closed at "
                    "once, or the table is unreadable); such clients share one identity, %s",
                    UNKNOWN_LOCAL,
                )
            return UNKNOWN_LOCAL
        return user_name(uid)


def peer(environ: dict[str, Any]) -> str:
    """The connection's peer (:data:`PEER`; the address where no server of ours named it)."""
    return str(environ.get(PEER) or environ.get("REMOTE_ADDR") or "unknown")


def requester(environ: dict[str, Any]) -> str:
    """Who asks: the user basic auth proved (``REMOTE_USER``: the auth middleware sets it and
    removes any other), else the connection's peer."""
    user = environ.get("REMOTE_USER")
    if isinstance(user, str) and user:
        return user
    return peer(environ)
