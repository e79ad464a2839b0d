"""docs/spec.md is the spec reference generated from RunSpec: it must be what the generator writes now."""

from __future__ import annotations

from pathlib import Path

from hetflow.spec import KEYS
from hetflow.spec.reference import reference

SPEC_MD = Path(__file__).resolve().parents[1] / "docs" / "spec.md"


def test_docs_spec_md_is_generated_from_the_spec():
    assert SPEC_MD.read_text() == reference(), "docs/spec.md is stale: run `make docs`"


def test_the_reference_names_every_key_with_its_path_and_description():
    text = SPEC_MD.read_text()
    for key in KEYS:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{key.short}` |"))
        assert f"`{key.dotted}`" in row and key.field.description.split("`")[0][:40] in row, key.short
