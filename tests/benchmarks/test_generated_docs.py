"""docs/benchmarks.md and the README's figures are generated from benchmarks/results/*.json and must agree with them:
a result changed without regenerating (``python -m benchmarks.run_all --docs-only``) fails here."""

from __future__ import annotations

import json

from benchmarks import run_all


def test_docs_and_readme_figures_match_the_results() -> None:
    for path, text in run_all.generated(run_all.collect()).items():
        assert path.read_text() == text, f"{path.name} is stale: run `python -m benchmarks.run_all --docs-only`"


def test_every_result_has_a_readme_line_and_a_section() -> None:
    sections = run_all.collect()
    block = run_all.render_readme_figures(sections)
    docs = run_all.render_docs(sections)
    for name, result, module, _ in sections:
        title = getattr(module, "TITLE", name)
        assert f"## {title}" in docs, name
        if result is not None:
            summary = getattr(module, "readme_summary", None)
            line = summary(result) if callable(summary) else run_all._generic_summary(module, result)
            assert line in block, name


def test_a_changed_result_makes_the_readme_stale(tmp_path) -> None:  # type: ignore[no-untyped-def]
    sections = run_all.collect()
    name, result, _module, _path = next(s for s in sections if s[1] is not None and s[1].get("targets"))
    changed = json.loads(json.dumps(result))
    changed["targets"][0]["verdict"] = "PASS" if changed["targets"][0]["verdict"] == "MISS" else "MISS"
    changed["targets"][0]["value"] = -12345.0
    altered = [(n, changed if n == name else r, m, p) for n, r, m, p in sections]
    assert run_all.render_docs(altered) != run_all.render_docs(sections) or run_all.render_readme_figures(
        altered
    ) != run_all.render_readme_figures(sections)
