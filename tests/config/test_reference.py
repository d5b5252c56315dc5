"""docs/configuration.md is generated from the config dataclasses; it must not go stale."""

from __future__ import annotations

from pathlib import Path

from lightning_resilience.config.reference import field_docs, render
from lightning_resilience.config.registry import schemas

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_reference_is_current() -> None:
    assert DOC.read_text() == render(), (
        "docs/configuration.md is stale: run `python -m lightning_resilience.config.reference > docs/configuration.md`"
    )


def test_every_field_is_documented() -> None:
    import dataclasses

    missing = [
        f"{cls.__name__}.{f.name}"
        for cls in schemas().values()
        for f in dataclasses.fields(cls)
        if not field_docs(cls).get(f.name)
    ]
    assert missing == [], f"fields without a docstring: {missing}"
