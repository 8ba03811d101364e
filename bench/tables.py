"""Render the README's results tables from the JSON files in bench/results/.

    python bench/tables.py                 # print every table
    python bench/tables.py --write README.md   # refresh the tables in the README
    python bench/tables.py --check README.md   # fail if the README disagrees with the JSON

In the README each table sits between ``<!-- results:NAME -->`` and
``<!-- /results:NAME -->``; the text between the markers is exactly what
this script renders, so a number in the README is always the number in the
JSON that the named command wrote.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable

from tables_common import RESULTS, _load
from tables_e1 import table_e1, table_e1_drift, table_e1_ledger, table_e1_resists, table_e1_snapshot


def table_quartic() -> str | None:
    d = _load("quartic.json")
    if d is None:
        return None
    r = d["ratios_p50"]
    a = d["agreement"]
    env = d["environment"]
    gen, bi = r["general"], r["biquadratic"]
    rows = ["| workload (10^6 rows) | baseline | normfast speed-up, "
            f"{env['openmp_threads']} threads | 1 thread | max rel. difference |",
            "|---|---|---|---|---|",
            f"| general quartic (standard-normal coefficients) | numpy batched companion-matrix `eigvals` | "
            f"{gen['normfast_vs_numpy_eigvals']:.1f}x | {gen['normfast_1_thread_vs_numpy_eigvals']:.1f}x | "
            f"{a['general']['max_rel_diff']:.1e} |",
            f"| biquadratic (b = d = 0) | vectorized numpy closed form | "
            f"{bi['normfast_vs_numpy_closed_form']:.2f}x | {bi['normfast_1_thread_vs_numpy_closed_form']:.2f}x | "
            f"{a['biquadratic']['max_rel_diff']:.1e} |"]
    return "\n".join(rows)


def head_forms_table(d: dict) -> str:
    """Head mode's forms against the naive per-batch loop and their GEMM floors (bench/head_stats.py)."""
    cfg = d["config"]
    ms = cfg["M"]
    names = {"grouped": "grouped, with error bars (the default)", "S": "bare S form (`uncertainty=False`)",
             "per_batch": "per-batch form (`radial_spread=True`)"}
    head = "| form | " + " | ".join(f"M = {m}: vs naive loop | M = {m}: time / its GEMM floor" for m in ms) + " |"
    rows = [head, "|---|" + "---|---|" * len(ms)]
    for f in ("grouped", "S", "per_batch"):
        cells = []
        for m in ms:
            r = d["results"][str(m)]
            cells.append(f"{r['speedup_vs_naive'][f]:.1f}x | {r['vs_own_floor'][f]:.2f}")
        rows.append(f"| {names[f]} | " + " | ".join(cells) + " |")
    met = "; ".join(f"{k.replace('_', ' ')}: {t['value']:.2f} ({'met' if t['met'] else 'NOT met'}, target "
                    f"{'<=' if t.get('at_most') else '>='} {t['target']})" for k, t in d["targets"].items())
    rows.append("")
    rows.append(f"N = {cfg['n']:,}, d_in = d_out = {cfg['d_in']}, bias, fp32, {cfg['threads']} thread, K = "
                f"{cfg.get('groups', cfg['groups_default'])} groups, medians of {cfg['rounds']} interleaved rounds, timed from the "
                f"directions G_B; the floor is the same form's GEMMs alone (forming its matrices and the "
                f"per-probe products). Targets: {met}.")
    return "\n".join(rows)


CALIBRATION_QUANTITIES = ("D", "V2", "Q", "r_eq", "r_eq_heat")


def calibration_table(d: dict) -> str:
    """Coverage of the nominal 95% intervals per model, K and quantity (bench/calibration.py)."""
    Ks = d["protocol"]["Ks"]
    names = {"mlp": "MLP, no biases (jvp)", "mlp_bias": "MLP, biases (jvp)",
             "minilm_head": "linear head on MiniLM features (head mode)"}
    rows = ["| model | K | " + " | ".join(f"{q} coverage [95% CI]" for q in CALIBRATION_QUANTITIES)
            + " | V2 half-width / V2 (median) |", "|---|---|" + "---|" * len(CALIBRATION_QUANTITIES) + "---|"]
    for m, per_k in d["results"].items():
        for k in Ks:
            c = per_k[str(k)]
            cells = " | ".join(f"{c[q]['coverage']:.3f} [{c[q]['ci95'][0]:.2f}, {c[q]['ci95'][1]:.2f}]"
                               for q in CALIBRATION_QUANTITIES)
            rows.append(f"| {names.get(m, m)} | {k} | {cells} | {c['V2']['median_relative_half_width']:.2f} |")
    dec, p = d["decision"], d["protocol"]
    rows.append("")
    rows.append(f"{p['replicates']} replicates per K of the defaults (M = {p['M']}, M_D = {p['M_D']}, batch size "
                f"{p['batch_size']}); truth from M = M_D = {p['M_true']:,}; coverage over rows x replicates, 95% "
                f"interval by a bootstrap over replicates. Target: D and V2 in [{d['band'][0]:.2f}, "
                f"{d['band'][1]:.2f}] on every model. Chosen K = {dec['default_K']} ({dec['rule']}"
                f"{'' if dec['met'] else '; the target is not met'}).")
    return "\n".join(rows)


def table_calibration() -> str | None:
    d = _load("calibration.json")
    return None if d is None else calibration_table(d)


def table_adaptive_m() -> str | None:
    d = _load("adaptive_m.json")
    if d is None:
        return None
    f, a = d["runs"]["fixed_M16"], d["runs"]["adaptive"]
    q = f"{d['quantile']:.0%}"
    rows = [f"| run ({d['words']:,} demo words, {f['rows']:,} token rows) | M | {q} quantile of se(V2)/V2, "
            f"first chunk | same, all rows | V2 resolved to ±20% | wall time |", "|---|---|---|---|---|---|"]
    for name, r in (("fixed M = 16 (default)", f), (f"adaptive, target {d['target_rse']}", a)):
        rows.append(f"| {name} | {r['M']} | {r['quantile_rse_pilot_rows']:.3f} | {r['quantile_rse_all_rows']:.3f} | "
                    f"{r['V2_resolved_to_20pct']:.0%} | {r['wall_seconds'] / f['wall_seconds']:.2f}x |")
    rounds = ", ".join(f"M = {x['M']}: {x['quantile_rse']:.3f}" for x in a["adaptive"]["rounds"])
    rows += ["", f"Rounds of the adaptive run (quantile on the first chunk): {rounds}; "
                 f"{'target reached' if a['adaptive']['reached'] else 'target not reached (max_batches)'}. "
                 f"Wall time relative to the fixed run, same process; the drift's {d['config']['drift_batches']:,} "
                 f"gradients are part of both; {d['threads']} torch thread."]
    pb = d["runs"].get("fixed_M16_per_batch_drift")
    if pb:
        rows += ["", f"The drift from M_D = {d['config']['drift_batches']:,} batches against the per-batch drift of "
                     f"the 16 heat batches (same words, same M = 16): median se_D/|D| {f['median_se_D_over_abs_D']:.2f} "
                     f"against {pb['median_se_D_over_abs_D']:.2f}, |D| > 2 se_D on {f['drift_significant_share']:.0%} "
                     f"of rows against {pb['drift_significant_share']:.0%}, at {d['time_ratio_drift_MD_vs_per_batch']:.2f}x "
                     f"the wall time."]
    return "\n".join(rows)


def table_head_stats() -> str | None:
    d = _load("head_stats.json")
    if d is None or "results" not in d:
        return None
    return head_forms_table(d)


def _rci(block: dict) -> str:
    lo, hi = block["ci95"]
    return f"{block['r']:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def table_e5() -> str | None:
    d = _load("e5_uncertainty.json")
    if d is None:
        return None
    h = d["heat_vs_entropy"]
    c = h["correlations_with_entropy"]
    label = {"V2": "heat V²", "norm": "norm", "r_eq": "R_eq (full law)", "r_eq_heat": "R_eq (heat-only law)"}
    rows = [f"| vs zero-shot entropy ({h['n_probe']} test images) | Pearson r [95% CI] | Spearman ρ [95% CI] |",
            "|---|---|---|"]
    for k in ("V2", "norm", "r_eq", "r_eq_heat"):
        if k in c:
            rows.append(f"| {label[k]} | {_rci(c[k]['pearson'])} | {_rci(c[k]['spearman'])} |")
    rows += ["", "| documents (image→image, same class relevant) | best α | NDCG@10 at best α | cosine (α = 0) "
             "| gain | length control (ink count): gain |", "|---|---|---|---|---|---|"]
    for key, name in (("with_head", "with projection head"), ("without_head", "without head (trunk features)")):
        r = d["retrieval"][key]
        rows.append(f"| {name} | {r['best_alpha']:+.2f} | {r['ndcg@10']:.4f} | {r['cosine_ndcg@10']:.4f} | "
                    f"{r['gain_pct']:+.2f}% | {r['length_control']['gain_pct']:+.2f}% |")
    v = d["verdicts"]
    rows += ["", f"Paper: V² correlates positively with entropy (CLIP ViT-B/32 on CIFAR-10H: r = "
                 f"+{v['paper_V2_entropy_pearson_r_clip_vit_b32_cifar10h']}); removing the head flips the best α "
                 f"from negative to positive. Here: positive correlation "
                 f"{'reproduced' if v['V2_entropy_pearson_positive_ci_excludes_0'] else 'not reproduced'}; sign flip "
                 f"{'reproduced' if v['paper_sign_flip_reproduced'] else 'not reproduced'}."]
    return "\n".join(rows)


def _rho(block: dict) -> str:
    return f"{block['rho']:+.3f} [{block['ci_low']:+.3f}, {block['ci_high']:+.3f}]"


def table_e3() -> str | None:
    d = _load("e3_token_norms.json")
    if d is None:
        return None
    c = d["correlations"]["first_piece"]
    partial = c.get("depth|zipf") or c.get("depth_given_zipf")
    label = {"norm": "token norm", "V2": "heat V²", "D": "drift D", "r_eq": "R_eq (full law)",
             "r_eq_heat": "R_eq (heat-only law)", "pooled_norm": "pooled (sentence) norm of the word"}
    head = (f"| Spearman ρ [95% CI] with | Zipf frequency (n = {c['zipf']['norm']['n']:,}) "
            f"| WordNet depth (n = {c['depth']['norm']['n']:,}) |")
    rows = [head + (" depth, Zipf held fixed |" if partial else ""), "|---|---|---|" + ("---|" if partial else "")]
    for k in ("norm", "V2", "D", "r_eq", "r_eq_heat", "pooled_norm"):
        line = f"| {label[k]} | {_rho(c['zipf'][k])} | {_rho(c['depth'][k])} |"
        if partial:
            line += f" {_rho(partial[k])} |"
        rows.append(line)
    p = d["protocol"]["probe"]
    rows += ["", f"{d['counts']['words']:,} words ({d['counts']['token_rows']:,} token rows), value = the first "
                 f"word-piece; jvp mode on `{p['params']}`, SimCSE, M = {p['M']}, batch {p['batch_size']}, "
                 f"{p['optimizer']} lr {p['lr']} / wd {p['weight_decay']}."]
    return "\n".join(rows)


def table_e4() -> str | None:
    d = _load("e4_retrieval.json")
    if d is None:
        return None
    r = d["results"]
    h = d["headline"]

    def cell(b: dict) -> str:
        g = b.get("gain_pct_vs_cosine")
        base = f"{b['mean']:.4f}"
        return base if g is None else f"{base} ({g:+.2f}% [{b['gain_ci_low']:+.2f}, {b['gain_ci_high']:+.2f}])"

    rows = [f"| NDCG@10 (gain over cosine, 95% CI) | all ({r['overall']['ndcg@10']['cosine']['n']} test queries) |"
            + "".join(f" {s} ({r['per_stratum'][s]['cosine']['n']}) |" for s in ("shallow", "mid", "deep")),
            "|---|---|---|---|---|"]
    label = {"cosine": "cosine (α = 0)", "dot": "dot product (α = 1)",
             "best_alpha": f"best α = {h['best_alpha']:+.1f} (chosen on the dev half)",
             "length_control": f"length-only control, best β = {h['length_beta']:+.1f}"}
    for k in ("cosine", "dot", "best_alpha", "length_control"):
        rows.append(f"| {label[k]} | {cell(r['overall']['ndcg@10'][k])} |"
                    + "".join(f" {cell(r['per_stratum'][s][k])} |" for s in ("shallow", "mid", "deep")))
    c = d["collection"]
    rows += ["", f"{c['n_queries']:,} WordNet gloss queries, {c['n_docs']:,} lemma-name documents, strata by "
                 f"hypernym depth; the paper's claim for text-only encoders: gain ≤ ~"
                 f"{h['paper_text_only_max_gain_pct']}% — {'holds' if h['within_paper_claim'] else 'does not hold'} "
                 f"here."]
    return "\n".join(rows)


def table_streaming() -> str | None:
    d = _load("streaming.json")
    if d is None:
        return None
    rows = ["| token probes | chunks | peak RSS | rows/s (relative to the 1M run) |", "|---|---|---|---|"]
    base = d["runs"][0]["rows_per_s"]
    for r in d["runs"]:
        rows.append(f"| {r['rows']:,} | {r['chunks']} | {r['peak_rss_bytes'] / 2**20:,.0f} MiB | "
                    f"{r['rows_per_s'] / base:.2f}x |")
    s_ = d["settings"]
    rc = d["resume_check"]
    rows += ["", f"Peak RSS ratio 10M / 1M: {d['peak_rss_ratio']:.3f} (target: within 20%, and < 4 GB). "
                 f"{s_['mode']} mode, {s_['output']}, M = {s_['batches']}, {s_['threads']} thread, on a "
                 f"{s_['layers']}-layer, {s_['hidden']}-wide BERT with a linear head. Resume check: a run killed "
                 f"after {rc['killed_after_chunks_on_disk']} of {rc['chunks']} chunks recomputed "
                 f"{rc['chunks_computed_on_resume']} chunks and gave "
                 f"{'the same table' if rc['same_table_as_uninterrupted'] else 'a DIFFERENT table'}."]
    return "\n".join(rows)


def _check(d: dict, name: str) -> str:
    for c in d.get("accuracy_checks", []):
        if c["check"] == name:
            return f"{c['max_rel_diff']:.1e} ({'ok' if c['passed'] else 'FAILED'})"
    return "n/a"


def table_bench() -> str | None:
    d = _load("bench.json")
    if d is None:
        return None
    env = d["environment"]
    rows = [f"Machine: {env['device']}, torch {env['versions'].get('torch', '?')}, "
            f"{env['threads']} torch thread(s) (the jacrev section: 1). Ratios are medians of methods "
            f"timed in the same run, interleaved round by round, after each method's output passed its "
            f"accuracy check.", "",
            "| comparison | baseline | normfast speed-up | FLOP ratio | baseline max rel. diff |",
            "|---|---|---|---|---|"]
    form_rows: list[str] = []  # the head-mode forms: a second table after the comparisons
    if "head" in d:
        h, c = d["head"], d["head"]["config"]
        size = f"N = {c['n']:,}, d = {c['d_in']}, M = {c['m']}"
        label = {"torch.func": "`torch.func` `vmap(grad)`", "backpack": "BackPACK `BatchGrad`",
                 "opacus": "Opacus `GradSampleModule`"}
        for k, text in label.items():
            key = f"normfast_vs_{k}"
            if key in h["ratios"]:
                rows.append(f"| head mode ({size}) | {text} per-sample gradients, summed per batch, "
                            f"applied to every probe | {h['ratios'][key]:.1f}x | "
                            f"{h['flop_ratios'][key]:.1f}x | {_check(d, 'head/' + k)} |")
            else:
                rows.append(f"| head mode ({size}) | {text} | not run: {h['skipped'].get(k, '?')} | | |")
        floors = h.get("statistics_vs_gemm_floor")
        if floors:
            forms = {"normfast": "grouped, with error bars (the default)",
                     "normfast S": "bare S form (`uncertainty=False`)",
                     "normfast per-batch": "per-batch form (`radial_spread=True`)"}
            base = h["seconds"]["normfast"]["p50"]
            form_rows = ["", f"| head-mode form ({size}) | whole run, speed relative to the default | "
                             f"statistics time / its GEMM floor |", "|---|---|---|"]
            for k, text in forms.items():
                if k in floors:
                    form_rows.append(f"| {text} | {base / h['seconds'][k]['p50']:.2f}x | {floors[k]:.2f} |")
            form_rows += ["", "normfast's head rows above run the default (the grouped form, with error bars); "
                              "a form's floor is its GEMMs alone (forming its matrices from the directions and "
                              "the per-probe products), timed in the same rounds."]
    if "jacrev" in d:
        j, c = d["jacrev"], d["jacrev"]["config"]
        rows.append(f"| jvp mode, MLP {'-'.join(map(str, c['widths']))} ({c['parameters']:,} parameters, "
                    f"N = {c['n']:,}, M = {c['m']}) | per-probe Jacobians (`vmap(jacrev)`) applied to "
                    f"each direction | {j['ratios']['normfast_vs_jacrev']:.1f}x | "
                    f"{j['flop_ratios']['normfast_vs_jacrev']:.1f}x | {_check(d, 'jacrev/jacrev')} |")
    if "minilm" in d:
        m, c = d["minilm"], d["minilm"]["config"]
        size = f"{c['comparison_tokens']:,} tokens, M = {c['m']}"
        text = {"sequential_cached": "one direction per pass, same cached front",
                "sequential_full": "one `torch.func.jvp` per direction through the whole model"}
        for k, t in text.items():
            key = f"batched_vs_{k}"
            if key in m["ratios"]:
                rows.append(f"| MiniLM token jvp, last layer, {c['k']} directions per pass ({size}) | {t} | "
                            f"{m['ratios'][key]:.1f}x | {m['flop_ratios'][key]:.1f}x | "
                            f"{_check(d, 'minilm/' + k)} |")
    rows += form_rows
    if "minilm" in d:
        m, c = d["minilm"], d["minilm"]["config"]
        t = m["throughput"]
        rows += ["", f"MiniLM token-level jvp probing (last layer, {t['M']} directions, SimCSE, "
                     f"{t['words']:,} words = {t['token_rows']:,} token rows): the whole engine "
                     f"{t['engine_tokens_per_s']['p50']:,.0f} tokens/s (directions, fronts, κ, "
                     f"accumulators, solve and table included); the forward-mode passes alone "
                     f"{t['transmission_tokens_per_s']['p50']:,.0f} tokens/s."]
    if "scaling" in d:
        sc = d["scaling"]
        c = sc["config"]
        rows += ["", f"| token rows N (head mode, d = {c['dim']}, M = {c['m']}) | s | tokens/s | "
                     "peak RSS | peak RSS while streaming |", "|---|---|---|---|---|"]
        for r in sc["runs"]:
            rows.append(f"| {r['tokens']:,} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} | "
                        f"{r['peak_rss_mb']:,.0f} MB | {r['streaming_peak_rss_mb']:,.0f} MB |")
        fit = sc["linear_fit"]
        rows += ["", f"Linear fit: {fit['fixed_seconds']:.2f} s fixed + N / "
                     f"{fit['tokens_per_s_marginal']:,.0f} tokens/s (largest relative residual "
                     f"{fit['max_rel_residual']:.1e}); each N ran in a fresh process. The 10⁷-token "
                     f"run is the streaming benchmark below."]
    return "\n".join(rows)


def table_demo() -> str | None:
    path = RESULTS / "demo_output.txt"
    if not path.exists():
        return None
    return "```\n" + path.read_text().rstrip("\n") + "\n```"


E2_PREDICTORS = {"full_law": "full law, trajectory average",
                 "heat_only_law": "heat-only law, trajectory average",
                 "last_checkpoint_full_law": "full law, last checkpoint",
                 "last_checkpoint_heat_only_law": "heat-only law, last checkpoint"}
E2_RUNS = (("e2_real_encoder_A.json", "A: everything decayed"),
           ("e2_real_encoder_B.json", "B: projection head"),
           ("e2_real_encoder.json", "v3 (negative control): LayerNorm exempt"))
E2_PROBES = {"jvp": "jvp over the trained layer", "head": "head mode (head only)"}


def _e2_probes(d: dict) -> list[tuple[str, str]]:
    """``(fit-key prefix, label)`` for each probe of a run (v3 has one, unprefixed)."""
    probes = (d.get("protocol") or {}).get("probes")
    if not probes or len(probes) == 1:
        return [("", "")]
    labels = {"jvp": "jvp over head + last layer", "head": "head mode, head only"}
    return [(f"{name}_", labels.get(name, name)) for name in probes]


def e2_regime(d: dict, probe: str = "jvp") -> dict | None:
    """The regime check of a run: stored by the run, else recomputed from its averaged items
    (runs made before the check: κ only, the exempt-parameter test not available)."""
    stored = (d.get("regime") or {}).get(probe)
    if stored:
        return stored
    import numpy as np

    from normfast.engine.regime import classify_rows, run_regime

    it, c = d["items"], d["config"]
    n = len(it["D"])
    cols = {"D": it["D"], "Q": it["Q"], "kappa": it["kappa"], "kappa_exempt": np.zeros(n),
            "se_D": np.full(n, np.nan), "valid": np.isfinite(it["kappa"])}
    out = run_regime([{**cols, **classify_rows(cols, lr=c["lr"], weight_decay=c["weight_decay"])}])
    out["exempt_check"] = "not available (run made before the regime check)"
    return out


def _regime_cell(rg: dict | None) -> str:
    if rg is None:
        return "n/a"
    fr = rg["fractions"]
    return f"{rg['regime']} ({fr[rg['regime']]:.0%}; {rg['reason'].replace('_', ' ')})"


def e2_fits_table(d: dict, predictor: str = "predictor") -> str:
    """One run's slope / r table (with the paper's figures), as the E2 script prints it."""
    rows = [f"| {predictor} | slope [95% CI] | Pearson r [95% CI] |", "|---|---|---|"]
    for prefix, label in _e2_probes(d):
        for key, name in E2_PREDICTORS.items():
            f = d["fits"][prefix + key]
            (slo, shi), (rlo, rhi) = f["slope_ci95"], f["pearson_r_ci95"]
            rows.append(f"| {label + ': ' if label else ''}{name} | {f['slope']:.3f} [{slo:.3f}, {shi:.3f}] | "
                        f"{f['pearson_r']:.3f} [{rlo:.3f}, {rhi:.3f}] |")
    p = d["paper"]
    rows.append(f"| paper ({p['model']}) | {p['slope']:.2f} | {p['pearson_r']:.2f} |")
    return "\n".join(rows)


def _e2_note(d: dict, run: str) -> str:
    c, h, pr = d["config"], d["health"], d["protocol"]
    chosen = (d.get("pilot") or {}).get("chosen")
    choice = (f"η = {chosen['lr']}, λ = {chosen['weight_decay']}" + (f", {chosen['steps']} steps"
              if "steps" in chosen else "")) if chosen else "none passed"
    k = d["kappa"]
    cpu = d.get("cpu_seconds")
    sec = d["seconds"]
    times = f"run time {sec['total'] / 60:.1f} min wall" + (
        f", {cpu['total'] / 60:.0f} min process CPU" + _threads(d) if cpu else "")
    if "train" in sec and "probe" in sec:
        workers = d.get("probe_workers")
        after = f" after training, in {workers} worker processes" if workers and workers > 1 else ""
        times += (f" (caching the frozen front {sec.get('cache_front', 0) / 60:.1f} min, training "
                  f"{sec['train'] / 60:.1f}, the checkpoint probes {sec['probe'] / 60:.1f}{after})")
    pilot = d.get("pilot") or {}
    if pilot.get("seconds"):
        times += f"; the pilot: {pilot['seconds']['total'] / 60:.1f} min wall" + (
            f", {pilot['cpu_seconds']['total'] / 60:.0f} min CPU" + _threads(pilot) if pilot.get("cpu_seconds") else "")
    drift = "" if not c.get("drift_batches") else f", drift from the mean direction over {c['drift_batches']} batches"
    return (f"**{run}.** SGD η = {c['lr']}, λ = {c['weight_decay']} (decay exempt: `{c['no_decay']}`), "
            f"{c['steps']} steps of {c['batch_size']} pairs, window = last {c['window']:.0%} "
            f"({pr['equilibration_times_before_window']:.1f} equilibration times in), {pr['checkpoints']} "
            f"checkpoints × M = {c['M']}{drift}. Pilot's choice: {choice}. Training health in the window: "
            f"loss {h.get('loss_window_mean', float('nan')):.2f} (chance {h['loss_chance']:.2f}), max mean "
            f"pairwise cosine {h['max_mean_cosine']:.3f}, median norm change between the window halves "
            f"{h.get('norm_change_between_window_halves_median', float('nan')):.1%}, decayed-weight norm "
            f"change {h.get('decayed_weight_norm_change_between_window_halves', float('nan')):.1%} — "
            f"criteria {'met' if h['passed'] else 'NOT met'}. κ (window average) median {k['median']:.2f}, "
            f"range {k['min']:.2f} … {k['max']:.2f}, ≤ 0 for {k['negative_fraction']:.0%} of the items; "
            f"median |D| / heat scale {d['drift_over_heat_median']:.2f}; {times}.")


def _threads(d: dict) -> str:
    """`` on N torch threads`` when the run recorded its thread count."""
    n = d.get("torch_threads")
    return "" if n is None else f" on {n} torch thread{'s' if n != 1 else ''}"


def _e2_pilot_note(pilot: dict) -> str:
    """Every candidate of a pilot with its health outcome, and the choice."""
    parts = []
    for r in pilot["results"]:
        h = r["health"]
        if h.get("passed"):
            outcome = "passed"
        elif not h.get("no_collapse", True):
            outcome = f"collapsed (stopped at step {h.get('stopped_at_step', '?')})"
        else:
            failed = [name for key, name in (("loss_below_chance", "loss"), ("stationary", "stationarity"))
                      if not h.get(key, True)]
            outcome = "failed " + " and ".join(failed)
            if "norm_change_between_window_halves_median" in h:
                outcome += (f" (norm change {h['norm_change_between_window_halves_median']:.1%}, weight change "
                            f"{h.get('decayed_weight_norm_change_between_window_halves', float('nan')):.1%})")
        if r.get("train_cpu_seconds") is not None:
            outcome += f" [{r['train_seconds'] / 60:.0f} min wall, {r['train_cpu_seconds'] / 60:.0f} min CPU]"
        parts.append(f"η = {r['lr']}, λ = {r['weight_decay']}, {r['steps']} steps: {outcome}")
    chosen = pilot.get("chosen")
    choice = (f"η = {chosen['lr']}, λ = {chosen['weight_decay']}, {chosen['steps']} steps" if chosen
              else "none passed")
    times = ""
    if pilot.get("seconds"):
        times = f"; {pilot['seconds']['total'] / 60:.0f} min wall" + (
            f", {pilot['cpu_seconds']['total'] / 60:.0f} min process CPU" if pilot.get("cpu_seconds") else "")
    return "; ".join(parts) + f" → chosen: {choice}{times}"


def table_e2() -> str | None:
    loaded = [(name, label, _load(name)) for name, label in E2_RUNS]
    runs = [(d, label) for _, label, d in loaded if d is not None and "fits" in d]
    if not runs:
        return None
    rows = ["| run | predictor | slope [95% CI] | Pearson r [95% CI] | regime check (share of items) |",
            "|---|---|---|---|---|"]
    for d, label in runs:
        for prefix, probe_label in _e2_probes(d):
            rg = _regime_cell(e2_regime(d, prefix.rstrip("_") or "jvp"))
            for key, name in E2_PREDICTORS.items():
                f = d["fits"][prefix + key]
                (slo, shi), (rlo, rhi) = f["slope_ci95"], f["pearson_r_ci95"]
                run = label + (f", {probe_label}" if probe_label else "")
                rows.append(f"| {run} | {name} | {f['slope']:.3f} [{slo:.3f}, {shi:.3f}] | "
                            f"{f['pearson_r']:.3f} [{rlo:.3f}, {rhi:.3f}] | {rg} |")
    p = runs[0][0]["paper"]
    rows.append(f"| paper ({p['model']}) | full law | {p['slope']:.2f} | {p['pearson_r']:.2f} | |")
    rows.append("")
    rows.append(f"{runs[0][0]['n_probe_items']} WordNet lemmas per run; target (trajectory-averaged full "
                f"law): slope in [0.85, 1.15], r ≥ 0.90.")
    for d, label in runs:
        rows += ["", _e2_note(d, label.split(":")[0])]
    for name, label, d in loaded:  # the settings whose full run is not (yet) in the table
        if d is not None and "fits" in d:
            continue
        pilot = (d or {}).get("pilot")
        if pilot:
            rows += ["", f"**{label.split(':')[0]} (pilot only, no full run recorded).** Pilot: "
                         f"{_e2_pilot_note(pilot)}."]
        else:
            rows += ["", f"**{label.split(':')[0]}: not run** (no `bench/results/{name}`)."]
    return "\n".join(rows)


def resources_table(d: dict) -> str:
    """Worst case per kernel and operand class over every compiled variant, sm_90 | sm_80."""
    by = {}
    for s in d["summary"]:
        by.setdefault((s["kernel"], s["class"]), {})[s["arch"]] = s
    rows = ["| kernel | operand class | tile configs | variants | registers (max) | stack bytes (max) "
            "| shared KB (max) | programs per SM (min) | products on |",
            "|---|---|---|---|---|---|---|---|---|"]
    for (kernel, cls), arches in by.items():
        a, b = arches.get("sm_90"), arches.get("sm_80")

        def pair(key: str, fmt=str) -> str:
            return " / ".join(fmt(x[key]) if x else "-" for x in (a, b))

        scalar = "FMA" if kernel == "_head_stack_kernel" else "-"  # accumulate has no products
        tc = {x["arch"]: ",".join(t for t in x["tensor_cores"] if t != "None") or scalar
              for x in (a, b) if x}
        rows.append(f"| `{kernel}` | {cls} | {max(x['configs'] for x in arches.values())} | "
                    f"{sum(x['variants'] for x in arches.values())} | {pair('registers_max')} | "
                    f"{pair('stack_max')} | {pair('shared_max', lambda v: f'{v / 1024:.0f}')} | "
                    f"{pair('programs_per_sm_min')} | "
                    f"{' / '.join(tc.get(k, '-') for k in ('sm_90', 'sm_80'))} |")
    rows.append("")
    n = len(d["variants"])
    rows.append(f"Each cell: sm_90 / sm_80. {n} distinct compiled variants (every tile "
                f"configuration the launchers may choose on a GPU, over fp32/bf16/fp16 inputs, "
                f"branches, bias, IEEE/TF32 and d from 1 to 2048), {d['failing']} of them spilling, "
                f"at the register cap ({d['register_cap']}) or below two programs per SM. "
                f"Triton {d['toolchain']['triton']}, {d['toolchain']['ptxas']}; "
                f"`python bench/kernel_resources.py --out bench/results`, no GPU needed.")
    return "\n".join(rows)


def roofline_table(d: dict, dim: int = 384) -> str:
    """Predicted H200 time per form and path at d_in = d_out = ``dim`` (default tile configs)."""
    pk = d["peaks"]
    proto = d["protocol"]
    rows = [f"| form (d = {dim}) | path: products | inputs | FLOP / row | HBM bytes / row | FLOP/B "
            f"| bound by | predicted ms, 2^20 rows | vs torch path | L2 TB/s needed |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    names = {"S": "S form", "grouped": f"grouped, K = {proto['groups']}",
             "per_batch": f"per-batch, M = {proto['m']}"}
    for c in d["cases"]:
        if c["d_in"] != dim or (c["path"] == "kernel" and not c.get("default_config")):
            continue
        form = names.get(c["form"], c["form"])
        if c["op"] == "accumulate":
            form += f", K = {c['k']}"
        path = "normfast kernel" if c["path"] == "kernel" else "torch path"
        speed = c.get("predicted_speedup_vs_torch")
        l2 = c.get("l2_TBps_needed")
        rows.append(f"| {form} | {path}: {c['products']} | {c['dtype']} | "
                    f"{c['useful_flops'] / 1e6:.2f} M | {c['hbm_bytes']:,.0f} | {c['intensity']:.0f} "
                    f"| {c['bound_by']} | {c['predicted_ms']:.2f} | "
                    f"{'-' if speed is None else f'{speed:.1f}x'} | "
                    f"{'-' if l2 is None else f'{l2:.1f}'} |")
    rows.append("")
    rows.append(f"Peaks: FP32 {pk['fp32_fma'] / 1e12:.0f}, TF32 {pk['tf32_dense'] / 1e12:.1f} and "
                f"BF16 {pk['bf16_dense'] / 1e12:.1f} TFLOP/s dense, HBM "
                f"{pk['hbm_bytes_per_s'] / 1e12:.1f} TB/s ({pk['source']}). Bias on; "
                f"{proto['groups_note']}. Prediction = max(compute floor on the padded tiles, "
                f"HBM floor); L2 is not a ceiling here (no published figure): the last column is "
                f"the L2 bandwidth the tiled kernel would need to hold its prediction. "
                f"`python bench/roofline.py --out bench/results`.")
    return "\n".join(rows)


def roofline_check_table(d: dict) -> str:
    """The prediction for each timed case of bench/gpu_check.py (default tile configurations)."""
    rows = ["| gpu_check case | bound by | compute floor ms | HBM floor ms | predicted ms "
            "| L2 TB/s needed |", "|---|---|---|---|---|---|"]
    for c in d["gpu_check_cases"]:
        l2 = c.get("l2_TBps_needed")
        rows.append(f"| {c['label']} | {c['bound_by']} | {c['compute_floor_ms']:.2f} | "
                    f"{c['hbm_floor_ms']:.2f} | {c['predicted_ms']:.2f} | "
                    f"{'-' if l2 is None else f'{l2:.1f}'} |")
    return "\n".join(rows)


def table_roofline() -> str | None:
    d = _load("roofline.json")
    return None if d is None else roofline_table(d)


def table_kernel_resources() -> str | None:
    d = _load("kernel_resources.json")
    return None if d is None else resources_table(d)


def _vci(block: dict, digits: int = 3) -> str:
    return f"{block['value']:+.{digits}f} [{block['ci_low']:+.{digits}f}, {block['ci_high']:+.{digits}f}]"


def table_corpus() -> str | None:
    d = _load("corpus_job.json")
    if d is None:
        return None
    models = list(d["models"])
    rs = [d["models"][m] for m in models]
    rows = ["| Lee background corpus | " + " | ".join(models) + " |", "|---|" + "---|" * len(models),
            "| documents (of 300) / windows / token rows probed | " + " | ".join(
                f"{r['documents']} / {r['windows']['windows']} / {r['token_rows']:,}" for r in rs) + " |",
            "| probe throughput, token rows/s (wall) | " + " | ".join(
                "n/a (resumed run)" if r["speed"]["resumed"] else f"{r['speed']['tokens_per_s']:.1f}"
                for r in rs) + " |",
            "| probe time / plain forward over the same windows (wall; CPU) | " + " | ".join(
                "n/a (resumed run)" if r["speed"]["resumed"] else
                f"{r['speed']['ratio_wall']:.1f}x; {r['speed']['ratio_cpu']:.1f}x" for r in rs) + " |"]
    labels = {"corpus_frequency": "log corpus frequency", "zipf": "wordfreq Zipf"}
    for level in ("token", "word"):
        for target in ("corpus_frequency", "zipf"):
            for q, name in (("heat", "type heat (mean V²)"), ("norm", "type norm (mean norm)")):
                cells = []
                for r in rs:
                    c = r["by"][level]["correlations"]["min_count_5"][target][q]
                    cells.append(f"{_vci(c)} (n = {c['n']:,})")
                rows.append(f"| Spearman: {name} vs {labels[target]}, by {level} | " + " | ".join(cells) + " |")
    rows.append("")
    for m, r in zip(models, rs):
        for level in ("token", "word"):
            e = r["by"][level]["extremes"]
            for k in ("hottest", "coldest"):
                rows.append(f"{m}, {k} {level}s (mean V², occurrences): " + ", ".join(
                    f"{x['type']} ({x['count']})" for x in e[k]) + "  ")
    rows += ["", f"jvp over the last transformer layer, SimCSE on the documents' own sentences, "
                 f"M = {rs[0]['M']} x 32, sgd lr 1e-3 / wd 1e-2; windows at the model's maximum length, no overlap. "
                 f"Types with >= 5 valid occurrences: "
                 f"{' / '.join(str(r['by']['token']['types_min_count']) for r in rs)} token types, "
                 f"{' / '.join(str(r['by']['word']['types_min_count']) for r in rs)} word types. "
                 f"Speed: {d['protocol']['speed']}."]
    return "\n".join(rows)


def table_judgments() -> str | None:
    d = _load("human_judgments.json")
    if d is None:
        return None
    names = {"wordsim353": "WordSim353 (ρ)", "simlex999": "SimLex999 (ρ)", "lee": "Lee 50 docs (r)"}
    rows = ["| model | data | held-out half | α chosen on the other half | cosine [95% CI] | "
            "cos·(‖a‖‖b‖)^α [95% CI] | gain [95% CI] |", "|---|---|---|---|---|---|---|"]
    for m, r in d["models"].items():
        for s in ("wordsim353", "simlex999", "lee"):
            for k, f in enumerate(r[s]["folds"]):
                t = f["test"]
                rows.append(f"| {m} | {names[s]} | {'BA'[k]} ({f['test_pairs']} pairs) | {f['best_alpha']:+.2f} | "
                            f"{_vci(t['cosine'])} | {_vci(t['best_alpha'])} | {_vci(t['gain'])} |")
    rows.append("")
    verdicts = []
    for m, r in d["models"].items():
        verdicts.append(f"{m}: " + "; ".join(f"{names[s].split(' (')[0]} {r[s]['verdict']} (norm product alone "
                                             f"{r[s]['all_pairs']['norm_product_only']['value']:+.3f})"
                                             for s in ("wordsim353", "simlex999", "lee")))
    rows.append(". ".join(verdicts) + ".")
    return "\n".join(rows)


def table_demo_excerpt() -> str | None:
    """The README's excerpt of the demo's output: its head, up to the error-bar lines."""
    path = RESULTS / "demo_output.txt"
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    end = next((i for i, ln in enumerate(lines) if ln.startswith("drift |D|")), len(lines) - 1)
    return "```\n" + "\n".join(lines[:end + 1]) + "\n...\n```"


def table_headline() -> str | None:
    """The README's one small table: the headline of each study, from the same JSON as its own table."""
    e1 = [_load("equilibrium.json"), _load("e1_seed1/equilibrium.json")]
    a, b = _load("e2_real_encoder_A.json"), _load("e2_real_encoder_B.json")
    e4, hj, cal, be, st = (_load(n) for n in ("e4_retrieval.json", "human_judgments.json", "calibration.json",
                                              "bench.json", "streaming.json"))
    if None in (*e1, a, b, e4, hj, cal, be, st):
        return None

    def span(xs: list[float], fmt: str = ".3f") -> str:
        return f"{min(xs):{fmt}}–{max(xs):{fmt}}"

    def ci(f: dict, key: str) -> str:
        lo, hi = f[f"{key}_ci95"]
        return f"{f[key]:.3f} [{lo:.3f}, {hi:.3f}]"

    runs = [r for d in e1 for r in d["results"]]
    target = f"slope in [{runs[0]['target']['slope'][0]}, {runs[0]['target']['slope'][1]}], r ≥ {{}}"
    rows = ["| result | measured | target | verdict |", "|---|---|---|---|"]
    for label, group in (("SGD and heavy-ball", [r for r in runs if r["optimizer"] == "sgd"]),
                         ("AdamW, β1 = 0.9 and 0", [r for r in runs if r["optimizer"] == "adamw"])):
        fits = [r["fits"]["dense_corrected_law"] for r in group]
        met = sum(r["target"]["met"] for r in group)
        rows.append(f"| E1, small encoders trained to equilibrium, {label} (2 seeds) | slope "
                    f"{span([f['slope'] for f in fits])}, r {span([f['pearson_r'] for f in fits])} | "
                    f"{target.format(runs[0]['target']['pearson_r'])} | met in {met} of {len(group)} runs |")
    snap = [d["snapshot_choice"]["scores"][d["snapshot_choice"]["winner"]]["targets_met"] for d in e1]
    rows.append(f"| E1, single-snapshot predictor `r_eq_snapshot` | met on {snap[0]} of 4 choice variants at "
                f"seed 0, {snap[1]} of 4 at a fresh seed | {target.format(runs[0]['target']['pearson_r'])} | "
                f"{'met' if min(snap) == 4 else 'not met'} |")
    for d, label in ((b, "E2, MiniLM fine-tuned, B: projection head"), (a, "E2, MiniLM fine-tuned, A: no head")):
        f = d["fits"].get(f"{d['main_predictor']}_full_law") or d["fits"]["full_law"]  # A has one probe
        rows.append(f"| {label} | slope {ci(f, 'slope')}, r {ci(f, 'pearson_r')} | "
                    f"{target.format(d['target']['pearson_r'])} | {'met' if d['target']['met'] else 'not met'} |")
    h = e4["headline"]
    rows.append(f"| E4, retrieval, NDCG@10 of `cos · ‖d‖^α` over cosine | {h['gain_pct']:+.2f}% "
                f"[{h['gain_ci_pct'][0]:+.2f}, {h['gain_ci_pct'][1]:+.2f}] at α = {h['best_alpha']:+.1f} | "
                f"paper, text-only encoders: ≤ ~{h['paper_text_only_max_gain_pct']}% | "
                f"{'holds' if h['within_paper_claim'] else 'does not hold'} |")
    gains = [f["test"]["gain"] for m in hj["models"].values() for s in ("wordsim353", "simlex999", "lee")
             for f in m[s]["folds"]]
    rows.append(f"| Norms vs human judgments, held-out gain over cosine | "
                f"{sum(g['ci_low'] > 0 for g in gains)} of {len(gains)} gains above 0 (95% CI) | "
                f"a gain | no gain |")
    k = str(cal["decision"]["default_K"])
    cov = {q: [m[k][q]["coverage"] for m in cal["results"].values()] for q in ("D", "V2")}
    rows.append(f"| Error bars, coverage of the 95% intervals at K = {k} | D {span(cov['D'])}, "
                f"V2 {span(cov['V2'])} | [{cal['band'][0]:.2f}, {cal['band'][1]:.2f}] | "
                f"{'met (point estimates)' if cal['decision']['met'] else 'not met'} |")
    r = be["ratios"]
    head = [v for key, v in r.items() if key.startswith("head/")]
    rows.append(f"| Speed on CPU, ratios in one run: head mode vs per-sample-gradient tools; jvp mode vs "
                f"per-probe Jacobians | {span(head, '.1f')}x; {r['jacrev/normfast_vs_jacrev']:.1f}x | | |")
    ok = st["targets"]["largest_under_limit"] and st["targets"]["ratio_within_limit"]
    rows.append(f"| Streaming 10⁷ token probes: peak memory / that of 10⁶ | {st['peak_rss_ratio']:.3f} | "
                f"≤ {st['targets']['ratio_limit']}, < {st['targets']['peak_rss_limit_bytes'] / 1e9:.0f} GB | "
                f"{'met' if ok else 'not met'} |")
    return "\n".join(rows)


TABLES: dict[str, Callable[[], str | None]] = {
    "e2": table_e2,
    "demo": table_demo,
    "bench": table_bench,
    "streaming": table_streaming,
    "e3": table_e3,
    "e4": table_e4,
    "e5": table_e5,
    "e1": table_e1,
    "e1-snapshot": table_e1_snapshot,
    "e1-ledger": table_e1_ledger,
    "e1-resists": table_e1_resists,
    "e1-drift": table_e1_drift,
    "quartic": table_quartic,
    "head_stats": table_head_stats,
    "calibration": table_calibration,
    "adaptive_m": table_adaptive_m,
    "kernel_resources": table_kernel_resources,
    "roofline": table_roofline,
    "corpus": table_corpus,
    "judgments": table_judgments,
    "headline": table_headline,
    "demo-excerpt": table_demo_excerpt,
}


def render_all() -> dict[str, str]:
    return {name: text for name, fn in TABLES.items() if (text := fn()) is not None}


_BLOCK = re.compile(r"(<!-- results:(?P<name>[\w-]+) -->\n)(?P<body>(?:.*?\n)?)(<!-- /results:(?P=name) -->)", re.S)


def check(readme: Path) -> list[str]:
    """Names of README blocks that differ from the JSON (or name no known table)."""
    tables = render_all()
    bad = []
    for m in _BLOCK.finditer(readme.read_text()):
        name = m.group("name")
        if name not in tables or tables[name] + "\n" != m.group("body"):
            bad.append(name)
    return bad


def write(readme: Path) -> None:
    tables = render_all()
    def fill(m: re.Match) -> str:
        name = m.group("name")
        body = tables[name] + "\n" if name in tables else m.group("body")
        return m.group(1) + body + m.group(4)

    text = _BLOCK.sub(fill,
                      readme.read_text())
    readme.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--check", type=Path, help="README to check against the JSON")
    g.add_argument("--write", type=Path, help="README whose tables to refresh")
    args = p.parse_args(argv)
    if args.check:
        bad = check(args.check)
        if bad:
            print(f"README tables out of date with bench/results: {', '.join(bad)}", file=sys.stderr)
            return 1
        return 0
    if args.write:
        write(args.write)
        return 0
    for name, text in render_all().items():
        print(f"<!-- results:{name} -->\n{text}\n<!-- /results:{name} -->\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
