"""Direct TCP links (the step agreement's transport): peers find each other through the store, a stale address is
refused, every wait is bounded, a peer that goes is an error at once; a tcp side group carries exchanges only."""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lightning_resilience.collective import CollectiveError, SideGroup
from lightning_resilience.links import HOST_ENV, SHARED_MEMORY, SharedBuffer, TcpLinks, lands_shared, link_host
from tests._ranks import run_ranks


def _end(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


def test_two_ranks_exchange_payloads_and_fixed_size_messages_over_one_link_each_way() -> None:
    store = dist.HashStore()
    low, high = TcpLinks(store, "g/0", 0, host="127.0.0.1"), TcpLinks(store, "g/0", 1, host="127.0.0.1")
    got: dict[str, Any] = {}

    def child() -> None:  # the higher rank connects
        got["child"] = high.exchange(b"up", [0], [0], _end())
        (back,) = high.swap([(0, struct.pack("<2q", 5, 6))], [(0, 16)], _end())
        got["back"] = list(struct.unpack("<2q", back))

    thread = threading.Thread(target=child)
    thread.start()
    got["parent"] = low.exchange(None, [1], [1], _end())
    (part,) = low.swap([], [(1, 16)], _end())
    assert low.swap([(1, struct.pack("<2q", *(10 * v for v in struct.unpack("<2q", part))))], [], _end()) == []
    thread.join(10)
    assert got == {"parent": [b"up"], "child": [None], "back": [50, 60]}
    assert low.peers == [1] and high.peers == [0]
    low.close()
    high.close()


def test_a_large_payload_is_received_into_shared_memory_another_process_can_map() -> None:
    """What rank 0 receives in a straggler exchange (megabytes at thousands of ranks) lands in a memfd the kernel fills
    in the receive; small payloads and "nothing" arrive as before."""
    store = dist.HashStore()
    low, high1, high2 = (TcpLinks(store, "g/s", r, host="127.0.0.1") for r in range(3))
    big = bytes(range(256)) * 1024  # 256 KiB
    senders = [
        threading.Thread(target=lambda: high1.exchange(big, [0], [], _end())),
        threading.Thread(target=lambda: high2.exchange(b"small", [0], [], _end())),
    ]
    for t in senders:
        t.start()
    got = low.receive([1, 2], _end())
    for t in senders:
        t.join(10)
    assert isinstance(got[0], SharedBuffer) and got[0][:] == big and got[1] == b"small"
    with open(f"/proc/self/fd/{got[0].fd}", "rb") as mapped_elsewhere:  # what a process handed the descriptor reads
        assert mapped_elsewhere.read() == big
    none_sender = threading.Thread(target=lambda: high1.exchange(None, [0], [], _end()))
    none_sender.start()
    assert low.receive([1], _end()) == [None]
    none_sender.join(10)
    for links in (low, high1, high2):
        links.close()


def test_lands_shared_says_where_receive_puts_a_payload_of_each_size() -> None:
    """The rule a benchmark's stand-in for the links follows is the links' own: a payload of 64 KiB or more lands in
    shared memory, one byte less in bytes."""
    store = dist.HashStore()
    low, high = (TcpLinks(store, "g/rule", r, host="127.0.0.1") for r in range(2))
    for size in (1 << 16) - 1, 1 << 16:
        sender = threading.Thread(target=high.exchange, args=(b"x" * size, [0], [], _end()))
        sender.start()
        (got,) = low.receive([1], _end())
        sender.join(10)
        assert isinstance(got, SharedBuffer) is lands_shared(size) and len(got) == size
        assert lands_shared(size) is (SHARED_MEMORY and size == 1 << 16)
    for links in (low, high):
        links.close()


def test_a_shared_buffer_needs_a_byte_and_holds_a_copy() -> None:
    with pytest.raises(ValueError, match="at least one byte"):
        SharedBuffer(0)
    held = SharedBuffer.holding(b"abc")
    assert held[:] == b"abc" and len(SharedBuffer.holding(b"")) == 1


def test_a_stale_address_is_refused_and_the_right_peer_still_connects() -> None:
    store = dist.HashStore()
    parent = TcpLinks(store, "g/1", 0, host="127.0.0.1")
    host, port = store.get("g/1/0").decode().rsplit(":", 1)
    # a rank of another group (an earlier attempt's key, a reused port) reaches this listener first
    stranger = socket.create_connection((host, int(port)))
    stranger.sendall(b"LRL1" + (1).to_bytes(8, "little") + (12345).to_bytes(4, "little"))
    child = TcpLinks(store, "g/1", 1, host="127.0.0.1")
    sender = threading.Thread(target=lambda: child.exchange(b"hi", [0], [], _end()))
    sender.start()
    assert parent.exchange(None, [], [1], _end()) == [b"hi"]
    sender.join(10)
    assert stranger.recv(1) == b""  # closed by the listener
    for links in (parent, child):
        links.close()


def test_a_connector_that_reaches_another_listener_reads_the_address_again() -> None:
    store = dist.HashStore()
    impostor = socket.create_server(("127.0.0.1", 0))
    impostor.settimeout(10)
    store.set("g/3/0", f"127.0.0.1:{impostor.getsockname()[1]}")  # an earlier attempt's address, reused since
    child = TcpLinks(store, "g/3", 1, host="127.0.0.1")
    sent: list[bool] = []
    sender = threading.Thread(target=lambda: sent.append(child.exchange(b"hi", [0], [], _end()) == []))
    sender.start()
    conn, _ = impostor.accept()
    conn.sendall(b"LRL1" + (7).to_bytes(8, "little") + (0).to_bytes(4, "little"))  # not rank 0 of this group
    parent = TcpLinks(store, "g/3", 0, host="127.0.0.1")  # the real rank 0 publishes its address
    assert parent.exchange(None, [], [1], _end()) == [b"hi"]
    sender.join(10)
    assert sent == [True]
    for s in (conn, impostor):
        s.close()
    for links in (parent, child):
        links.close()


def test_every_link_sends_small_messages_at_once_and_never_blocks_even_one_accepted_early() -> None:
    """Rank 0 waits for rank 2 and accepts rank 1 first (kept for its turn): both links send without Nagle's delay
    and are non-blocking, as the connectors' are."""
    store = dist.HashStore()
    low = TcpLinks(store, "g/5", 0, host="127.0.0.1")
    one, two = TcpLinks(store, "g/5", 1, host="127.0.0.1"), TcpLinks(store, "g/5", 2, host="127.0.0.1")
    first = threading.Thread(target=lambda: one.send(0, b"one", _end()))
    first.start()
    pending = select.poll()
    pending.register(low._listener, select.POLLIN)
    assert pending.poll(10_000)  # rank 1's connection waits in the backlog before rank 2's: accepted first
    second = threading.Thread(target=lambda: two.send(0, b"two", _end()))
    second.start()
    assert low.recv(2, 3, _end()) == b"two" and low.recv(1, 3, _end()) == b"one"
    for thread in (first, second):
        thread.join(10)
    for links in (low, one, two):
        for sock in links._peers.values():
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) and sock.gettimeout() == 0.0
        links.close()


def test_a_message_that_has_arrived_is_read_and_one_that_fits_is_sent_without_a_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each release of the interpreter lock on the agreement's thread is one the training thread may be made to wait
    for: what the kernel already holds (or has room for) takes one call, no poll; only a message still on its way
    waits in poll."""
    from lightning_resilience import links as links_module

    store = dist.HashStore()
    low, high = TcpLinks(store, "g/6", 0, host="127.0.0.1"), TcpLinks(store, "g/6", 1, host="127.0.0.1")
    connected = threading.Thread(target=lambda: high.send(0, b"hello", _end()))
    connected.start()
    assert low.recv(1, 5, _end()) == b"hello"
    connected.join(10)
    waits: list[int] = []
    real = links_module._wait

    def wait(sock: Any, event: int, *rest: Any) -> None:
        waits.append(event)
        if waits == [select.POLLIN]:  # the receive found nothing: the message leaves now, while it waits for it
            high.send(0, b"later", _end())
        real(sock, event, *rest)

    monkeypatch.setattr(links_module, "_wait", wait)
    high.exchange(b"x" * 100, [0], [], _end())
    arrived = select.poll()
    arrived.register(low._peers[1], select.POLLIN)
    assert arrived.poll(10_000)  # delivered (one segment on loopback): the receive below finds all of it there
    assert low.exchange(None, [], [1], _end()) == [b"x" * 100]
    assert waits == []
    assert low.recv(1, 5, _end()) == b"later"  # not there yet: one wait in poll, then read
    assert waits and set(waits) == {select.POLLIN}
    low.close()
    high.close()


def test_a_peer_that_never_connects_is_a_timeout_and_one_that_closes_an_error() -> None:
    store = dist.HashStore()
    parent = TcpLinks(store, "g/2", 0, host="127.0.0.1")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 1 did not connect in time"):
        parent.recv(1, 8, _end(0.3))
    assert time.monotonic() - start < 5
    child = TcpLinks(store, "g/2", 1, host="127.0.0.1")
    sender = threading.Thread(target=lambda: child.send(0, b"12345678", _end()))  # connects: waits for the accept
    sender.start()
    assert parent.recv(1, 8, _end()) == b"12345678"
    sender.join(10)
    child.close()
    with pytest.raises(ConnectionError, match="closed its link"):
        parent.recv(1, 8, _end())
    parent.close()


class _Trickle:
    """A socket whose reads return at most 3 bytes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv_into(self, buf: Any) -> int:
        return self.sock.recv_into(memoryview(buf)[:3])


def test_a_swap_is_bounded_reads_a_message_that_comes_in_parts_and_fails_typed() -> None:
    """The step round's exchange: a message that arrives in parts is read whole, a silent peer is a timeout by the
    deadline, a peer that goes is a connection error; both as the other calls name them."""
    store = dist.HashStore()
    low, high = TcpLinks(store, "g/3", 0, host="127.0.0.1"), TcpLinks(store, "g/3", 1, host="127.0.0.1")
    sender = threading.Thread(target=lambda: high.send(0, b"12345678", _end()))  # connects: waits for the accept
    sender.start()
    low._peer(1, _end())
    sender.join(10)
    low._peers[1] = _Trickle(low._peers[1])  # type: ignore[assignment]  # the kernel hands it over 3 bytes at a time
    assert low.swap([], [(1, 8)], _end()) == [b"12345678"]
    low._peers[1] = low._peers[1].sock  # type: ignore[attr-defined]
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no message from rank 1: timed out"):
        low.swap([(1, b"x" * 8)], [(1, 8)], _end(0.3))
    assert time.monotonic() - start < 5
    assert high.recv(0, 8, _end()) == b"x" * 8
    high.close()
    with pytest.raises(ConnectionError, match="closed its link"):
        low.swap([], [(1, 8)], _end())
    low.close()


def test_the_published_address_can_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOST_ENV, "10.1.2.3")
    assert link_host() == "10.1.2.3"
    monkeypatch.delenv(HOST_ENV)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert link_host() == "127.0.0.1"


def test_bad_transports_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="transport must be one of"):
        SideGroup("step", timedelta(seconds=1), transport="nccl")
    with pytest.raises(ValueError, match="tcp side group spans every rank"):
        SideGroup("step", timedelta(seconds=1), parent=object(), transport="tcp")


def _scenario_tcp_group(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    group = SideGroup("step", timedelta(seconds=10), transport="tcp")
    out: dict[str, Any] = {}
    try:
        group.all_true(True, op="x")
    except ValueError as err:
        out["collective"] = str(err)
    peer = 1 - rank
    out["swapped"] = group.exchange(f"r{rank}".encode(), send_to=[peer], recv_from=[peer], op="t.x", step=0)[0]
    out["swapped"] = out["swapped"].decode()
    if rank == 1:
        group.close()  # gone: the other rank's next receive fails at once, typed
        return out
    start = time.monotonic()
    try:
        group.exchange(None, send_to=[], recv_from=[1], op="t.y", step=1)
    except CollectiveError as err:
        out["error"] = type(err).__name__
        out["error_s"] = time.monotonic() - start
    out["broken"] = group.broken
    group.close()
    return out


def test_a_tcp_side_group_exchanges_and_a_peer_that_goes_breaks_it_at_once(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_scenario_tcp_group, 2, tmp_path, deadline_s=60)
    assert "point-to-point exchanges only, not x" in r0["collective"]
    assert (r0["swapped"], r1["swapped"]) == ("r1", "r0")
    assert r0["error"] == "CollectiveError" and r0["error_s"] < 5 and r0["broken"]
