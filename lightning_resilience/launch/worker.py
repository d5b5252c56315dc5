"""``python .../launch/worker.py [-m MODULE | SCRIPT] [args]``: what torchrun starts on each rank under
``lightning-resilience launch``. Runs the user's script or module as ``__main__`` (as ``python SCRIPT`` would) and
records how the rank ended in the attempt's rank record (``RunDir.launch().rank_record``): start, then exit status or
uncaught exception with its time. The exception also goes to torchrun's ``TORCHELASTIC_ERROR_FILE`` (torch's own
``ErrorHandler``), so torchrun's failure summary shows the traceback. A rank ended by a signal leaves only its start.

Before the script runs it puts back torchrun's per-attempt contract, which the launcher's one-torchrun-per-attempt
would otherwise break: ``TORCHELASTIC_RESTART_COUNT`` (the attempt of this launch), ``TORCHELASTIC_MAX_RESTARTS``
(``--max-restarts``) and ``TORCHELASTIC_RUN_ID`` (the same on every attempt), as the launcher passes them.

Under the launcher's standby workers (:mod:`.fork_server`, named by ``LIGHTNING_RESILIENCE_STANDBY``) this process
does not run the script itself: it hands its argv, environment, working directory and standard streams to the fork
server, whose child (torch, Lightning and the script's imports already loaded) runs the script as below, and it
stands in for that child towards torchrun: the signals it gets are passed on, and it ends the way the child ended
(the same exit status, or killed by the same signal). When the server declines (or cannot be reached) the rank
starts cold, here, and says why.

Run as a file, and standard library only until the user's script runs: a rank pays no import of ours.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import struct
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

__all__ = [
    "ATTEMPT_ENV",
    "RANK_RECORD_ENV",
    "STANDBY_ENV",
    "TORCHELASTIC_ENV",
    "apply_torchelastic_env",
    "import_root",
    "interpreter",
    "main",
    "peer_uid",
    "read_rank_record",
    "receive",
    "run_here",
    "send",
]

# the name lightning_resilience.ft.restart reads (this file imports nothing of ours; a test keeps them equal)
ATTEMPT_ENV = "LIGHTNING_RESILIENCE_ATTEMPT"
RANK_RECORD_ENV = "LIGHTNING_RESILIENCE_RANK_RECORD"
"""The path of this attempt's rank records, ``{rank}`` to be filled in (set by the launcher)."""
TORCHELASTIC_ENV = "LIGHTNING_RESILIENCE_TORCHELASTIC_ENV"
"""JSON of the ``TORCHELASTIC_*`` values torchrun would give this attempt (set by the launcher)."""
STANDBY_ENV = "LIGHTNING_RESILIENCE_STANDBY"
"""The socket of the launcher's standby workers (set by the launcher when it runs them)."""
STANDBY_CONNECT_TIMEOUT_S = 10.0
STANDBY_REPLY_TIMEOUT_S = 300.0
"""How long a rank waits for the standby server's answer (it answers once its imports are done), then starts cold."""
_MESSAGE_LIMIT = 1 << 24
_PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def apply_torchelastic_env(environ: MutableMapping[str, str] | None = None) -> None:
    """Put the launcher's ``TORCHELASTIC_*`` values for this attempt into ``environ`` (``os.environ``)."""
    env = os.environ if environ is None else environ
    try:
        values = json.loads(env.get(TORCHELASTIC_ENV) or "{}")
    except ValueError:
        return
    for name, value in values.items():
        if name.startswith("TORCHELASTIC_"):
            env[name] = str(value)


class _RankRecord:
    def __init__(self) -> None:
        template = os.environ.get(RANK_RECORD_ENV)
        rank = int(os.environ.get("RANK", "0"))
        self.path = Path(template.format(rank=rank)) if template else None
        self.data: dict[str, Any] = {
            "rank": rank,
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": time.time(),
        }

    def write(self, **end: Any) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps({**self.data, **end}))
            os.replace(tmp, self.path)  # a rank killed while writing leaves the previous record whole
        except OSError as err:  # the record is for the report; the training run must not fail for it
            print(f"lightning-resilience: cannot write {self.path}: {err}", file=sys.stderr)


def _described(err: BaseException) -> dict[str, str]:
    return {"type": type(err).__name__, "message": str(err)[:2000]}


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1  # sys.exit("message") prints it and exits 1


def import_root(argv: list[str]) -> str:
    """``sys.path[0]`` of ``python [-m MODULE | SCRIPT]``: the working directory, or the script's folder."""
    return os.getcwd() if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0]))


def interpreter() -> dict[str, Any]:
    """What of this interpreter a process forked for it must share: the executable, its flags and options."""
    return {
        "executable": sys.executable,
        "version": sys.version,
        "flags": list(sys.flags),
        "xoptions": {str(k): str(v) for k, v in sys._xoptions.items()},
        "warnoptions": list(sys.warnoptions),
    }


def run_here(argv: list[str], start: str = "cold", cold_reason: str | None = None) -> None:
    """Run the script (``[-m MODULE | SCRIPT, args...]``) in this process as ``__main__`` and record the rank's end.
    ``start``: ``cold`` (this process imported everything) or ``standby`` (forked from the standby server)."""
    apply_torchelastic_env()
    record = _RankRecord()
    record.data["start"] = start
    if cold_reason:
        record.data["cold_reason"] = cold_reason
    record.write()
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = import_root(argv)  # as `python -m MODULE` has it (this file's folder is no place for it)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[0] = import_root(argv)  # as `python SCRIPT` has it
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        status = _exit_status(exit_.code)
        # an app that turns an exception into sys.exit(1) (Hydra's @hydra.main does) exits while handling it
        context = exit_.__context__ if status else None
        cause = _described(context) if isinstance(context, Exception) else None
        record.write(exit_code=status, ended_at=time.time(), **({"exception": cause} if cause else {}))
        raise
    except BaseException as err:
        record.write(exit_code=1, ended_at=time.time(), exception=_described(err))
        if isinstance(err, Exception):
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler

            get_error_handler().record_exception(err)
        raise
    record.write(exit_code=0, ended_at=time.time())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or (argv[:1] == ["-m"] and len(argv) < 2):
        raise SystemExit("usage: worker.py [-m MODULE | SCRIPT] [args...]")
    server = os.environ.pop(STANDBY_ENV, None)
    if not server:
        run_here(argv)
        return
    why = _StandIn(argv).run(server)  # returns only when the rank could not run on a standby worker
    print(f"lightning-resilience: rank {os.environ.get('RANK', '?')}: cold start: {why}", file=sys.stderr, flush=True)
    run_here(argv, cold_reason=why)


# ------------------------------------------------------------------------------- standby workers (client side)
def send(sock: socket.socket, message: dict[str, Any]) -> None:
    """One message: its length (4 bytes), then its JSON."""
    data = json.dumps(message).encode()
    sock.sendall(len(data).to_bytes(4, "big") + data)


def receive(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None when the peer closed the connection."""
    head = _exactly(sock, 4)
    if head is None:
        return None
    size = int.from_bytes(head, "big")
    if size > _MESSAGE_LIMIT:
        raise OSError(f"a message of {size} bytes")
    data = _exactly(sock, size)
    if data is None:
        return None
    message = json.loads(data)
    if not isinstance(message, dict):
        raise OSError("a message that is not an object")
    return message


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _StandIn:
    """This process, standing in towards torchrun for the rank that runs in a process of the standby server."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.pid: int | None = None
        self.pidfd: int | None = None
        self.pending: list[int] = []
        self.sock: socket.socket | None = None

    def _pass_on(self, signum: int, frame: FrameType | None) -> None:
        if self.pid is None:
            self.pending.append(signum)  # before the rank's process exists: passed on once it does
            return
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signum)  # never a reused pid
            else:
                os.kill(self.pid, signum)
        except (ProcessLookupError, OSError):
            pass

    def run(self, server: str) -> str:
        """Run the rank on a standby worker and end as it ended (never returns then); else say why not."""
        previous = {sig: signal.signal(sig, self._pass_on) for sig in _PASSED_ON}
        try:
            why = self._start(server)
        except (OSError, ValueError) as err:
            why = f"the standby server cannot be reached ({err})"
        if self.pid is not None:
            self._follow()
        if self.sock is not None:
            self.sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in self.pending:  # a signal that came while asking: delivered here, as to a cold rank
            os.kill(os.getpid(), signum)
        return why

    def _start(self, server: str) -> str:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(STANDBY_CONNECT_TIMEOUT_S)
        self.sock.connect(f"\0{server}-{os.environ.get('LOCAL_RANK', '0')}")  # an abstract socket: no file
        if peer_uid(self.sock) != os.getuid():
            return "the standby socket belongs to another user"
        streams = [fd for fd in (0, 1, 2) if _is_open(fd)]
        socket.send_fds(self.sock, [b"F"], streams)
        env = dict(os.environ)
        send(
            self.sock,
            {
                "argv": self.argv,
                "env": env,
                "cwd": os.getcwd(),
                "streams": streams,
                "interpreter": interpreter(),
                "orig_argv": list(sys.orig_argv),
                "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            },
        )
        self.sock.settimeout(STANDBY_REPLY_TIMEOUT_S)
        reply = receive(self.sock)
        if reply is None:
            return "the standby server closed the connection"
        if "pid" not in reply:
            return str(reply.get("declined", "the standby server declined"))
        pid = int(reply["pid"])
        try:
            self.pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self.pidfd = None
        self.pid = pid
        for sig in self.pending:
            self._pass_on(sig, None)
        self.pending.clear()
        return ""

    def _follow(self) -> NoReturn:
        """Wait for the rank's end (told by the server, which is its parent) and end the same way."""
        assert self.pid is not None and self.sock is not None
        self.sock.settimeout(None)
        try:
            message = receive(self.sock)
        except (OSError, ValueError):
            message = None
        if message is None or "status" not in message:
            # the server ended first (the launcher is gone): its children are SIGKILLed with it
            print(f"lightning-resilience: the standby server of worker {self.pid} ended first", file=sys.stderr)
            self._pass_on(signal.SIGKILL, None)
            _end_as(-signal.SIGKILL)
        _end_as(os.waitstatus_to_exitcode(int(message["status"])))


def _end_as(code: int) -> NoReturn:
    """End this process with exit status ``code``, or killed by signal ``-code``."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    if code >= 0:
        os._exit(code)
    sig = -code
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default action is not to end a process


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def read_rank_record(path: Path) -> dict[str, Any] | None:
    """A rank record, or None when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
        int(data["rank"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return data if isinstance(data, dict) else None


if __name__ == "__main__":
    main()
