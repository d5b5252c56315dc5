"""flatten_state / unflatten_state: an exact, JSON-only round trip of realistic training states."""

from __future__ import annotations

import enum
import json
import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from lightning_resilience.checkpoint.tree import FlatState, TensorSpec, flatten_state, unflatten_state


def _roundtrip(state: Any, warn: Any = None) -> tuple[Any, FlatState]:
    """Flatten, send the skeleton through strict JSON and the tensors through fresh copies, rebuild."""
    flat = flatten_state(state, warn=warn)
    skeleton = json.loads(json.dumps(flat.skeleton, allow_nan=False))
    tensors = {name: t.clone() for name, t in flat.tensors.items()}
    return unflatten_state(skeleton, tensors), flat


def _assert_same(actual: Any, expected: Any, path: str = "state") -> None:
    """Deep equality that checks container and scalar types, tensor/array dtypes, and NaN == NaN.

    Dict subclasses (a module's ``OrderedDict`` state_dict) come back as plain dicts with the same order.
    """
    want_type = dict if isinstance(expected, dict) else type(expected)
    assert type(actual) is want_type, f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(actual, expected), path
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        np.testing.assert_array_equal(actual, expected, err_msg=path)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key, value in expected.items():
            _assert_same(actual[key], value, f"{path}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), path
        for i, (got, want) in enumerate(zip(actual, expected)):
            _assert_same(got, want, f"{path}[{i}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual), path
    else:
        assert actual == expected, path


def _adamw_after_one_step() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    model(torch.randn(5, 3)).pow(2).sum().backward()
    opt.step()
    return model, opt


def test_adamw_state_dict_roundtrip_is_exact_and_loadable() -> None:
    """An AdamW state_dict (int keys, tuple betas, None flags, 0-dim step) round-trips exactly and trains on."""
    model, opt = _adamw_after_one_step()
    state = {
        "epoch": 0,
        "global_step": 1,
        "state_dict": model.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [],
    }
    restored, _ = _roundtrip(state)
    _assert_same(restored, state)
    groups = restored["optimizer_states"][0]["param_groups"]
    assert groups[0]["betas"] == (0.8, 0.95) and isinstance(groups[0]["betas"], tuple)
    assert set(restored["optimizer_states"][0]["state"]) == {0, 1, 2, 3}

    # the restored state continues training exactly like the original
    clone = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    clone.load_state_dict(restored["state_dict"])
    clone_opt = torch.optim.AdamW(clone.parameters(), lr=0.5)
    clone_opt.load_state_dict(restored["optimizer_states"][0])
    x = torch.randn(5, 3)
    for m, o in ((model, opt), (clone, clone_opt)):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)


def test_tensor_names_are_paths_in_the_tree() -> None:
    """Tensors are named by their path ("optimizer_states/0/state/1/exp_avg"), with '/' in keys escaped."""
    model, opt = _adamw_after_one_step()
    flat = flatten_state(
        {
            "state_dict": model.state_dict(),
            "optimizer_states": [opt.state_dict()],
            "odd/key": torch.zeros(1),
            "arr": np.zeros(2),
        }
    )
    expected = {f"state_dict/{k}" for k in model.state_dict()}
    for i in range(4):
        expected |= {f"optimizer_states/0/state/{i}/{k}" for k in ("step", "exp_avg", "exp_avg_sq")}
    expected |= {"odd%2Fkey", "arr"}
    assert set(flat.tensors) == expected
    assert torch.equal(flat.tensors["optimizer_states/0/state/1/exp_avg"], opt.state_dict()["state"][1]["exp_avg"])
    assert flat.specs()["state_dict/0.weight"] == TensorSpec((4, 3), torch.float32)
    assert set(flatten_state(torch.ones(2)).tensors) == {"_root"}


def test_tensors_are_referenced_not_copied_and_detached() -> None:
    """flatten_state hands out the live storage (the snapshot copies it), detached from autograd."""
    w = torch.ones(3, requires_grad=True)
    flat = flatten_state({"w": w})
    assert flat.tensors["w"].data_ptr() == w.data_ptr()
    assert not flat.tensors["w"].requires_grad


def test_numpy_arrays_roundtrip_with_dtype_and_layout() -> None:
    """NumPy arrays of every numeric dtype (incl. 0-dim and non-contiguous views) come back as equal arrays."""
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    state = {
        "f64": base,
        "f32": base.astype(np.float32),
        "f16": base.astype(np.float16),
        "i64": np.array([-(2**62), 0, 2**62], dtype=np.int64),
        "i32": np.array([-3, 4], dtype=np.int32),
        "u8": np.array([0, 255], dtype=np.uint8),
        "bool": np.array([True, False]),
        "strided": base[::2, ::3],
        "transposed": base.T,
        "empty": np.zeros((0, 3), dtype=np.int16),
    }
    restored, flat = _roundtrip(state)
    _assert_same(restored, state)
    assert all(isinstance(flat.skeleton["d"][k], dict) and "np" in flat.skeleton["d"][k] for k in state)


def test_zero_dim_numpy_array_keeps_its_shape() -> None:
    """A 0-dim ndarray (np.array(3.5)) comes back 0-dim, not as shape (1,)."""
    restored, flat = _roundtrip({"scalar": np.array(3.5), "count": np.array(7, dtype=np.int64)})
    assert flat.specs()["scalar"].shape == ()
    _assert_same(restored, {"scalar": np.array(3.5), "count": np.array(7, dtype=np.int64)})


def test_numpy_scalars_become_python_scalars() -> None:
    """NumPy scalar values (np.int64, np.bool_, np.float32) are stored as plain JSON numbers/bools."""
    restored, _ = _roundtrip({"i": np.int64(7), "b": np.bool_(True), "f": np.float32(0.5)})
    _assert_same(restored, {"i": 7, "b": True, "f": 0.5})


def test_scalars_bytes_nonfinite_dtypes_devices_and_nested_containers_roundtrip() -> None:
    """Every supported non-tensor value returns with its exact type and value; tuples stay tuples."""
    state = {
        "none": None,
        "flags": [True, False, 0, 1],
        "big": 2**70,
        "neg": -(2**40),
        "pi": math.pi,
        "inf": math.inf,
        "ninf": -math.inf,
        "nan": math.nan,
        "text": "héllo/wörld",
        "bytes": b"\x00\x01\xfe\xff" * 5,
        "empty_bytes": b"",
        "dtypes": [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8],
        "devices": (torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")),
        "nested": (1, (2, (3, ("x", None))), [], (), {}),
        "int_keys": {3: "a", 1: "b"},
        "mixed_keys": {1: torch.ones(1), "one": 2.0},
        "tuple_keys": {(1, "a"): [torch.zeros(2)], (2, "b"): ()},
        "float_keys": {0.5: 1},
        "a/b": {"c/d": torch.arange(3)},
    }
    restored, _ = _roundtrip(state)
    _assert_same(restored, state)
    assert type(restored["flags"][0]) is bool and type(restored["flags"][2]) is int


def test_bytearray_roundtrips_as_bytes() -> None:
    """A bytearray keeps its content (it is restored as immutable bytes)."""
    restored, _ = _roundtrip({"buf": bytearray(b"\x10\x20")})
    assert restored == {"buf": b"\x10\x20"}


def test_colliding_paths_keep_both_tensors() -> None:
    """Keys that render to the same path (int 0 and str '0', 'a/b' and 'a%2Fb') never overwrite each other."""
    state = {0: torch.zeros(1), "0": torch.ones(1)}
    restored, flat = _roundtrip(state)
    assert len(flat.tensors) == 2
    _assert_same(restored, state)
    state2 = {"a/b": torch.zeros(1), "a%2Fb": torch.ones(1)}
    restored2, flat2 = _roundtrip(state2)
    assert len(flat2.tensors) == 2
    _assert_same(restored2, state2)


def test_skeleton_is_strict_json_and_rebuilt() -> None:
    """The skeleton dumps with allow_nan=False and does not alias the live containers."""
    history = [1.0, math.nan]
    _, opt = _adamw_after_one_step()
    flat = flatten_state({"history": history, "opt": opt.state_dict(), "blob": b"\xff", "dt": torch.half})
    json.dumps(flat.skeleton, allow_nan=False)
    before = json.dumps(flat.skeleton)
    history.append(3.0)
    history[0] = 9.0
    assert json.dumps(flat.skeleton) == before


class _Opaque:
    def __repr__(self) -> str:
        return "<opaque>"


class _Color(enum.Enum):
    RED = "red"


def test_unknown_values_are_stored_as_repr_with_one_warning_per_kind() -> None:
    """Values the codec cannot store are kept as their repr; the warn callback fires once per kind, not per value."""
    messages: list[str] = []
    state = {"a": _Opaque(), "b": [_Opaque(), _Opaque()], "c": {1, 2}, "d": ({3},), "e": _Color.RED}
    restored, flat = _roundtrip(state, warn=messages.append)
    assert len(messages) == 3, messages
    assert sum("_Opaque" in m for m in messages) == 1
    assert sum(" set " in m for m in messages) == 1
    assert sum("_Color" in m for m in messages) == 1
    assert restored == {
        "a": "<opaque>",
        "b": ["<opaque>", "<opaque>"],
        "c": "{1, 2}",
        "d": ("{3}",),
        "e": repr(_Color.RED),
    }
    json.dumps(flat.skeleton, allow_nan=False)
    # each call reports its own kinds again
    flatten_state({"x": _Opaque()}, warn=messages.append)
    assert len(messages) == 4


def test_unknown_values_warn_through_warnings_by_default() -> None:
    """Without a warn callback, one UserWarning per kind is issued."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flatten_state({"a": _Opaque(), "b": _Opaque(), "c": {1}})
    texts = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(texts) == 2, texts
    assert all("not restorable" in t for t in texts)


class _Mode(enum.IntEnum):
    FAST = 1


def test_int_enum_is_not_silently_stringified() -> None:
    """An IntEnum is stored as its repr (a str replaces an int on restore), so like any lossy value it must warn."""
    messages: list[str] = []
    restored, _ = _roundtrip({"mode": _Mode.FAST}, warn=messages.append)
    if restored["mode"] == _Mode.FAST:
        return  # stored faithfully as its value: no warning needed
    assert len(messages) == 1 and "_Mode" in messages[0], (restored, messages)


def test_numpy_float64_nonfinite_roundtrips() -> None:
    """np.float64 is a float subclass; inf/nan held as np.float64 (e.g. a metric from numpy) must round-trip."""
    state = {"best": np.float64(np.inf), "worst": np.float64(-np.inf), "last": np.float64(np.nan)}
    restored, _ = _roundtrip(state)
    assert restored["best"] == math.inf and restored["worst"] == -math.inf and math.isnan(restored["last"])


def test_unsupported_numpy_array_is_stored_as_repr_not_a_crash() -> None:
    """A NumPy array torch cannot hold (str/object dtype) is a lossy value: repr + one warning, not a TypeError."""
    messages: list[str] = []
    flat = flatten_state(
        {"labels": np.array(["cat", "dog"]), "objs": np.array([None, 1], dtype=object)}, warn=messages.append
    )
    assert flat.tensors == {}
    json.dumps(flat.skeleton, allow_nan=False)
    assert len(messages) >= 1


def test_unflatten_rejects_bad_input() -> None:
    """A skeleton naming a missing tensor raises KeyError; an unknown tag or malformed node raises ValueError."""
    with pytest.raises(KeyError):
        unflatten_state({"T": "missing"}, {})
    with pytest.raises(ValueError, match="unknown checkpoint skeleton tag"):
        unflatten_state({"zz": 1}, {})
    with pytest.raises(ValueError, match="malformed"):
        unflatten_state({"d": {}, "l": []}, {})
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        unflatten_state({"dt": "not_a_dtype"}, {})
