"""The corpus recipe: what `normfast probe MODEL --corpus FILE` costs, and when its objective saturates.

    python -m bench run corpus_recipe --out bench/results/corpus_recipe   # the committed result
    python -m bench run corpus_recipe --quick                             # the cheap cases, M = 4

Protocol (all-MiniLM-L6-v2, the packaged copy; seed 0):

* **Cost** -- the product command exactly as Getting started ("Probe your own corpus") shows it,
  ``normfast probe all-MiniLM-L6-v2 --corpus docs/examples/mixed-topics.txt --out RUN``
  (30 sentences in 6 documents; ``--no-progress --overwrite`` added), and the same with
  ``--params all`` (every parameter instead of the last layer). Each command runs in a fresh
  process; its wall time, CPU time (user + system) and peak resident memory come from
  ``os.wait4``. From each run: the virtual objective's health (metadata ``objective_health``),
  the run's regime and the medians of V2, r_eq and the norm over its valid content rows. The
  timings are of whatever machine runs this (the JSON names its CPU count): the committed ones
  are of a 2-core CPU machine shared with other jobs, so read them as orders of magnitude.
* **Saturation** -- the virtual objective alone: a probe of one item whose virtual batches are
  those of each case below (the last transformer layer, M = 16 batches, per-batch drift), its
  mean virtual loss ± se, the loss against its chance level log(batch size), and the median
  gradient norm over the probed parameters:

  - ``mixed``: SimCSE on the 30 sentences of ``docs/examples/mixed-topics.txt``, batch size 15
    (the recipe's choice for 30 sentences), at temperature 0.05 (SimCSE's usual), 0.1 (the
    recipe's) and 0.2; and at 0.05 with batches of all 30 sentences;
  - ``mixed, next sentence``: InfoNCE at 0.05 with each sentence's next sentence of the same
    document as its positive (``docs/examples/mixed-topics-next-sentence.tsv``, 24 pairs),
    batch size 12;
  - ``Lee``: SimCSE on the sentences of the 300 Lee background articles (NLTK Punkt trained on
    them), batch size 32, at 0.05 and 0.1 (needs ``normfast[gensim]``; left out without it);
  - ``demo words``: SimCSE on the 2 000 most common English words, one per input, batch size 32,
    at 0.05 -- the demo's virtual batches.

``--quick``: the saturation cases of the mixed corpus only, M = 4, and no cost runs.

Writes ``corpus_recipe.json``; renders the blocks ``corpus-recipe-costs`` and
``corpus-recipe-saturation``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import Context

RESULTS = ("corpus_recipe.json",)
FIGURES = ()
TABLES = ("corpus-recipe-costs", "corpus-recipe-saturation")

REPO = Path(__file__).resolve().parents[2]
MODEL = "all-MiniLM-L6-v2"
#: the recipe's default for this model (normfast.probe_corpus: the last transformer layer)
LAST_LAYER = r"encoder\.layer\.5\."
CORPUS = "docs/examples/mixed-topics.txt"
NEXT_SENTENCE = "docs/examples/mixed-topics-next-sentence.tsv"
#: (name, options added to the docs' command)
COST_CASES = (("the recipe (docs' command)", []), ("--params all", ["--params", "all"]))


@dataclass
class Config:
    batches: int = 16
    costs: bool = True
    lee: bool = True
    words: int = 2000
    seed: int = 0

    @classmethod
    def quick(cls) -> "Config":
        return cls(batches=4, costs=False, lee=False, words=0)


def _cost(name: str, extra: list[str], out: Path) -> dict[str, Any]:
    """One product command in its own process: wall, CPU and peak memory (os.wait4), and what it found."""
    run = out / f"cost_{len(extra)}.parquet"
    argv = [sys.executable, "-m", "normfast", "probe", MODEL, "--corpus", CORPUS, *extra, "--out", str(run)]
    argv += ["--no-progress", "--overwrite"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"corpus_recipe: {' '.join(argv)} exited {code}:\n{output[-2000:]}")
    command = "normfast " + " ".join(argv[3:-2]).replace(str(run), "runs/mixed.parquet")
    return {
        "case": name,
        "command": command,
        "wall_seconds": wall,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        **_findings(run),
        "summary_head": output.splitlines()[:6],
    }


def _findings(path: Path) -> dict[str, Any]:
    import numpy as np

    from normfast import ProbeResult

    result = ProbeResult.load(path)
    keep = result.column("valid").astype(bool) & ~result.column("is_special").astype(bool)
    health = result.metadata.get("objective_health") or {}
    return {
        "rows": int(keep.sum()),
        "regime": (result.metadata.get("regime") or {}).get("regime"),
        "loss": health.get("loss_mean"),
        "loss_to_chance": health.get("loss_to_chance"),
        "saturated": health.get("saturated"),
        "median": {c: float(np.nanmedian(result.column(c)[keep])) for c in ("V2", "r_eq", "norm")},
    }


def _health(encoder, case: str, objective, pairs, batch_size: int, config: Config, layer: str) -> dict[str, Any]:
    import normfast

    settings = normfast.ProbeConfig(
        params=layer, batches=config.batches, drift_batches=None, batch_size=batch_size, seed=config.seed
    )
    result = normfast.probe(encoder, ["probe"], objective, pairs, settings, progress=False)
    health = dict(result.metadata["objective_health"])
    return {"case": case, "objective": result.metadata.get("objective_settings"), **health}


def _sentences_of(path: Path) -> list[str]:
    from normfast.data.corpus import read_documents, split_sentences

    return split_sentences([d.text for d in read_documents(path)])


def run(config: Config, ctx: Context) -> dict[str, Any]:
    import normfast
    from normfast.data.pairs import PairSource

    out = Path(ctx.out)
    out.mkdir(parents=True, exist_ok=True)
    costs = []
    if config.costs:
        with tempfile.TemporaryDirectory(prefix="corpus_recipe_") as runs:  # the runs themselves are not results
            costs = [_cost(name, extra, Path(runs)) for name, extra in COST_CASES]

    encoder = normfast.load_encoder(MODEL)
    layer = LAST_LAYER

    mixed = PairSource.from_iterable(_sentences_of(REPO / CORPUS), kind="items")
    next_pairs = [tuple(line.split("\t")) for line in (REPO / NEXT_SENTENCE).read_text().splitlines() if line]
    cases = [
        ("mixed", "SimCSE", 0.05, mixed, 15),
        ("mixed", "SimCSE", 0.1, mixed, 15),
        ("mixed", "SimCSE", 0.2, mixed, 15),
        ("mixed", "SimCSE", 0.05, mixed, 30),
        ("mixed, next sentence", "InfoNCE", 0.05, PairSource.from_iterable(next_pairs, kind="pairs"), 12),
    ]
    notes = []
    if config.lee:
        try:
            from normfast.data.corpus import split_sentences
            from normfast.data.gensim_data import lee_background

            lee = PairSource.from_iterable(split_sentences(lee_background()), kind="items")
            cases += [("Lee", "SimCSE", 0.05, lee, 32), ("Lee", "SimCSE", 0.1, lee, 32)]
        except (ImportError, FileNotFoundError) as exc:
            notes.append(f"Lee corpus left out: {exc}")
    if config.words:
        from normfast.data.word_frequencies import top_words

        words = PairSource.from_iterable(top_words(config.words), kind="items")
        cases.append((f"demo words ({config.words})", "SimCSE", 0.05, words, 32))
    saturation = []
    for name, objective, t, source, bs in cases:
        obj = normfast.SimCSE(temperature=t) if objective == "SimCSE" else normfast.InfoNCE(temperature=t)
        row = _health(encoder, name, obj, source, bs, config, layer)
        saturation.append({**row, "objective_name": objective, "temperature": t, "items": len(source)})
    return {
        "model": MODEL,
        "cpu_count": os.cpu_count(),
        "batches": config.batches,
        "layer": layer,
        "costs": costs,
        "saturation": saturation,
        "notes": notes,
    }


def _g(v: Any, fmt: str = ".2g") -> str:
    return "–" if v is None else format(v, fmt)


def tables(result: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    if result.get("costs"):
        lines = [
            "| command | wall | CPU | peak memory | virtual loss / chance | median V2 |",
            "|---|---|---|---|---|---|",
        ]
        for c in result["costs"]:
            lines.append(
                f"| `{c['command']}` | {c['wall_seconds']:.0f} s | {c['cpu_seconds']:.0f} s | "
                f"{c['peak_rss_bytes'] / 2**30:.1f} GiB | {_g(c['loss_to_chance'])} | {_g(c['median']['V2'])} |"
            )
        lines.append(
            f"\nMeasured on {result['cpu_count']} CPUs by `python -m bench run corpus_recipe` (each command in "
            "its own process: wall time, user + system CPU time and peak resident memory from `os.wait4`)."
        )
        out["corpus-recipe-costs"] = "\n".join(lines)
    rows = [
        "| virtual batches | objective | τ | batch size | loss ± se | loss / chance | saturated "
        "| median gradient norm |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in result["saturation"]:
        rows.append(
            f"| {s['case']}, {s['items']} items | {s['objective_name']} | {s['temperature']:g} | {s['batch_size']} | "
            f"{s['loss_mean']:.2g} ± {s['loss_se']:.1g} | {s['loss_to_chance']:.1e} | "
            f"{'yes' if s['saturated'] else 'no'} | {s['grad_norm']['median']:.2g} |"
        )
    rows.append(
        f"\nall-MiniLM-L6-v2, last layer, M = {result['batches']} batches, per-batch drift; "
        "`python -m bench run corpus_recipe`."
    )
    out["corpus-recipe-saturation"] = "\n".join(rows)
    return out
