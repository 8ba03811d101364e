"""The Parquet output contract (normfast.data.schema): what the engine writes is what is
registered, the registry is versioned, and the docs' "Output format" page is rendered from it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

import normfast
from normfast.data import schema

ROOT = Path(__file__).resolve().parents[2]

HOW_TO = (
    "to change the output format: edit normfast/data/schema.py (COLUMNS / METADATA_KEYS), then in "
    "normfast/data/schema_versions.py bump SCHEMA_VERSION, add the new version and what `python -m "
    "normfast.data.schema --fingerprint` prints to RELEASED and COLUMN_LAYOUTS, one line in CHANGES (the "
    "docs' Output format page renders the registry itself); a metadata key the rows depend on joins the "
    "resume key (normfast/data/resume_key.py)"
)


def test_the_registry_changes_only_with_a_new_version():
    current = schema.schema_fingerprint()
    released = schema.RELEASED.get(schema.SCHEMA_VERSION)
    assert released is not None, f"SCHEMA_VERSION {schema.SCHEMA_VERSION} is not in RELEASED; {HOW_TO}"
    assert current == released, (
        f"the columns or metadata keys changed (fingerprint {current}) but SCHEMA_VERSION is still "
        f"{schema.SCHEMA_VERSION} (released as {released}); {HOW_TO}"
    )
    assert schema.SCHEMA_VERSION in schema.CHANGES, f"CHANGES has no line for version {schema.SCHEMA_VERSION}"
    assert max(schema.RELEASED) == schema.SCHEMA_VERSION
    names = [c.name for c in schema.COLUMNS]
    assert len(names) == len(set(names)), "a column is registered twice"


def test_the_fingerprint_sees_a_changed_column():
    cols = list(schema.COLUMNS)
    renamed = [schema.Column("V2x", c.type, c.when, c.meaning) if c.name == "V2" else c for c in cols]
    retyped = [schema.Column(c.name, "float", c.when, c.meaning) if c.name == "V2" else c for c in cols]
    base = schema.schema_fingerprint(cols)
    assert schema.schema_fingerprint(renamed) != base
    assert schema.schema_fingerprint(retyped) != base
    assert schema.schema_fingerprint(cols + [schema.Column("heat_rank", "double", "always", "")]) != base
    extra_key = list(schema.METADATA_KEYS) + [schema.MetadataKey("colour", "")]
    assert schema.schema_fingerprint(cols, extra_key) != base


def _probe(tmp_path: Path, name: str, optimizer, output: str, **config):
    torch.manual_seed(0)
    enc = normfast.ModuleEncoder([nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 5)], pooling=lambda x: x.mean(1))
    g = torch.Generator().manual_seed(1)
    items = torch.randn(5, 3, 6, generator=g)
    pairs = normfast.PairSource.from_tensors(torch.randn(12, 3, 6, generator=g), torch.randn(12, 3, 6, generator=g))
    cfg = normfast.ProbeConfig(
        optimizer=optimizer, output=output, batches=3, drift_batches=8, batch_size=4, chunk_size=2, **config
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return normfast.probe(enc, items, "infonce", pairs, cfg, out=tmp_path / f"{name}.parquet", progress=False)


@pytest.mark.parametrize(
    "name, optimizer, output",
    [
        ("sgd", "sgd", "pooled"),
        ("adamw", "adamw", "tokens"),
        ("mixed", {r"blocks\.0\.": "sgd", r"blocks\.2\.": "adamw"}, "pooled"),
    ],
)
def test_what_the_engine_writes_is_registered(tmp_path, name, optimizer, output):
    result = _probe(tmp_path, name, optimizer, output)
    file_schema = pq.read_schema(result.path)
    problems = schema.check_table(file_schema) + schema.check_metadata(result.metadata)
    assert not problems, "\n".join(problems) + f"\nregister new columns/keys: {HOW_TO}"
    assert result.metadata["schema_version"] == schema.SCHEMA_VERSION
    assert normfast.read_metadata(result.path)["schema_version"] == schema.SCHEMA_VERSION
    # every column that is "always" there is there
    always = {c.name for c in schema.COLUMNS if c.when == "always"}
    assert always <= set(file_schema.names)


def test_error_bar_columns_and_adaptive_metadata_are_registered(tmp_path):
    result = _probe(tmp_path, "adaptive", "sgd", "pooled", groups=2, target_rse=0.05, max_batches=6)
    problems = schema.check_table(pq.read_schema(result.path)) + schema.check_metadata(result.metadata)
    assert not problems, "\n".join(problems)
    assert {"se_V2", "se_Q", "r_eq_lo", "r_eq_hi", "r_eq_heat_lo", "r_eq_heat_hi"} <= set(result.table.column_names)
    assert result.metadata["adaptive"]["M"] == result.metadata["M"] >= 3


def test_check_table_names_an_unregistered_or_retyped_column():
    import pyarrow as pa

    bad = pa.schema([("item", pa.int64()), ("norm", pa.float32()), ("heat_rank", pa.float64())])
    problems = schema.check_table(bad)
    assert any("'norm' is float" in p for p in problems)
    assert any("'heat_rank'" in p and "not registered" in p for p in problems)
    assert schema.check_metadata({"model": "x", "colour": "A"}) == [
        "metadata key 'colour' is not registered in normfast/data/schema.py METADATA_KEYS"
    ]


def test_docs_output_format_is_rendered_from_the_registry():
    import importlib.util

    spec = importlib.util.spec_from_file_location("normfast_docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = (ROOT / "docs" / "output-format.md").read_text()
    assert "<!-- schema:output -->" in page, "the Output format page no longer asks for the registry's tables"
    rendered = hooks.expand(page, "output-format.md")
    assert schema.render_markdown() in rendered
    for c in schema.COLUMNS:
        assert f"`{c.name}`" in rendered
