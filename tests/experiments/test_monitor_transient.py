"""The monitor transient study resumes: a model's finished result is kept until the whole run is
written, reused for the same config and recomputed for another."""

from __future__ import annotations

from bench.experiments.monitor_transient import Config, model_result
from bench.harness import Context


def test_an_interrupted_run_repeats_only_unfinished_models(tmp_path):
    ctx = Context(out=tmp_path)
    calls = []

    def compute(value):
        def go():
            calls.append(value)
            return {"model": "mlp", "value": value}

        return go

    config = Config(models="mlp", size="quick", steps=600)
    assert model_result("mlp", config, ctx, compute(1)) == {"model": "mlp", "value": 1}
    assert (tmp_path / "partial" / "mlp.json").is_file()
    assert model_result("mlp", config, ctx, compute(2)) == {"model": "mlp", "value": 1}  # kept
    other = Config(models="mlp", size="quick", steps=700)
    assert model_result("mlp", other, ctx, compute(3)) == {"model": "mlp", "value": 3}  # another config
    assert calls == [1, 3]
