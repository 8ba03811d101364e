"""One ranking of types (normfast.engine.report.ranking): by the mean relative heat, over the types
seen often enough, punctuation left out, and every type left out counted."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from normfast.engine.report.ranking import default_min_count, is_punctuation, rank_types


def _table() -> pa.Table:
    return pa.table(
        {
            "token": ["river", ",", "the", "##ing", "rye", "bank", "!?", "odd"],
            "count": [3, 40, 30, 2, 1, 2, 5, 4],
            "V2_mean": [9.0, 50.0, 1.0, 3.0, 99.0, 2.0, 7.0, np.nan],
            "heat_rel_mean": [0.5, 2.0, -1.0, 0.1, 3.0, -0.2, 0.4, np.nan],
        }
    )


def test_types_rank_by_relative_heat_over_the_types_seen_often_enough():
    r = rank_types(_table(), min_count=2)
    assert [r.labels[i] for i in r.order] == ["river", "##ing", "bank", "the"]  # by heat_rel, not V2
    assert [r.labels[i] for i in r.hottest(2)] == ["river", "##ing"]
    assert [r.labels[i] for i in r.coldest(1)] == ["the"]
    assert (r.below_min_count, r.punctuation, r.no_value, r.types) == (1, 2, 1, 8)
    assert r.note() == (
        "ranked by mean relative heat, seen at least 2 times: 4 of 8 types "
        "(1 seen fewer than 2 times; 2 punctuation types; 1 without a valid value left out)"
    )
    assert r.label(int(r.order[0])) == "river ×3"
    every = rank_types(_table(), min_count=1, punctuation=True)
    assert every.labels[every.order[0]] == "rye" and every.below_min_count == 0 and every.punctuation == 0
    old = rank_types(_table().drop_columns(["heat_rel_mean"]), min_count=2)  # runs before the relative heat
    assert old.key == "V2_mean" and old.labels[old.order[0]] == "river" and "mean V2" in old.note()


def test_punctuation_and_the_default_minimum_count():
    assert is_punctuation(",") and is_punctuation("##.") and is_punctuation("—")
    assert not is_punctuation("##ing") and not is_punctuation("3") and not is_punctuation("don't")
    assert default_min_count({"corpus": {"documents": 3}}) == 2
    assert default_min_count({}, ["item", "doc_id"]) == 2
    assert default_min_count({"output": "tokens"}, ["item", "token"]) == 1
