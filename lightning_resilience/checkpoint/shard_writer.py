"""Writing a shard's files: raw bytes in, checksums computed on the bytes as they are written (never re-read).

No torch and nothing of this package is imported here, so the same code runs in the training process (a snapshot
in process memory, written by the persist thread) and in the writer process (:class:`~lightning_resilience.
checkpoint.worker.WriterProcess`: ``python shard_writer.py``), which maps a shared-memory snapshot and writes it
while the training process keeps its GIL. The layout of the files (DCP-compatible tensor records, DCP metadata) is
decided by :mod:`~lightning_resilience.checkpoint.format`; a :class:`FilePlan` says which bytes go where.

The child speaks length-prefixed JSON on its stdin and stdout: ``{"op": "write", ...}`` (a new directory, the data
files to write into it from a shared-memory segment) is answered with the files written (size and xxh3-64 of
each) or with the error (an ``OSError`` keeps its errno); the caller writes the manifest last. ``{"op": "exit"}``
ends it, and so does the death of its parent (``PR_SET_PDEATHSIG``, and a closed stdin).
"""

from __future__ import annotations

import base64
import json
import mmap
import os
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

import xxhash

__all__ = ["FilePlan", "Part", "read_message", "send_message", "write_data_files", "write_file"]

CHUNK = 8 << 20
_HEADER = struct.Struct("<Q")


@dataclass(frozen=True)
class Part:
    """Bytes of a file: literal ``data``, or ``length`` bytes of the snapshot's tensor ``tensor`` (by index)."""

    data: bytes = b""
    tensor: int = -1
    length: int = 0


@dataclass(frozen=True)
class FilePlan:
    name: str
    parts: tuple[Part, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "parts": [
                ["b", base64.b64encode(p.data).decode("ascii")] if p.tensor < 0 else ["t", p.tensor, p.length]
                for p in self.parts
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FilePlan:
        parts = tuple(
            Part(data=base64.b64decode(p[1])) if p[0] == "b" else Part(tensor=int(p[1]), length=int(p[2]))
            for p in data["parts"]
        )
        return cls(str(data["name"]), parts)


Payload = Callable[[int], memoryview]
"""The raw bytes of tensor ``i`` of the snapshot."""


def _write_all(fd: int, view: memoryview, digest: Any) -> None:
    for start in range(0, len(view), CHUNK):
        chunk = view[start : start + CHUNK]
        digest.update(chunk)
        while chunk:
            written = os.write(fd, chunk)
            chunk = chunk[written:]


def write_file(path: str, pieces: Iterable[memoryview | bytes]) -> dict[str, Any]:
    """Create ``path`` (it must not exist), write ``pieces``, fsync; returns its size and xxh3-64 checksum."""
    digest = xxhash.xxh3_64()
    size = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for piece in pieces:
            view = memoryview(piece).cast("B")
            _write_all(fd, view, digest)
            size += len(view)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": size, "xxh3_64": digest.hexdigest()}


def write_data_files(
    directory: str, files: list[FilePlan], extra: dict[str, bytes], payload: Payload
) -> dict[str, dict[str, Any]]:
    """Create the directory ``directory`` and write into it each planned file and the ``extra`` files (name ->
    bytes), each fsynced; returns name -> size and checksum, for the manifest that the caller writes last."""
    os.mkdir(directory)
    out: dict[str, dict[str, Any]] = {}
    for plan in files:
        pieces = (p.data if p.tensor < 0 else payload(p.tensor)[: p.length] for p in plan.parts)
        out[plan.name] = write_file(os.path.join(directory, plan.name), pieces)
    for name, data in extra.items():
        out[name] = write_file(os.path.join(directory, name), [data])
    return out


# ------------------------------------------------------------------------------------------------ the protocol
def send_message(stream: IO[bytes], message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_message(stream: IO[bytes]) -> dict[str, Any] | None:
    """The next message, or None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        return None
    message: dict[str, Any] = json.loads(data)
    return message


def _serve_write(request: dict[str, Any]) -> dict[str, Any]:
    offsets = [int(o) for o in request["offsets"]]
    with open(request["segment"], "rb") as f:
        size = os.fstat(f.fileno()).st_size
        # unmapped when the last view of it goes (closing it while a slice is alive is an error)
        view = memoryview(mmap.mmap(f.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ) if size else b"")

    def payload(i: int) -> memoryview:
        return view[offsets[i] :]

    files = write_data_files(
        request["directory"],
        [FilePlan.from_json(p) for p in request["files"]],
        {name: base64.b64decode(data) for name, data in request["extra"].items()},
        payload,
    )
    return {"ok": True, "files": files}


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a trainer killed with SIGKILL leaves no writer)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: a closed stdin still ends the loop
        pass


def main(parent: int) -> int:
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the death signal was armed
        return 0
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        request = read_message(stdin)
        if request is None or request.get("op") == "exit":
            return 0
        try:
            reply = _serve_write(request)
        except OSError as err:
            reply = {"ok": False, "kind": "OSError", "errno": err.errno, "error": str(err), "file": err.filename}
        except Exception as err:  # reported to the parent, which raises it on the training thread
            reply = {"ok": False, "kind": type(err).__name__, "error": str(err)}
        send_message(stdout, reply)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid()))
