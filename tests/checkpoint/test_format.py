"""The shard format: what is written, what a reader trusts, and that loading never runs stored code."""

from __future__ import annotations

import ast
import json
import os
import pickle
import platform
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import lightning_resilience
from lightning_resilience._version import __version__
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.format import FORMAT, MANIFEST, SKELETON, Manifest, read_shard, write_shard
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tree import TensorSpec, unflatten_state
from tests.checkpoint.conftest import (
    assert_state_equal,
    assert_tensors_equal,
    data_file,
    flip_byte,
    make_snapshot,
    make_state,
    rewrite_manifest,
)

PACKAGE_ROOT = Path(lightning_resilience.__file__).parent


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    """A freshly written, valid shard of step 7 (rank 1 of 3)."""
    path = tmp_path / "shard"
    write_shard(path, make_snapshot(7), rank=1, world_size=3, rank_layout={"rank": 1, "world_size": 3})
    return path


def _xxh3(path: Path) -> str:
    return xxhash.xxh3_64(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------ round trip
def test_round_trip_restores_every_tensor_and_skeleton_value(shard: Path) -> None:
    """read_shard(write_shard(s)) gives back the same tensors bit for bit and the same nested state."""
    manifest, loaded = read_shard(shard)
    expected = make_snapshot(7)
    assert loaded.step == 7
    assert loaded.meta == {"epoch": 2}
    assert_tensors_equal(loaded.tensors, expected.tensors)
    assert loaded.skeleton == expected.skeleton
    assert_state_equal(unflatten_state(loaded.skeleton, loaded.tensors), make_state(7))
    assert manifest.step == 7 and manifest.rank == 1 and manifest.world_size == 3


def test_round_trip_covers_the_dtypes_and_shapes_that_matter(shard: Path) -> None:
    """int64 beyond 2**32, bfloat16, bool and 0-dim tensors survive with dtype and shape intact."""
    _, loaded = read_shard(shard)
    state = unflatten_state(loaded.skeleton, loaded.tensors)
    assert state["ids"].dtype == torch.int64 and int(state["ids"][-1]) == 4 << 40
    assert state["model"]["bias"].dtype == torch.bfloat16
    assert state["model"]["counter"].shape == () and int(state["model"]["counter"]) == 49
    assert state["mask"].dtype == torch.bool
    assert state["optimizer"]["state"][0]["step"].shape == ()
    assert isinstance(state["optimizer"]["param_groups"][0]["betas"], tuple)
    assert list(state["optimizer"]["state"]) == [0]  # int key, not "0"
    assert state["rng"] == b"\x00\x01\xfe\xff" * 3
    assert state["loss_scale"] == float("inf") and state["best"] == float("-inf")


def test_loaded_tensors_are_fresh_allocations(shard: Path) -> None:
    """Two reads of one shard never share storage (a restored state must own its memory)."""
    _, first = read_shard(shard)
    _, second = read_shard(shard)
    for name, tensor in first.tensors.items():
        if tensor.numel():
            assert tensor.data_ptr() != second.tensors[name].data_ptr(), name


def test_round_trip_without_tensors(tmp_path: Path) -> None:
    """A state with no tensors at all is a valid shard (skeleton and manifest only)."""
    snap = StagedSnapshot(3, {"d": {"x": 1}}, {})
    write_shard(tmp_path / "s", snap, rank=0, world_size=1)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [MANIFEST, SKELETON]
    _, loaded = read_shard(tmp_path / "s")
    assert loaded.skeleton == {"d": {"x": 1}} and loaded.tensors == {}


def test_write_refuses_an_existing_directory(shard: Path) -> None:
    """A shard directory is private to its writer: writing into an existing one fails instead of mixing files."""
    with pytest.raises(FileExistsError):
        write_shard(shard, make_snapshot(8), rank=1, world_size=3)


# ---------------------------------------------------------------------------------------------------- manifest
def test_manifest_records_identity_files_checksums_and_versions(shard: Path) -> None:
    """The manifest names step, rank, world size, every other file with its true size and xxh3-64, and versions."""
    data = json.loads((shard / MANIFEST).read_text())
    assert data["format"] == FORMAT
    assert (data["step"], data["rank"], data["world_size"]) == (7, 1, 3)
    assert data["rank_layout"] == {"rank": 1, "world_size": 3}
    on_disk = {p.name for p in shard.iterdir()} - {MANIFEST}
    assert set(data["files"]) == on_disk
    assert {SKELETON, ".metadata", data_file(shard).name} <= on_disk
    for name, info in data["files"].items():
        assert info == {"size": (shard / name).stat().st_size, "xxh3_64": _xxh3(shard / name)}, name
    assert data["versions"] == {
        "lightning_resilience": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    assert data["meta"] == {"epoch": 2}
    assert data["created"] > 0


def test_manifest_tensor_specs_match_the_snapshot(shard: Path) -> None:
    """Every tensor is listed with its shape and dtype, enough to pre-allocate the load buffers."""
    manifest = Manifest.from_json((shard / MANIFEST).read_text(), where=str(shard))
    expected = make_snapshot(7).specs()
    assert manifest.tensors == expected
    assert manifest.tensors["model/counter"] == TensorSpec((), torch.int64)
    assert manifest.tensors["model/bias"] == TensorSpec((3,), torch.bfloat16)


# -------------------------------------------------------------------------------------------------- corruption
def _assert_corrupt(shard: Path, *fragments: str) -> CheckpointCorruptError:
    with pytest.raises(CheckpointCorruptError) as info:
        read_shard(shard)
    message = str(info.value)
    assert str(shard) in message, f"error does not name the shard: {message}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return info.value


def test_truncated_data_file_is_corrupt(shard: Path) -> None:
    """A data file cut short (a torn write) is caught by the size check and named."""
    path = data_file(shard)
    path.write_bytes(path.read_bytes()[:-9])
    _assert_corrupt(shard, path.name, "bytes")


def test_one_flipped_byte_in_data_file_is_corrupt(shard: Path) -> None:
    """Same size, one byte inverted (bit rot): only the checksum can tell, and it does."""
    path = data_file(shard)
    size = path.stat().st_size
    flip_byte(path)
    assert path.stat().st_size == size
    _assert_corrupt(shard, "checksum", path.name)


@pytest.mark.parametrize("name", [SKELETON, ".metadata"])
def test_flipped_byte_in_any_listed_file_is_corrupt(shard: Path, name: str) -> None:
    """The checksum covers the skeleton and DCP metadata too, not only tensor data."""
    flip_byte(shard / name)
    _assert_corrupt(shard, "checksum", name)


def test_deleted_data_file_is_corrupt(shard: Path) -> None:
    """A file the manifest lists but the directory lacks is reported as missing."""
    path = data_file(shard)
    path.unlink()
    _assert_corrupt(shard, "missing", path.name)


def test_missing_manifest_is_corrupt(shard: Path) -> None:
    """Without a manifest (the writer died before its last file) nothing in the directory is trusted."""
    (shard / MANIFEST).unlink()
    _assert_corrupt(shard, "manifest")


def test_missing_directory_is_corrupt(tmp_path: Path) -> None:
    """Reading a shard that was never written is a corrupt-checkpoint error, not a bare FileNotFoundError."""
    _assert_corrupt(tmp_path / "nothing-here")


@pytest.mark.parametrize("escape", ["../x", "/tmp/../{tmp}/x", "sub/../../x", "..", "."])
def test_manifest_naming_a_path_outside_the_shard_is_corrupt(shard: Path, escape: str) -> None:
    """A manifest may name only files directly inside its directory, even when the outside file checks out."""
    outside = shard.parent / "x"
    outside.write_bytes(b"outside the shard")
    name = escape.format(tmp=shard.parent.relative_to("/"))

    def add_escape(manifest: Manifest) -> None:
        manifest.files[name] = {"size": outside.stat().st_size, "xxh3_64": _xxh3(outside)}

    rewrite_manifest(shard, add_escape)
    _assert_corrupt(shard, "outside")


def test_manifest_naming_a_symlink_that_leaves_the_shard_is_corrupt(shard: Path) -> None:
    """A symlink inside the directory that points out of it is an escape as well."""
    outside = shard.parent / "x"
    outside.write_bytes(b"outside the shard")
    (shard / "link").symlink_to(outside)
    rewrite_manifest(shard)  # the new entry is picked up below
    rewrite_manifest(
        shard, lambda m: m.files.__setitem__("link", {"size": outside.stat().st_size, "xxh3_64": _xxh3(outside)})
    )
    _assert_corrupt(shard, "outside")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{not json",
        "[]",
        "null",
        '"a string"',
        json.dumps({"format": "someone-else/v9", "step": 1}),
        json.dumps({"format": FORMAT}),
        json.dumps({"format": FORMAT, "step": "seven", "rank": 0, "world_size": 1, "tensors": {}, "files": {}}),
        json.dumps({"format": FORMAT, "step": 7, "rank": 0, "world_size": 1, "tensors": {}, "files": {"a": 3}}),
        json.dumps(
            {
                "format": FORMAT,
                "step": 7,
                "rank": 0,
                "world_size": 1,
                "tensors": {"w": {"shape": [2], "dtype": "x"}},
                "files": {},
            }
        ),
        json.dumps({"format": FORMAT, "step": 7, "rank": 0, "world_size": 1, "tensors": {}, "files": {}}),
    ],
    ids=[
        "empty",
        "not-json",
        "list",
        "null",
        "string",
        "foreign-format",
        "no-fields",
        "bad-step",
        "file-info-not-a-dict",
        "unknown-dtype",
        "no-skeleton-listed",
    ],
)
def test_garbage_manifest_is_corrupt(shard: Path, text: str) -> None:
    """Any manifest that does not parse into a complete, known-format manifest is corrupt, never another error."""
    (shard / MANIFEST).write_text(text)
    _assert_corrupt(shard)


def test_manifest_with_binary_garbage_is_corrupt(shard: Path) -> None:
    """A manifest overwritten with non-UTF-8 bytes (a misdirected write) is corrupt."""
    (shard / MANIFEST).write_bytes(b"\xff\xfe\x00garbage\x80")
    _assert_corrupt(shard, "manifest")


def test_manifest_with_nul_in_a_file_name_is_corrupt(shard: Path) -> None:
    """A file name the OS cannot even stat (embedded NUL) must still surface as CheckpointCorruptError.

    Restore only skips shards that raise CheckpointCorruptError; any other exception aborts the whole fallback.
    """
    rewrite_manifest(shard, lambda m: m.files.__setitem__("bad\x00name", {"size": 1, "xxh3_64": "0"}))
    _assert_corrupt(shard)


def test_manifest_size_disagreeing_with_file_is_corrupt(shard: Path) -> None:
    """A manifest whose recorded size was corrupted fails too (the manifest is not trusted blindly)."""
    name = data_file(shard).name
    rewrite_manifest(shard, lambda m: m.files[name].__setitem__("size", m.files[name]["size"] + 1))
    _assert_corrupt(shard, name)


def test_tampered_skeleton_is_corrupt(shard: Path) -> None:
    """An edited skeleton (same length, one value changed) fails its checksum."""
    path = shard / SKELETON
    text = path.read_text()
    assert '"step"' in text
    path.write_text(text.replace('{"d":{"step":7', '{"d":{"step":8', 1))
    assert path.read_text() != text
    _assert_corrupt(shard, "checksum", SKELETON)


def test_re_signed_non_json_skeleton_is_corrupt(shard: Path) -> None:
    """A skeleton replaced by non-JSON and re-checksummed still fails to load, as CheckpointCorruptError."""
    (shard / SKELETON).write_bytes(b"\x80\x04not json")
    rewrite_manifest(shard)
    _assert_corrupt(shard, "unreadable")


def test_re_signed_tensor_spec_mismatch_is_corrupt(shard: Path) -> None:
    """A manifest whose tensor spec disagrees with the DCP data (re-signed) fails as CheckpointCorruptError."""
    rewrite_manifest(shard, lambda m: m.tensors.__setitem__("model/weight", TensorSpec((5, 3), torch.float32)))
    _assert_corrupt(shard)


def test_verify_checksums_off_still_checks_sizes(shard: Path) -> None:
    """Turning checksums off (trusted local disk) keeps the cheap size check against torn writes."""
    path = data_file(shard)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CheckpointCorruptError, match="bytes"):
        read_shard(shard, verify_checksums=False)


# ------------------------------------------------------------------------------------------------ safe loading
class _Exploit:
    """Pickles to a call of ``os.system(command)`` on load."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def _dotted_global_exploit(command: str) -> bytes:
    """A protocol-4 pickle that reaches ``os.system`` *through* an allow-listed DCP module.

    ``STACK_GLOBAL("torch.distributed.checkpoint.filesystem", "os.system")``: with protocol >= 4 the unpickler
    resolves dotted names attribute by attribute, so a module allow-list alone does not stop this.
    """

    def text(s: str) -> bytes:
        raw = s.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw

    return (
        pickle.PROTO
        + b"\x04"
        + text("torch.distributed.checkpoint.filesystem")
        + text("os.system")
        + pickle.STACK_GLOBAL
        + text(command)
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )


@pytest.mark.parametrize(
    "craft",
    [
        lambda cmd: pickle.dumps(_Exploit(cmd), protocol=2),
        lambda cmd: pickle.dumps(_Exploit(cmd), protocol=pickle.HIGHEST_PROTOCOL),
        _dotted_global_exploit,
    ],
    ids=["reduce-proto2", "reduce-highest", "dotted-global-via-allowed-module"],
)
def test_malicious_dcp_metadata_is_refused_without_running_it(shard: Path, craft: Any) -> None:
    """A re-checksummed ``.metadata`` that would call os.system is rejected, and the command never runs.

    The manifest is made consistent, so the allow-list unpickler is the only line of defence being tested.
    """
    marker = shard.parent / "pwned"
    (shard / ".metadata").write_bytes(craft(f"touch {marker}"))
    rewrite_manifest(shard)
    try:
        with pytest.raises(CheckpointCorruptError):
            read_shard(shard)
    finally:
        assert not marker.exists(), "loading checkpoint metadata executed stored code"


def _package_sources() -> list[Path]:
    sources = sorted(PACKAGE_ROOT.rglob("*.py"))
    assert len(sources) > 10, f"found too few sources under {PACKAGE_ROOT}"
    return sources


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def test_no_unsafe_deserialisation_in_the_package() -> None:
    """Every torch.load passes weights_only=True, and pickle.load/loads is never called (nor imported bare)."""
    offenders = []
    for path in _package_sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE_ROOT.parent)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Call):
                name = _dotted(node.func)
                if name in ("torch.load", "torch.serialization.load"):
                    safe = any(
                        k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                        for k in node.keywords
                    )
                    if not safe:
                        offenders.append(f"{where}: {name}( without weights_only=True")
                if name in ("pickle.load", "pickle.loads", "cPickle.load", "dill.load", "dill.loads"):
                    offenders.append(f"{where}: {name}(")
            if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "torch", "torch.serialization"):
                bare = {a.name for a in node.names} & {"load", "loads"}
                if bare:
                    offenders.append(f"{where}: from {node.module} import {', '.join(sorted(bare))}")
    assert not offenders, "unsafe deserialisation:\n" + "\n".join(offenders)


def test_textual_scan_agrees_with_the_ast_scan() -> None:
    """A plain-text scan as a backstop: catches calls the AST scan might miss (e.g. in aliases or strings)."""
    offenders = []
    for path in _package_sources():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if "pickle.load(" in code or "pickle.loads(" in code:
                offenders.append(f"{path}:{lineno}: {line.strip()}")
            if "torch.load(" in code and "weights_only=True" not in code:
                offenders.append(f"{path}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
