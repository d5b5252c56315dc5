"""Which remote-store failures are worth a retry, the error a remote tier raises when it gives up (naming what to fix),
and the check of a URL's protocols."""

from __future__ import annotations

import asyncio
import errno
import functools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import fsspec

from lightning_resilience._configurable import ConfigError

__all__ = ["RemoteFault", "RemoteTierError", "StoreAddress", "check_protocols", "classify_error"]


# error codes of S3 and S3-compatible stores (botocore ClientError), by what they mean for a retry
# fmt: off
_TRANSIENT_CODES = frozenset({
    "InternalError", "ServiceUnavailable", "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "RequestThrottled", "TooManyRequestsException", "RequestTimeout", "RequestTimeoutException",
    "PriorRequestNotComplete", "OperationAborted",
})
_CREDENTIAL_CODES = frozenset({
    "AccessDenied", "AllAccessDisabled", "ExpiredToken", "InvalidAccessKeyId", "InvalidClientTokenId", "InvalidToken",
    "SignatureDoesNotMatch", "TokenRefreshRequired", "UnrecognizedClientException",
})
# credential errors raised before any request (botocore, google-auth), matched by name: both are optional
_CREDENTIAL_ERROR_NAMES = frozenset({
    "NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "RefreshError",
    "DefaultCredentialsError",
})
# fmt: on
# errno values of a destination that will not heal by retrying within seconds
_PERMANENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.ENAMETOOLONG, errno.EINVAL, errno.ENOTDIR, errno.EISDIR}
)
_REMOTE_MODULES = ("botocore", "aiobotocore", "s3fs", "aiohttp", "gcsfs", "google", "adlfs", "azure", "fsspec")


class RemoteFault(str, Enum):
    """Why a remote operation failed."""

    TRANSIENT = "transient"
    """Connection refused/reset, timeout, 5xx, throttling: retried, then reported."""
    CREDENTIALS = "credentials"
    """The store rejected (or could not find) the credentials: fix tiers.<name>.storage_options or the env."""
    NO_BUCKET = "no_bucket"
    """The bucket (container, root directory) of tiers.<name>.url does not exist."""
    NOT_FOUND = "not_found"
    """An object is missing (a shard that is not committed, a file deleted underneath)."""
    PERMANENT = "permanent"
    """Any other refusal of the store; retrying will not help."""
    BUG = "bug"
    """Not a storage fault at all: re-raised as is."""


class RemoteTierError(OSError):
    """A remote-tier operation failed; an ``OSError``, so the manager counts it and training continues.

    Attributes:
        fault: why it failed.
        attempts: how many times the operation was tried.
    """

    def __init__(self, message: str, *, fault: RemoteFault, attempts: int = 1) -> None:
        super().__init__(message)
        self.fault = fault
        self.attempts = attempts

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (str(self), self.fault.value, self.attempts))


def _rebuild_error(message: str, fault: str, attempts: int) -> RemoteTierError:
    return RemoteTierError(message, fault=RemoteFault(fault), attempts=attempts)


@functools.lru_cache(maxsize=1)
def _botocore_transient() -> tuple[type[BaseException], ...]:
    try:
        from botocore import exceptions as bce
    except ImportError:
        return ()
    return (bce.ConnectionError, bce.HTTPClientError)


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen and len(seen) < 8:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _http_status(exc: BaseException) -> tuple[str | None, int | None]:
    """The error code and HTTP status of a botocore ClientError, a gcsfs HttpError or an aiohttp response error."""
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        error = response.get("Error") or {}
        meta = response.get("ResponseMetadata") or {}
        code = error.get("Code")
        status = meta.get("HTTPStatusCode")
        if status is None and isinstance(code, str) and code.isdigit():
            status = int(code)
        return (str(code) if code is not None else None, status if isinstance(status, int) else None)
    for attr in ("status", "code", "status_code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return None, value
    return None, None


def classify_error(err: BaseException) -> RemoteFault:
    """Sort an exception raised by an fsspec backend into a :class:`RemoteFault`."""
    for exc in _chain(err):
        code, status = _http_status(exc)
        if code == "NoSuchBucket":
            return RemoteFault.NO_BUCKET
        if code in _CREDENTIAL_CODES or status in (401, 403):
            return RemoteFault.CREDENTIALS
        if code in _TRANSIENT_CODES or status == 429 or (status is not None and status >= 500):
            return RemoteFault.TRANSIENT
        if code in ("NoSuchKey", "NotFound") or status == 404:
            return RemoteFault.NOT_FOUND
        if type(exc).__name__ in _CREDENTIAL_ERROR_NAMES:
            return RemoteFault.CREDENTIALS
    if isinstance(err, PermissionError):
        return RemoteFault.CREDENTIALS
    if isinstance(err, FileNotFoundError):
        return RemoteFault.NOT_FOUND
    if isinstance(err, (TimeoutError, asyncio.TimeoutError, ConnectionError, *_botocore_transient())):
        return RemoteFault.TRANSIENT
    if isinstance(err, FileExistsError | NotADirectoryError | IsADirectoryError):
        return RemoteFault.PERMANENT
    if isinstance(err, OSError):
        return RemoteFault.PERMANENT if err.errno in _PERMANENT_ERRNOS else RemoteFault.TRANSIENT
    if any(cls.__module__.split(".")[0] in _REMOTE_MODULES for cls in type(err).__mro__):
        # aiohttp's payload errors and the like are transient; a ClientError with a 4xx code is not
        name = type(err).__name__
        return RemoteFault.TRANSIENT if "Timeout" in name or "Connection" in name else RemoteFault.PERMANENT
    return RemoteFault.BUG


@dataclass(frozen=True)
class StoreAddress:
    """Where a remote tier's checkpoints live, as its error messages name it."""

    name: str
    """The tier's name (``tiers.<name>.url`` in messages)."""
    url: str
    protocol: str
    root: str
    hierarchical: bool
    """A file system with directories (else an object store whose "directories" are key prefixes)."""
    options: Mapping[str, Any]

    @property
    def endpoint(self) -> str:
        """Who answers for this URL, for error messages."""
        if self.protocol in ("s3", "s3a"):
            client_kwargs = self.options.get("client_kwargs") or {}
            endpoint = (
                client_kwargs.get("endpoint_url")
                or self.options.get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL")
            )
            return str(endpoint) if endpoint else "AWS S3"
        return f"the {self.protocol} store"

    def error(self, what: str, err: BaseException, fault: RemoteFault, attempts: int) -> RemoteTierError:
        """The error a tier raises when it gives up on ``what``: what failed, where, and what to fix."""
        key = f"tiers.{self.name}"
        cause = f"{type(err).__name__}: {err}"
        if fault is RemoteFault.CREDENTIALS and self.protocol in ("file", "local"):
            message = (
                f"{what}: permission denied under {key}.url={self.url} ({cause}); check the directory's owner/mode"
            )
        elif fault is RemoteFault.CREDENTIALS:
            env = {"s3": "AWS_* env", "s3a": "AWS_* env", "gs": "GOOGLE_APPLICATION_CREDENTIALS", "gcs": "GOOGLE_*"}
            message = (
                f"{what}: credentials rejected by {self.endpoint} for {key}.url={self.url} ({cause}); check "
                f"{key}.storage_options (key/secret) or {env.get(self.protocol, 'the backend environment')}"
            )
        elif fault is RemoteFault.NO_BUCKET and self.hierarchical:
            message = f"{what}: directory {self.root!r} vanished ({key}.url={self.url}) ({cause})"
        elif fault is RemoteFault.NO_BUCKET:
            bucket = self.root.split("/", 1)[0]
            message = (
                f"{what}: bucket {bucket!r} does not exist ({key}.url={self.url}); create it or fix {key}.url ({cause})"
            )
        elif fault is RemoteFault.TRANSIENT:
            message = (
                f"{what}: failed {attempts} time(s), last with {cause}; {self.endpoint} is unreachable or failing "
                f"({key}.url={self.url}); checkpoints already in the store are untouched "
                f"(knobs: {key}.retries, {key}.timeout_s)"
            )
        else:
            message = f"{what}: refused by {self.endpoint} ({cause}); {key}.url={self.url}"
        return RemoteTierError(f"{key}: {message}", fault=fault, attempts=attempts)


def check_protocols(url: str, key: str) -> str:
    """Validate every protocol of a (possibly chained) URL; return the innermost one."""
    protocol = "file"
    for part in url.split("::"):
        found, _ = fsspec.core.split_protocol(part)
        protocol = found or "file"
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError as err:
            raise ConfigError(
                key,
                "url",
                f"has an unknown protocol {protocol!r} ({err}): use s3://, gs://, az://, file://, memory:// or "
                f"another fsspec protocol; got {url!r}",
            ) from err
        except ImportError as err:
            raise ImportError(
                f"{key}.url={url!r} needs a package that is not installed: {err} "
                "(for S3: pip install 'lightning-resilience[s3]')"
            ) from err
    return protocol
