"""RemoteTier: checkpoints in any fsspec store (S3, GCS, Azure, a shared file system), committed by the manifest.

Layout (mirrors :mod:`lightning_resilience.checkpoint.local`)::

    <url>/step_000000000120/rank_00000/{.metadata, __0_0.distcp, skeleton.json, manifest.json}

Object stores have no rename, so the commit point is the manifest object: a shard is staged in a local temporary
directory, every data file is uploaded, and ``manifest.json`` is uploaded last. A shard is committed if and only
if its manifest exists; :meth:`RemoteTier.read` then trusts it only after checking every file's size and checksum.
Deleting removes the manifest first (un-commit), then the rest, so a reader never sees a half-deleted shard as
committed.

Uploads run on the checkpoint manager's background worker. Transient faults (connection refused or reset,
timeouts, 5xx, throttling) are retried with exponential backoff; what is still failing after that, and every
configuration fault (credentials, missing bucket), is raised as :class:`RemoteTierError`, an ``OSError``, so the
manager counts a failed persist and training continues.
"""

from __future__ import annotations

import logging
import random
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec

from lightning_resilience._configurable import ConfigError, config_from_args
from lightning_resilience.checkpoint.certify import TOMBSTONE, tombstone
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.format import (
    MANIFEST,
    Manifest,
    check_identity,
    read_shard,
    shard_bytes,
    write_shard,
)
from lightning_resilience.checkpoint.layout import rank_dirname, step_dirname, step_of_entry
from lightning_resilience.checkpoint.remote_calls import RetryingCalls
from lightning_resilience.checkpoint.remote_faults import (
    RemoteFault,
    RemoteTierError,
    StoreAddress,
    check_protocols,
    classify_error,
)
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tier import Durability, TierIdentity, Written, check_cadence
from lightning_resilience.collective import Deadline

__all__ = ["RemoteFault", "RemoteTier", "RemoteTierError", "classify_error"]

log = logging.getLogger(__name__)

# a file named by a manifest must be a plain name: it becomes both an object key and a local path on download
_SAFE_NAME_RE = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9_.\-]{1,255}$")
# stores whose "directories" are key prefixes: nothing to create, and makedirs() on them may create a bucket
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})


class RemoteTier(RetryingCalls):
    """Off-node tier on any fsspec URL: ``s3://bucket/prefix``, ``gs://...``, ``file:///shared/fs/dir``, ``memory://``.

    Takes a :class:`RemoteTier.Config`, or its fields as arguments: ``RemoteTier("s3://bucket/run-17",
    every_n_steps=500)``; ``sleep`` (how to wait between retries) is injectable for tests. The tier owns its
    filesystem instance (``skip_instance_cache`` defaults to True) so its cache invalidation touches nobody else's.
    Timeouts bound each remote call of an asynchronous backend (S3, GCS, Azure, HTTP); synchronous backends
    (``file``, ``memory``) are not bounded by them.

    Raises:
        ConfigError: an empty URL, an unknown protocol, bad storage options or out-of-range settings, naming the key.
        ImportError: the URL's protocol needs a package that is not installed (``s3fs``, ``gcsfs``, ``adlfs``).
    """

    @dataclass(kw_only=True)
    class Config:
        """Off-node tier on an fsspec URL (S3, GCS, Azure, shared file system)."""

        url: str
        """fsspec URL of the bucket prefix or directory, e.g. s3://bucket/run-17."""
        every_n_steps: int = 500
        """Persist cadence in optimizer steps."""
        keep: int = 3
        """Committed steps retained."""
        name: str = "remote"
        """Label in logs, metrics and the report."""
        storage_options: dict[str, Any] = field(default_factory=dict)
        """Passed to the fsspec filesystem (key, secret, client_kwargs.endpoint_url, config_kwargs, ...)."""
        retries: int = 5
        """Extra attempts per request after a transient fault."""
        backoff_s: float = 0.5
        """Wait before the first retry; doubles per retry, with jitter."""
        max_backoff_s: float = 10.0
        """Cap on one wait between retries."""
        timeout_s: float = 60.0
        """Longest wait for one request on asynchronous backends; transfers get 1 s more per MiB."""

        def __post_init__(self) -> None:
            owner = f"tiers.{self.name}"
            check_cadence(owner, self.every_n_steps, self.keep)
            if self.retries < 0:
                raise ConfigError(owner, "retries", f"must be >= 0, got {self.retries}")
            if self.backoff_s < 0:
                raise ConfigError(owner, "backoff_s", f"must be >= 0, got {self.backoff_s}")
            if self.max_backoff_s < self.backoff_s:
                raise ConfigError(
                    owner, "max_backoff_s", f"must be >= backoff_s ({self.backoff_s}), got {self.max_backoff_s}"
                )
            if self.timeout_s <= 0:
                raise ConfigError(owner, "timeout_s", f"must be > 0, got {self.timeout_s}")
            if not isinstance(self.storage_options, Mapping):
                kind = type(self.storage_options).__name__
                raise ConfigError(owner, "storage_options", f"must be a mapping, got {kind}")
            self.storage_options = dict(self.storage_options)
            if not isinstance(self.url, str) or not self.url.strip():
                raise ConfigError(owner, "url", f"must be an fsspec URL such as s3://bucket/run-17, got {self.url!r}")
            protocol = check_protocols(self.url, owner)
            if not fsspec.get_filesystem_class(protocol)._strip_protocol(self.url.split("::")[-1]).rstrip("/"):
                raise ConfigError(owner, "url", f"must name a bucket or directory, got {self.url!r}")

        def build(self) -> RemoteTier:
            return RemoteTier(self)

    durability = Durability.remote
    collective = False
    ram = False

    def __init__(self, *args: Any, sleep: Callable[[float], None] = time.sleep, **settings: Any) -> None:
        config = config_from_args(RemoteTier.Config, args, settings, "RemoteTier")
        self.config = config
        key = f"tiers.{config.name}"
        self.protocol = check_protocols(config.url, key)
        self.url = config.url
        self.name = config.name
        self.every_n_steps = config.every_n_steps
        self.keep = config.keep
        self.retries = config.retries
        self.backoff_s = config.backoff_s
        self.max_backoff_s = config.max_backoff_s
        self.timeout_s = config.timeout_s
        self.retries_total = 0
        """Retries made so far (all operations), for metrics."""
        self._sleep = sleep
        self._random = random.Random()
        self._options = {"skip_instance_cache": True, **config.storage_options}
        try:
            fs, root = fsspec.core.url_to_fs(config.url, **self._options)
        except (TypeError, ValueError) as err:
            raise ConfigError(key, "storage_options", f"rejected for {key}.url={config.url!r}: {err}") from err
        root = root.rstrip("/")
        if not root:
            raise ConfigError(key, "url", f"must name a bucket or directory, got {config.url!r}")
        self.fs = fs
        self.root = root
        self._hierarchical = self.protocol not in _OBJECT_STORES
        self._address = StoreAddress(self.name, self.url, self.protocol, root, self._hierarchical, self._options)
        self._identity = TierIdentity()
        self._lock = threading.Lock()
        self._known: set[int] = set()  # committed steps as this process last saw them (listing or own writes)
        self._deadline = threading.local()  # the deadline of the write in progress on this thread, if any

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r}, every_n_steps={self.every_n_steps}, keep={self.keep}, name={self.name!r})"

    # ------------------------------------------------------------------ layout
    @property
    def _rank_name(self) -> str:
        return rank_dirname(self._identity.rank)

    def shard_path(self, step: int) -> str:
        """The shard's prefix in the filesystem's own notation (no protocol)."""
        return f"{self.root}/{step_dirname(step)}/{self._rank_name}"

    def shard_url(self, step: int) -> str:
        return str(self.fs.unstrip_protocol(self.shard_path(step)))

    # ------------------------------------------------------------------ Tier
    def bind(self, identity: TierIdentity) -> None:
        """Take this rank's place: list what it has committed in the store (every retry: this is startup) and
        remove its uploads that a killed process left without a manifest."""
        self._identity = identity
        if not self.refresh():
            return  # the store is down: a restore can still use another tier, and writes will report the outage
        try:
            self._remove_uncommitted()
        except RemoteTierError as err:  # a store that is down at startup is not a reason to stop training
            log.warning("tiers.%s: could not look for uncommitted shards at startup: %s", self.name, err)

    def write(self, snap: StagedSnapshot, deadline: Deadline | None = None) -> Written:
        """Upload and commit ``snap``; every request and retry is bounded by ``deadline`` too. Then refresh the
        listing (here, on the persist worker: the training thread reads it without a request)."""
        self._deadline.value = deadline
        try:
            written = self._upload_shard(snap)
        finally:
            self._deadline.value = None
        if deadline is None:  # an emergency save has no time for it; its own commit is recorded anyway
            self.refresh(attempts=1, quiet=True)
        return written

    def _upload_shard(self, snap: StagedSnapshot) -> Written:
        step = snap.step
        shard = self.shard_path(step)
        try:
            with tempfile.TemporaryDirectory(prefix=f"lr-{self.name}-") as tmp:
                staged = Path(tmp) / self._rank_name
                write_shard(
                    staged,
                    snap,
                    rank=self._identity.rank,
                    world_size=self._identity.world_size,
                    rank_layout={"rank": self._identity.rank, "world_size": self._identity.world_size},
                )
                self._invalidate()
                # un-commit an earlier copy of this step (a rewrite after a rollback) and drop leftovers of a
                # failed upload, so the shard never mixes files of two writes
                self._clear(shard, what=f"clear step {step}")
                if self._hierarchical:
                    self._call(f"create {shard}", lambda: self._op("makedirs", shard, exist_ok=True))
                try:
                    for path in sorted(staged.iterdir()):
                        if path.name != MANIFEST:
                            self._upload(path, f"{shard}/{path.name}")
                    self._commit(staged / MANIFEST, shard)
                except Exception:
                    self._abandon(shard)
                    raise
                nbytes = shard_bytes(staged)
        except FileNotFoundError as err:  # the root (bucket, container, directory) vanished under us
            raise self._error(f"upload step {step}", err, RemoteFault.NO_BUCKET, 1) from err
        with self._lock:
            self._known.add(step)
        return Written(step, nbytes)

    def read(self, step: int) -> StagedSnapshot:
        shard = self.shard_path(step)
        where = self.shard_url(step)
        self._invalidate()
        try:
            raw = self._call(f"read the manifest of step {step}", lambda: self._op("cat_file", f"{shard}/{MANIFEST}"))
        except FileNotFoundError as err:
            raise CheckpointCorruptError(f"{where}: not committed (no {MANIFEST})") from err
        try:
            text = bytes(raw).decode()
        except UnicodeDecodeError as err:
            raise CheckpointCorruptError(f"{where}: manifest unreadable ({err})") from err
        manifest = Manifest.from_json(text, where=where)
        for fname in manifest.files:
            if not _SAFE_NAME_RE.match(fname) or fname == MANIFEST:
                raise CheckpointCorruptError(f"{where}: manifest names a file outside the shard: {fname!r}")
        with tempfile.TemporaryDirectory(prefix=f"lr-{self.name}-") as tmp:
            local = Path(tmp) / self._rank_name
            local.mkdir()
            (local / MANIFEST).write_text(text)
            for fname, info in manifest.files.items():
                size = info.get("size")
                try:
                    self._download(f"{shard}/{fname}", local / fname, size if isinstance(size, int) else 0)
                except FileNotFoundError as err:
                    raise CheckpointCorruptError(f"{where}: file {fname} is missing") from err
            try:
                loaded, snap = read_shard(local, verify_checksums=True)
            except CheckpointCorruptError as err:
                raise CheckpointCorruptError(str(err).replace(str(local), where)) from err
        check_identity(loaded, step=step, rank=self._identity.rank, world_size=self._identity.world_size, where=where)
        return snap

    def list_steps(self) -> list[int]:
        """Committed steps of this rank, oldest first, from what this process knows: the listing made at
        :meth:`bind` (or the latest :meth:`refresh`) and its own commits and deletes since. No request is made: the
        training thread never waits on the store, however slow or down it is."""
        with self._lock:
            return sorted(self._known)

    def refresh(self, attempts: int | None = None, *, quiet: bool = False) -> bool:
        """List the store (requests, retried ``attempts`` times; default every retry) and remember what this rank
        has committed there. Never raises for a store fault: a listing that fails is logged and what was known is
        kept. Returns whether the listing succeeded."""
        try:
            steps = self._committed_steps(self.retries + 1 if attempts is None else attempts)
        except RemoteTierError as err:
            (log.debug if quiet else log.warning)(
                "tiers.%s: cannot list checkpoints (%s); keeping this process's records", self.name, err
            )
            return False
        with self._lock:
            self._known = set(steps)
        return True

    def reshard_root(self) -> Path | None:
        return None  # resharding reads step directories of a file system; a store is not one

    def delete(self, step: int) -> None:
        self._invalidate()
        self._clear(self.shard_path(step), what=f"delete step {step}")
        if self._hierarchical:
            self._rmdir(f"{self.root}/{step_dirname(step)}")  # the last rank out removes the step directory
        with self._lock:
            self._known.discard(step)

    def reject(self, step: int, reason: str) -> None:
        """Record the rejection in the step's prefix (every rank writes the same record), then delete the shard."""
        self._invalidate()
        with tempfile.TemporaryDirectory(prefix=f"lr-{self.name}-") as tmp:
            record = Path(tmp) / TOMBSTONE
            record.write_bytes(tombstone(step, reason))
            self._upload(record, f"{self.root}/{step_dirname(step)}/{TOMBSTONE}")
        self.delete(step)

    # ------------------------------------------------------------------ protocol pieces
    def _committed_steps(self, attempts: int) -> list[int]:
        self._invalidate()
        try:
            entries = self._call("list checkpoints", lambda: self._op("ls", self.root, detail=False), attempts)
        except FileNotFoundError:
            return []  # nothing written yet: on object stores an empty prefix does not exist
        steps = []
        for entry in entries:
            step = step_of_entry(entry)
            if step is None:
                continue
            if self._exists(f"{self.shard_path(step)}/{MANIFEST}", attempts):
                steps.append(step)
        return sorted(steps)

    def _remove_uncommitted(self) -> None:
        """Delete this rank's shards that have data but no manifest: uploads of a process that died mid-way."""
        self._invalidate()
        try:
            entries = self._call("list checkpoints", lambda: self._op("ls", self.root, detail=False), 1)
        except FileNotFoundError:
            return
        for entry in entries:
            step = step_of_entry(entry)
            if step is None:
                continue
            shard = self.shard_path(step)
            if not self._exists(f"{shard}/{MANIFEST}", 1) and self._find(shard, 1):
                log.info("tiers.%s: removing an uncommitted shard left by an earlier run: %s", self.name, shard)
                self._clear(shard, what="remove an uncommitted shard", attempts=1)

    def _clear(self, shard: str, *, what: str, attempts: int | None = None) -> None:
        """Remove a shard: the manifest first (after that the shard is not committed), then everything else."""
        names = self._find(shard, attempts)
        manifest = f"{shard}/{MANIFEST}"
        if manifest in names:
            try:
                self._call(f"{what}: un-commit", lambda: self._op("rm_file", manifest), attempts)
            except FileNotFoundError:
                pass
        rest = [n for n in names if n != manifest]
        if rest:
            try:
                self._call(f"{what}: remove files", lambda: self._op("rm", rest), attempts)
            except FileNotFoundError:
                pass
        if self._hierarchical:
            self._rmdir(shard)

    def _abandon(self, shard: str) -> None:
        """Best effort after a failed upload: one try to remove what was uploaded (it is not committed anyway)."""
        try:
            self._clear(shard, what="remove a failed upload", attempts=1)
        except (RemoteTierError, FileNotFoundError) as err:
            log.info("tiers.%s: leaving the uncommitted upload %s (%s); it is never read", self.name, shard, err)

    def _find(self, prefix: str, attempts: int | None = None) -> list[str]:
        try:
            found = self._call(f"list {prefix}", lambda: self._op("find", prefix), attempts)
        except FileNotFoundError:
            return []
        return [str(p) for p in found if str(p).startswith(f"{prefix}/")]

    def _exists(self, path: str, attempts: int | None = None) -> bool:
        # info() rather than exists(): exists() hides a rejected credential as "absent"
        try:
            self._call(f"look up {path}", lambda: self._op("info", path), attempts)
        except FileNotFoundError:
            return False
        return True

    def _rmdir(self, path: str) -> None:
        try:
            self._op("rmdir", path)
        except (OSError, ValueError):  # not empty (another rank's shard), already gone, or no directories
            pass

    def _commit(self, manifest: Path, shard: str) -> None:
        final = f"{shard}/{MANIFEST}"
        if not self._hierarchical:
            self._upload(manifest, final)  # one PUT: the object appears whole or not at all
            return
        # a file system copies in place: a crash mid-copy would leave a torn manifest; rename is atomic there
        partial = f"{shard}/.{MANIFEST}.tmp-{uuid.uuid4().hex[:12]}"
        self._upload(manifest, partial)
        self._call(f"commit {final}", lambda: self._op("mv", partial, final))

    def _upload(self, local: Path, remote: str) -> None:
        size = local.stat().st_size
        self._call(f"upload {remote}", lambda: self._op("put_file", str(local), remote, nbytes=size))

    def _download(self, remote: str, local: Path, nbytes: int) -> None:
        self._call(f"download {remote}", lambda: self._op("get_file", remote, str(local), nbytes=nbytes))

    def _invalidate(self) -> None:
        # listings are cached per filesystem instance; another rank or process may have changed the store
        self.fs.invalidate_cache()
