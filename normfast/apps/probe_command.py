"""``normfast probe``: the command-line driver over :func:`normfast.engine.probe.probe`."""

from __future__ import annotations

from pathlib import Path

# nothing here imports torch at import time: `normfast probe --help` builds this parser
from normfast.apps.corpus import CORPUS_BATCH_SIZE, CORPUS_BATCHES, CORPUS_CHUNK, CORPUS_TEMPERATURE
from normfast.apps.probe_inputs import image_pairs, load_images, read_pairs_file, read_probe_file
from normfast.engine.defaults import DEFAULT_DRIFT_BATCHES, DEFAULT_GROUPS, HEAT_SAMPLING, MODES, PRESETS

probe_description = f"""\
Probe a contrastive encoder: for every input (--pooled) or every token
(--tokens) measure radial drift D, stochastic heat V2, damping kappa and the
predicted equilibrium norm R_eq, on M virtual batches of a scale-invariant
objective (nothing is trained). Rows stream to a Parquet file chunk by chunk;
an interrupted run continues with --resume.

examples:
  normfast probe all-MiniLM-L6-v2 --corpus lee.txt --out runs/lee.parquet
  normfast probe minilm --probes words.txt --objective simcse --tokens \\
      --params 'encoder\\.layer\\.5\\.' --out runs/words.parquet
  normfast probe open_clip:ViT-B-32 --tower image --probes imgs.txt \\
      --pairs pairs.tsv --objective clip --params head --out runs/clip.parquet
  torchrun --nproc-per-node 4 -m normfast probe minilm --probes words.txt \\
      --tokens --params 'encoder\\.layer\\.5\\.' --out runs/words.parquet

corpus (--corpus FILE, the corpus recipe, as normfast.probe_corpus in Python):
every token of every document probed in its context. Each document is
tokenized whole and cut into windows of at most --window tokens that end at
word boundaries; with --stride < --window the windows overlap and each token
is owned by the window where it is nearer the middle (column `primary`).
Token rows add doc_id, window, doc_position, is_special, word_id, word and
primary. The recipe's defaults, each changed by its option: SimCSE at
temperature {CORPUS_TEMPERATURE} (at 0.05 distinct sentences saturate the
objective) on the corpus's own sentences (NLTK Punkt, trained on the corpus;
--pairs to give others), the last transformer layer (--params), M =
{CORPUS_BATCHES} batches of {CORPUS_BATCH_SIZE} sentences (half the sentences
when the corpus has fewer), the drift of those batches (--drift-batches N for
the mean direction over N), {CORPUS_CHUNK} windows per chunk. Then: normfast
aggregate RUN.parquet --by word, or normfast view RUN.parquet. The file:
.jsonl (--text-key, --id-key) or plain text, one document per line
(--doc-layout lines, default) or blank-line separated (--doc-layout blank).

probes file: .txt (one item per line), .jsonl (--text-key, default "text";
optional "id"), or .tsv (first column); for image towers each item is an
image path. Probes and pairs files are UTF-8 (a byte-order mark is dropped);
lines end at \\n, \\r\\n or \\r and hold at most 1 MiB each.

pairs file: .jsonl with --anchor-key/--positive-key (or --label-key for
supcon, items under --text-key), or .tsv with two columns. SimCSE needs no
pairs file: it uses the probes themselves (with --corpus: the corpus's
sentences). Given --pairs, it reads plain items from it: .txt one item per
line, .tsv the first column, .jsonl --text-key; a pairs file works too and
gives SimCSE its anchors (the first column, or --anchor-key when the records
have no --text-key).

Under torchrun the probe items are sharded over the ranks (gloo on CPU, NCCL
on GPU; directions are computed once on rank 0 and broadcast); the output is
then OUT.manifest.json naming one Parquet part per rank, which `normfast
report` reads as one table. --resume works with any number of ranks."""


def probe_arguments(p) -> None:
    p.add_argument(
        "model", help="hub id, local folder (HF or sentence-transformers), 'minilm', or open_clip:ARCH[@WEIGHTS]"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--probes", help="probe items file (.txt / .jsonl / .tsv)")
    src.add_argument("--corpus", help="a corpus to probe token by token, in context (.txt or .jsonl; see below)")
    p.add_argument(
        "--text-key",
        default="text",
        help="jsonl key of the text: of the probes, the corpus documents, and the items of a --pairs "
        "file (default: text)",
    )
    p.add_argument("--id-key", default="id", help="--corpus .jsonl: key of the document id (default: id)")
    p.add_argument(
        "--doc-layout",
        default="lines",
        choices=["lines", "blank"],
        help="--corpus plain text: one document per line (default) or blank-line separated",
    )
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help="--corpus: content tokens per window (default: the model's maximum length less its special tokens)",
    )
    p.add_argument(
        "--stride",
        type=int,
        default=None,
        help="--corpus: tokens between window starts (default: --window, no overlap)",
    )
    p.add_argument(
        "--pairs",
        help="virtual-batch source (.jsonl / .tsv); optional for simcse, which reads plain "
        "items from it (.txt / .tsv / .jsonl) or a pairs file's anchors",
    )
    p.add_argument("--anchor-key", default="anchor", help="--pairs .jsonl: key of the anchors (default: anchor)")
    p.add_argument(
        "--positive-key", default="positive", help="--pairs .jsonl: key of the positives (default: positive)"
    )
    p.add_argument("--label-key", default=None, help="jsonl key of class labels (supcon)")
    p.add_argument(
        "--objective",
        default="simcse",
        choices=["simcse", "infonce", "clip", "supcon"],
        help="the virtual objective: simcse (dropout views of items, no labels; default), infonce (pairs), "
        "clip (symmetric, image-text pairs), supcon (class labels)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"objective temperature (default: the objective's own: infonce/simcse 0.05, clip 0.07, supcon 0.1; "
        f"with --corpus simcse {CORPUS_TEMPERATURE}). A higher one lifts a saturated objective (loss near 0)",
    )
    p.add_argument(
        "--symmetric",
        action="store_true",
        help="infonce: average the anchor->positive and positive->anchor losses (clip is always symmetric)",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tokens", dest="output", action="store_const", const="tokens", help="one row per token position")
    g.add_argument(
        "--pooled",
        dest="output",
        action="store_const",
        const="pooled",
        help="one row per input (default, except with --corpus)",
    )
    p.set_defaults(output=None)
    p.add_argument(
        "--mode",
        default="auto",
        choices=list(MODES),
        help="head: closed form for a final linear head; jvp: general; auto (default)",
    )
    p.add_argument(
        "--params",
        default=None,
        help="probed parameters: all, head, last (the last transformer layer), or a regex over parameter "
        "names (default: all; with --corpus: last)",
    )
    p.add_argument("--batches", type=int, default=None, help=f"M, virtual batches (>= 2; default {CORPUS_BATCHES})")
    p.add_argument(
        "--drift-batches",
        type=int,
        default=None,
        help=f"M_D, virtual batches of the drift, taken from their mean update direction (one more "
        f"directional pass per batch group; >= M; default {DEFAULT_DRIFT_BATCHES}; with --corpus 0); 0: "
        f"the drift from the M heat batches, per batch",
    )
    p.add_argument(
        "--heat-sampling",
        default="energy",
        choices=list(HEAT_SAMPLING),
        help="how the heat's M batches are chosen: energy (drawn from the M_D drift batches by their gradient "
        "energy and weighted, so that a few rare high-energy batches cannot move the heat's level between seeds) "
        "or uniform (the first M, unweighted: the plain estimator); default energy",
    )
    p.add_argument(
        "--groups",
        type=int,
        default=DEFAULT_GROUPS,
        help=f"K, batch groups behind every error bar (se_D, sign stability, se_V2, se_Q, R_eq "
        f"intervals; t with K-1 dof; default {DEFAULT_GROUPS})",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"pairs (or items) per virtual batch, at most as many as the source holds (default "
        f"{CORPUS_BATCH_SIZE}; with --corpus and fewer sentences: half of them)",
    )
    p.add_argument(
        "--optimizer",
        default="sgd",
        choices=list(PRESETS),
        help="optimizer preset of the law: sgd (the scale-invariant branch) or adamw (the scale-free "
        "branch, a heuristic; default sgd)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate eta of the law (default 1e-3)")
    p.add_argument("--wd", type=float, default=1e-2, help="decoupled weight decay lambda (default 1e-2)")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (heuristic eta/(1-beta))")
    p.add_argument("--no-decay", default=None, help="regex of probed parameters without weight decay")
    p.add_argument("--seed", type=int, default=0, help="seed of the virtual batches and of dropout (default 0)")
    p.add_argument(
        "--directions",
        metavar="FOLDER",
        default=None,
        help="saved directions: reused when FOLDER holds them (made for this model, objective, pair source "
        "and direction settings: refused otherwise, naming what differs; without --pairs, the pair source "
        "they were made from), else computed, saved there and used (`normfast directions` makes them alone)",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="probe items per streamed chunk (default 64; with --corpus 8 windows)",
    )
    p.add_argument(
        "--directions-per-pass",
        type=int,
        default=None,
        help="update directions carried by one forward-mode (jvp) pass (default: as many as the memory budget allows)",
    )
    p.add_argument(
        "--memory-budget-mb",
        type=float,
        default=2048,
        help="memory the update directions and the directions per pass may take, in MB (default 2048): "
        "beyond it the directions are computed in groups (directions-outer loop order)",
    )
    p.add_argument(
        "--no-uncertainty",
        action="store_true",
        help="skip the error bars (se_D, se_V2, se_Q, R_eq intervals): the bare estimates (head mode: the S form)",
    )
    p.add_argument(
        "--per-batch",
        action="store_true",
        help="head mode: the per-batch form (se_D and sign stability from every batch; cost grows with M)",
    )
    p.add_argument(
        "--target-rse",
        type=float,
        default=None,
        help="adaptive M: add one batch per group (--groups) at a time until the --target-quantile of "
        "se(V2)/V2 over the first chunk is at most this (e.g. 0.1), up to --max-batches",
    )
    p.add_argument("--max-batches", type=int, default=256, help="cap of the adaptive M (default 256)")
    p.add_argument(
        "--target-quantile",
        type=float,
        default=0.9,
        help="quantile of se(V2)/V2 that --target-rse applies to (default 0.9)",
    )
    p.add_argument(
        "--snapshot",
        action="store_true",
        help="add the single-snapshot predictor r_eq_snapshot: continue the model virtually from this "
        "snapshot on the pairs for a few relaxation times and solve the law with the trajectory's "
        "shrunk drift and heat (pooled output; costly: see normfast.engine.trajectory.snapshot)",
    )
    p.add_argument(
        "--snapshot-steps",
        type=int,
        default=None,
        help="with --snapshot: the virtual trajectory's steps (default: 4 relaxation times of R², 500 to 20000 steps)",
    )
    p.add_argument("--tower", choices=["image", "text"], help="open_clip tower to probe")
    p.add_argument("--no-projection", action="store_true", help="open_clip / sentence-transformers without the head")
    p.add_argument("--pooling", default=None, help="HF pooling (mean, cls, ...)")
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda when a GPU is visible, else cpu)"
    )
    p.add_argument("--out", required=True, help="output .parquet")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run at --out")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (e.g. for a log file)")
    p.add_argument("--plots", action="store_true", help="also write the report figures next to --out")


def probe_main(args) -> int:
    import os
    import sys

    from normfast.core.checks import check_device
    from normfast.engine.runner.distributed import init_from_env

    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:  # before anything is loaded: a missing GPU is one line, not a driver error in the first transfer
        check_device("--device", args.device)
    except ValueError as exc:
        if os.environ.get("RANK", "0") == "0":  # under torchrun, said once
            print(f"normfast probe: error: {exc}", file=sys.stderr)
        return 2
    from normfast.engine.runner.distributed import current_shard

    # under torchrun: join the process group (gloo on CPU, NCCL on GPU) and shard the run
    device, created = init_from_env(args.device)
    shard = current_shard()
    root = shard is None or shard.is_root
    try:
        return _probe_cli(args, str(device), root)
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()


def _settings(args, output: str) -> dict:
    """The ProbeConfig settings the command line sets; those not given keep ProbeConfig's defaults (a
    plain probe) or the corpus recipe's (:func:`normfast.apps.corpus.probe_corpus`)."""
    given = {
        "params": args.params,
        "batches": args.batches,
        "batch_size": args.batch_size,
        "chunk_size": args.chunk_size,
    }
    settings = {k: v for k, v in given.items() if v is not None}
    if args.drift_batches is not None:  # 0: the per-batch drift of the heat batches
        settings["drift_batches"] = args.drift_batches or None
    settings.update(
        heat_sampling=args.heat_sampling,
        output=output,
        mode=args.mode,
        optimizer=args.optimizer,
        lr=args.lr,
        weight_decay=args.wd,
        momentum=args.momentum,
        no_decay=args.no_decay,
        groups=args.groups,
        seed=args.seed,
        directions_per_pass=args.directions_per_pass,
        memory_budget_mb=args.memory_budget_mb,
        uncertainty=not args.no_uncertainty,
        radial_spread=args.per_batch,
        target_rse=args.target_rse,
        max_batches=args.max_batches,
        target_quantile=args.target_quantile,
        snapshot=args.snapshot or args.snapshot_steps is not None,
        snapshot_steps=args.snapshot_steps,
    )
    return settings


def _objective(args, corpus: bool):
    """The objective the options name (with --corpus, the recipe's: SimCSE at its temperature)."""
    from normfast.apps.corpus import corpus_objective
    from normfast.engine.directions.objectives import get_objective

    kw = {} if args.temperature is None else {"temperature": args.temperature}
    if args.symmetric:
        if args.objective != "infonce":
            raise ValueError(
                f"--symmetric applies to --objective infonce, got --objective {args.objective}"
                + (" (clip is symmetric already)" if args.objective == "clip" else "")
            )
        kw["symmetric"] = True
    return corpus_objective(args.objective, **kw) if corpus else get_objective(args.objective, **kw)


def _probe_cli(args, device: str, root: bool) -> int:
    import sys

    from normfast.core.paths import check_outputs
    from normfast.engine.config import ProbeConfig

    load_options = {"projection": not args.no_projection, "device": device}
    if args.tower:
        load_options["tower"] = args.tower
    if args.pooling:
        load_options["pooling"] = args.pooling
    try:
        check_outputs(
            inputs=[args.probes, args.corpus, args.pairs],
            owned=[f"{args.out}.parts"],
            files={"--out": args.out, "--out's manifest": Path(args.out).with_suffix(".manifest.json")},
        )
        output = args.output or ("tokens" if args.corpus else "pooled")
        if args.corpus and output != "tokens":
            raise ValueError("--corpus probes every token in context; --pooled does not apply")
        if not args.corpus and (args.window is not None or args.stride is not None):
            raise ValueError("--window and --stride apply to --corpus only")
        if args.corpus and args.directions is not None:
            raise ValueError("--directions applies to --probes runs; a --corpus run computes its own directions")
        if args.directions is not None:  # a folder that cannot be used is said before anything is loaded
            from normfast.engine.runner.integrity import check_directions_folder

            check_directions_folder(args.directions, "--directions")
        objective = _objective(args, bool(args.corpus))
        pairs = read_pairs_file(Path(args.pairs), args, objective.needs) if args.pairs else None
        settings = _settings(args, output)
        run = dict(out=args.out, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress)
        if args.corpus:
            if pairs is None and objective.needs != "items":
                raise ValueError(
                    f"--objective {objective.name} needs --pairs; with --corpus only simcse "
                    f"can use the corpus's own sentences"
                )
            from normfast.apps.corpus import probe_corpus

            # the same function as Python's normfast.probe_corpus: it checks every setting before loading the model
            result = probe_corpus(
                args.model,
                args.corpus,
                objective,
                pairs,
                layout=args.doc_layout,
                text_key=args.text_key,
                id_key=args.id_key,
                window=args.window,
                stride=args.stride,
                load_options=load_options,
                model_name=args.model,
                **run,
                **settings,
            )
        else:
            result = _probe_items(args, objective, pairs, ProbeConfig(**settings), load_options, run)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, ImportError) as exc:
        if root:
            print(f"normfast probe: error: {exc}", file=sys.stderr)
        return 2
    if not root:
        return 0
    print(result.format_summary())
    print(f"\nwrote {result.path} ({len(result)} rows)")
    if args.plots:
        for pth in result.plots(Path(args.out).parent, prefix=Path(args.out).stem):
            print(f"wrote {pth}")
    print(next_steps(result.path, corpus=bool(args.corpus)))
    return 0


def _probe_items(args, objective, pairs, config, load_options: dict, run: dict):
    """A probe of the items of --probes (the plain probe), every setting checked before the model loads."""
    from normfast.data.pairs import PairSource, check_batch_size
    from normfast.encoders import load_encoder
    from normfast.engine.probe import probe

    items, ids = read_probe_file(Path(args.probes), args.text_key)
    plan = config.resolve()  # checked once, before the model loads: the engine takes the plan as it is
    if pairs is None and objective.needs != "items":
        raise ValueError(f"--objective {objective.name} needs --pairs (a .jsonl or .tsv of pairs)")
    if plan.batch_indices is None:  # before the model is loaded: the pairs, or the probes for SimCSE
        source = pairs if pairs is not None else PairSource.from_iterable(items, kind="items")
        if pairs is None:
            source.what = "probe items (SimCSE draws its batches from the probes themselves)"
        check_batch_size("probe", config.batch_size, source)
    encoder = load_encoder(args.model, **load_options)
    if encoder.modality == "image":
        items = load_images(items)
        if pairs is not None:
            # the file holds image paths; under clip the positives are captions for the text tower
            pairs = image_pairs(pairs, positives_are_images=objective.name != "clip")
    pair_encoder = None
    if objective.name == "clip" and hasattr(encoder, "with_tower"):
        pair_encoder = encoder.with_tower("text" if encoder.modality == "image" else "image")
    if args.directions is not None:
        return _with_directions(args, encoder, items, ids, objective, pairs, plan, pair_encoder, run)
    return probe(
        encoder, items, objective, pairs, plan, pair_encoder=pair_encoder, ids=ids, model_name=args.model, **run
    )


def _with_directions(args, encoder, items, ids, objective, pairs, config, pair_encoder, run: dict):
    """``--directions FOLDER``: reuse the directions saved there, or compute, save and use them."""
    import sys

    from normfast.engine.prober import Prober
    from normfast.engine.runner.integrity import check_directions_folder

    folder = Path(args.directions)
    common = dict(pair_encoder=pair_encoder, progress=run["progress"], model_name=args.model)
    if check_directions_folder(folder, "--directions"):
        # every file checked here, before the output is opened: a refusal leaves no RUN.parquet.parts
        prober = Prober.load(folder, encoder, objective, pairs, config, **common)
        saved = True
        if run["progress"]:
            print(f"normfast probe: reusing the directions in {folder}", file=sys.stderr)
    else:
        # simcse without --pairs draws from the probes: the saved directions are bound to them
        prober = Prober(encoder, objective, pairs if pairs is not None else items, config, **common)
        # before the probe, so that an interrupted run keeps them; adaptive M chooses M on this run's
        # first chunk, so its directions are saved after the probe
        saved = prober.config.target_rse is None
        if saved:
            prober.save(folder)
    # one run over one set of items, as without --directions: heat_rel against the run's own median (the
    # reference fixed with the directions, which a service's calls need, is saved with them all the same)
    prober.relative_heat = "run"
    result = prober.probe(items, run["out"], resume=run["resume"], overwrite=run["overwrite"], ids=ids)
    if not saved:
        prober.save(folder)
    return result


def next_steps(path, corpus: bool) -> str:
    """What to run next on a finished run (printed after "wrote")."""
    lines = ["\nnext:", f"  normfast view {path}    # the run's page: the text colored by heat, the type tables"]
    if corpus:
        lines.append(f"  normfast aggregate {path} --by word    # one row per word, hottest and coldest")
    lines.append(f"  normfast report {path}    # this summary again, with the figures")
    return "\n".join(lines)
