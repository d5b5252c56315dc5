"""Direct TCP links between a rank and the few peers it talks to: the transport of the step agreement.

A round of the step agreement is a few dozen bytes between a rank and its tree neighbours. Through gloo's
point-to-point calls a round costs each rank about 200 us of CPU here (tensor wrapping, the transport's work queue,
a wait per message) and wakes gloo's own thread while the step computes; over a socket of its own a ping-pong costs
about 10 us (``docs/design.md``, "What a round costs"). :class:`TcpLinks` is that socket layer, and nothing more:
the side group (:class:`~lightning_resilience.collective.SideGroup` with ``transport="tcp"``) keeps the fault hook,
the deadlines' bookkeeping and the typed errors.

How peers find each other: every rank listens on a port of its own and publishes ``host:port`` in the job's store
(the default process group's, under a key of this group), before any exchange. Connections are made on first use,
the higher rank connecting to the lower, which accepts; the first bytes each way say who speaks and for which group,
so a stale address (a port of an earlier attempt, reused since) is refused on both sides. A rank opens one socket
per peer it talks to: with the agreement's tree that is at most ``fanout + 1``, whatever the number of ranks.

Large payloads received by :meth:`TcpLinks.receive` land in a :class:`SharedBuffer`: memory the kernel fills in the
receive (its pages come on first touch, there, with the interpreter released) and that another process can map, so
the receiver hands them on by descriptor instead of copying them under the interpreter lock.

Errors: a peer that closed its end raises :class:`ConnectionError`; a wait past its bound raises
:class:`TimeoutError`. The caller turns both into its typed errors.
"""

from __future__ import annotations

import math
import mmap
import os
import select
import socket
import struct
import time
import weakref
import zlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

__all__ = ["HOST_ENV", "SHARED_MEMORY", "Blob", "SharedBuffer", "TcpLinks", "lands_shared", "link_host"]

HOST_ENV = "LIGHTNING_RESILIENCE_LINK_HOST"
"""The address peers reach this rank's links at (default: this host's address on the route to ``MASTER_ADDR``)."""

_HELLO = struct.Struct("<4sqI")
_SIZE = struct.Struct("<q")
_COPY_LIMIT = 1 << 16  # payloads from this size on are sent after their size, not copied behind it
_MAGIC = b"LRL1"
_RETRY_S = 0.05
_HELLO_S = 5.0


SHARED_MEMORY = hasattr(os, "memfd_create")
"""Whether this platform makes :class:`SharedBuffer` (memfds: Linux); where it does not, payloads stay bytes."""


class SharedBuffer(mmap.mmap):
    """``size`` bytes of anonymous shared memory (a memfd, Linux): a buffer like any other (``len``, slices,
    ``memoryview``, ``bytes.join``) whose descriptor :attr:`fd` another process can receive (``SCM_RIGHTS``) and map,
    instead of being sent a copy. The descriptor closes when the buffer is collected."""

    fd: int

    def __new__(cls, size: int) -> SharedBuffer:
        if size <= 0:
            raise ValueError(f"a shared buffer needs at least one byte, got {size}")
        fd = os.memfd_create("lightning-resilience-payload", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self = super().__new__(cls, fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        weakref.finalize(self, os.close, fd)
        return self

    @classmethod
    def holding(cls, data: bytes | memoryview) -> SharedBuffer:
        """A shared buffer holding a copy of ``data`` (written by the kernel, the interpreter released; one zero byte
        when ``data`` is empty, as a mapping needs one)."""
        out = cls(max(1, len(data)))
        os.pwrite(out.fd, data, 0)
        return out


Blob = bytes | mmap.mmap
"""A received payload: bytes, or a large one in mapped memory (a :class:`SharedBuffer` where it was received, its
mapping in the process it was handed to)."""


def lands_shared(size: int) -> bool:
    """Whether a payload of ``size`` bytes that :meth:`TcpLinks.receive` takes lands in a :class:`SharedBuffer` (64 KiB
    or more, where the platform has them); a smaller one lands in bytes: one receive, no mapping to make."""
    return SHARED_MEMORY and size >= _COPY_LIMIT


def link_host() -> str:
    """The address other ranks reach this one at: ``LIGHTNING_RESILIENCE_LINK_HOST``, else the local address of the
    route to ``MASTER_ADDR`` (the interface the job's store is reached through), else the host name's address."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, 9))  # no packet is sent: this only picks the route
                return str(probe.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class TcpLinks:
    """One rank's TCP links to its peers in one group; made when the group is made (every rank alike).

    Args:
        store: the job's key-value store (``set``/``get``/``wait``, as a torch.distributed store).
        prefix: the group's keys in the store (unique per group, the same on every rank).
        rank: this rank in the group.
        host: the address to publish (default :func:`link_host`).
    """

    def __init__(self, store: Any, prefix: str, rank: int, *, host: str | None = None) -> None:
        self.store, self.prefix, self.rank = store, prefix, rank
        self._token = zlib.crc32(prefix.encode())
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("", 0))
        self._listener.listen(64)
        self._peers: dict[int, socket.socket] = {}
        self.closed = False
        store.set(self._key(rank), f"{host or link_host()}:{self._listener.getsockname()[1]}")

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    @property
    def peers(self) -> list[int]:
        """The peers connected so far."""
        return sorted(self._peers)

    # ------------------------------------------------------------------ connections
    def _peer(self, peer: int, end: float) -> socket.socket:
        sock = self._peers.get(peer)
        if sock is not None:
            return sock
        if self.closed:
            raise ConnectionError(f"links {self.prefix!r}: closed")
        if peer == self.rank:
            raise ValueError(f"links {self.prefix!r}: rank {peer} cannot link to itself")
        sock = self._connect(peer, end) if peer < self.rank else self._accept(peer, end)
        self._peers[peer] = sock
        return sock

    def _connect(self, peer: int, end: float) -> socket.socket:
        """Connect to a lower rank's listener; an address that refuses (a stale one) is read again until ``end``."""
        last: BaseException | None = None
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"links {self.prefix!r}: rank {peer} not reachable in time ({last})")
            try:
                self.store.wait([self._key(peer)], timedelta(seconds=max(left, 1e-3)))
                host, port = self.store.get(self._key(peer)).decode().rsplit(":", 1)
                sock = socket.create_connection((host, int(port)), timeout=max(left, 1e-3))
                try:
                    _ready_link(sock)
                    _send_all(sock, _HELLO.pack(_MAGIC, self.rank, self._token), end, "greeting", peer)
                    answer = _HELLO.unpack(_recv_exact(sock, _HELLO.size, end, who=peer))
                except OSError:
                    sock.close()
                    raise
                if answer == (_MAGIC, peer, self._token):
                    return sock
                sock.close()  # something else listens there now (a stale address): read it again
                raise ConnectionRefusedError(f"{host}:{port} is not rank {peer} of this group")
            except ConnectionError as err:  # refused, reset, closed or a stranger: a stale address, read it again
                last = err
                time.sleep(min(_RETRY_S, max(0.0, end - time.monotonic())))
            except RuntimeError as err:  # the store's wait: "Socket Timeout", "Wait timeout"
                raise TimeoutError(
                    f"links {self.prefix!r}: rank {peer}'s address did not come in time ({err})"
                ) from err

    def _accept(self, peer: int, end: float) -> socket.socket:
        """Accept connections until ``peer``'s (others that come first are kept for their turn)."""
        while peer not in self._peers:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"links {self.prefix!r}: rank {peer} did not connect in time")
            self._listener.settimeout(left)
            try:
                sock, _ = self._listener.accept()
            except TimeoutError as err:
                raise TimeoutError(f"links {self.prefix!r}: rank {peer} did not connect in time") from err
            try:
                _ready_link(sock)
                hello_end = min(end, time.monotonic() + _HELLO_S)  # a silent stranger holds the accept no longer
                magic, who, token = _HELLO.unpack(_recv_exact(sock, _HELLO.size, hello_end, who=-1))
            except (OSError, struct.error):
                sock.close()
                continue
            if magic != _MAGIC or token != self._token or who <= self.rank or who in self._peers:
                sock.close()  # not one of this group's peers (a stale address reached by another job's rank)
                continue
            try:  # the connector checks whom it reached
                _send_all(sock, _HELLO.pack(_MAGIC, self.rank, self._token), hello_end, "greeting", who)
            except OSError:
                sock.close()
                continue
            self._peers[who] = sock
        return self._peers.pop(peer)

    # ------------------------------------------------------------------ messages
    def send(self, peer: int, data: bytes | memoryview, end: float) -> None:
        """Send ``data`` to ``peer`` (delivered to its kernel buffers when this returns), by ``end`` (monotonic)."""
        _send_all(self._peer(peer, end), data, end, f"links {self.prefix!r}: sending to", peer)

    def recv(self, peer: int, n: int, end: float) -> bytes:
        """``n`` bytes from ``peer`` by ``end`` (monotonic)."""
        return _recv_exact(self._peer(peer, end), n, end, who=peer)

    def _recv_payload(self, peer: int, end: float, *, shared: bool = False) -> Blob | None:
        """One payload after its size (negative: None); ``shared``: a large one into a :class:`SharedBuffer`."""
        (n,) = _SIZE.unpack(self.recv(peer, _SIZE.size, end))
        if n < 0 or not (shared and lands_shared(n)):
            return None if n < 0 else self.recv(peer, n, end)
        buf = SharedBuffer(n)
        with memoryview(buf) as view:
            _recv_into(self._peer(peer, end), view, end, who=peer)
        return buf

    def exchange(
        self, payload: bytes | None, send_to: Sequence[int], recv_from: Sequence[int], end: float
    ) -> list[bytes | None]:
        """Send ``payload`` (None: "I have nothing") to each of ``send_to``, then receive one payload from each of
        ``recv_from`` (in that order), by ``end``."""
        head = _SIZE.pack(-1 if payload is None else len(payload))
        # a large payload (rank 0's subtree of records) goes as it is, after its size: no copy held under the GIL
        parts = [head + (payload or b"")] if payload is None or len(payload) < _COPY_LIMIT else [head, payload]
        for dst in send_to:
            for part in parts:
                self.send(dst, part, end)
        return [cast(bytes | None, self._recv_payload(src, end)) for src in recv_from]

    def receive(self, recv_from: Sequence[int], end: float) -> list[Blob | None]:
        """The receiving half of :meth:`exchange`, by ``end``: one payload from each of ``recv_from``, a large one
        (64 KiB or more) in a :class:`SharedBuffer` where the platform has them (filled by the kernel: no copy
        under the interpreter lock, and another process can map it)."""
        return [self._recv_payload(src, end, shared=True) for src in recv_from]

    def swap(self, sends: Sequence[tuple[int, bytes]], recvs: Sequence[tuple[int, int]], end: float) -> list[bytes]:
        """Send each ``(peer, data)``, then receive ``(peer, size)`` bytes from each (sizes both sides know)."""
        for peer, data in sends:
            self.send(peer, data, end)
        return [self.recv(peer, n, end) for peer, n in recvs]

    def close(self) -> None:
        """Close every link and the listener (what was sent is still delivered)."""
        self.closed = True
        for sock in [*self._peers.values(), self._listener]:
            try:
                sock.close()
            except OSError:
                pass
        self._peers = {}


def _failed(what: str, who: int, err: OSError) -> OSError:
    """The error of a timed-out or failed exchange with rank ``who`` (``what`` names the side: sending, receiving)."""
    if isinstance(err, TimeoutError):
        return TimeoutError(f"{what} rank {who}: timed out")
    return ConnectionError(f"rank {who} is gone ({err})")


def _ready_link(sock: socket.socket) -> None:
    """A connected link as every call here uses it: small messages sent at once (no Nagle delay), and never blocking
    (a call tries its send or receive first and waits in ``poll`` only when the kernel has nothing for it)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)


def _wait(sock: socket.socket, event: int, end: float, what: str, who: int) -> None:
    """Wait, until ``end``, for ``sock`` to be readable or writable (``event``); a hang-up or an error also ends the
    wait (the next call on the socket says which)."""
    left = end - time.monotonic()
    waiter = select.poll()
    waiter.register(sock, event)
    if left <= 0 or not waiter.poll(max(1, math.ceil(left * 1e3))):
        raise _failed(what, who, TimeoutError())


def _send_all(sock: socket.socket, data: bytes | memoryview, end: float, what: str, who: int) -> None:
    """All of ``data`` into the kernel's buffers for ``who`` by ``end``: a send that fits goes in one call (one
    release of the interpreter lock, where a socket with a timeout takes three: set the timeout, poll, send)."""
    with memoryview(data) as whole, whole.cast("B") as view:
        sent = 0
        while sent < len(view):
            try:
                sent += sock.send(view[sent:])
            except BlockingIOError:
                _wait(sock, select.POLLOUT, end, what, who)
            except OSError as err:
                raise _failed(what, who, err) from err


def _recv_into(sock: socket.socket, buf: memoryview, end: float, *, who: int) -> None:
    """Fill ``buf`` from ``who`` by ``end``: what has arrived is read at once, a wait in ``poll`` only for the rest."""
    got = 0
    while got < len(buf):
        try:
            n = sock.recv_into(buf[got:])
        except BlockingIOError:
            _wait(sock, select.POLLIN, end, "no message from", who)
            continue
        except OSError as err:
            raise _failed("no message from", who, err) from err
        if n == 0:
            raise ConnectionError(f"rank {who} closed its link (connection closed by peer)")
        got += n


def _recv_exact(sock: socket.socket, n: int, end: float, *, who: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), end, who=who)
    return bytes(buf)
