"""``normfast probe``: the command-line driver over :func:`normfast.engine.probe.probe`."""

from __future__ import annotations

from pathlib import Path

# nothing here imports torch at import time: `normfast probe --help` builds this parser
from normfast.apps.corpus import (
    CORPUS_BATCH_SIZE,
    CORPUS_BATCHES,
    CORPUS_CHUNK,
    CORPUS_OBJECTIVE,
    CORPUS_TEMPERATURE,
    objectives_of_items,
)
from normfast.apps.options import (
    command_prober,
    direction_arguments,
    direction_settings,
    encoder_arguments,
    load_options,
    model_arguments,
    objective_arguments,
    objective_settings_given,
    output_arguments,
    pair_encoder_for,
    pairs_arguments,
    per_item_arguments,
    resolve_device,
)
from normfast.apps.probe_inputs import image_pairs, load_images, read_pairs_file, read_probe_file
from normfast.engine.defaults import DEFAULT_DRIFT_BATCHES, MODES

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


#: how the corpus recipe's defaults show in the shared options' help
CORPUS_NOTES = {
    "params": "default: all; with --corpus: last",
    "drift_batches": f"default {DEFAULT_DRIFT_BATCHES}; with --corpus 0",
    "batch_size": f"default {CORPUS_BATCH_SIZE}; with --corpus and fewer sentences: half of them",
}


def probe_arguments(p) -> None:
    model_arguments(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--probes", help="probe items file (.txt / .jsonl / .tsv)")
    src.add_argument("--corpus", help="a corpus to probe token by token, in context (.txt or .jsonl; see below)")
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
    pairs_arguments(
        p,
        f"virtual-batch source (.jsonl / .tsv); optional for an objective of items "
        f"({', '.join(objectives_of_items())}), which reads plain items from it (.txt / .tsv / .jsonl) or a "
        "pairs file's anchors",
        text_key_help="jsonl key of the text: of the probes, the corpus documents, and the items of a --pairs "
        "file (default: text)",
    )
    objective_arguments(p, notes={"temperature": f"with --corpus {CORPUS_OBJECTIVE} {CORPUS_TEMPERATURE}"})
    output_arguments(p, None, "one row per token position", "one row per input (default, except with --corpus)")
    p.add_argument(
        "--mode",
        default="auto",
        choices=list(MODES),
        help="head: closed form for a final linear head; jvp: general; auto (default)",
    )
    direction_arguments(p, notes=CORPUS_NOTES)
    per_item_arguments(p)
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
    encoder_arguments(p)
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

    args.device = resolve_device(args)
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
    settings = direction_settings(args)
    if args.chunk_size is not None:
        settings["chunk_size"] = args.chunk_size
    settings.update(
        output=output,
        mode=args.mode,
        directions_per_pass=args.directions_per_pass,
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
    """The objective the options name, with its settings given (with --corpus, the recipe's defaults)."""
    from normfast.apps.corpus import corpus_objective
    from normfast.engine.directions.objectives import get_objective

    settings = objective_settings_given(args)
    return corpus_objective(args.objective, **settings) if corpus else get_objective(args.objective, **settings)


def _probe_cli(args, device: str, root: bool) -> int:
    import sys

    from normfast.core.paths import check_outputs
    from normfast.engine.config import ProbeConfig

    options = load_options(args, device)
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
                    f"--objective {objective.name} needs --pairs; with --corpus only an objective of items "
                    f"({', '.join(objectives_of_items())}) can use the corpus's own sentences"
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
                load_options=options,
                model_name=args.model,
                **run,
                **settings,
            )
        else:
            result = _probe_items(args, objective, pairs, ProbeConfig(**settings), options, run)
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
            source.what = objective.batch_source("probe items")
        check_batch_size("probe", config.batch_size, source)
    encoder = load_encoder(args.model, **load_options)
    if encoder.modality == "image":
        items = load_images(items)
        if pairs is not None:
            # the file holds image paths; when the other tower encodes the positives (clip) they are captions
            pairs = image_pairs(pairs, positives_are_images=not objective.needs_pair_encoder)
    if args.directions is not None:
        return _with_directions(args, encoder, items, ids, objective, pairs, plan, run)
    pair_encoder = pair_encoder_for(encoder, objective)
    return probe(
        encoder, items, objective, pairs, plan, pair_encoder=pair_encoder, ids=ids, model_name=args.model, **run
    )


def _with_directions(args, encoder, items, ids, objective, pairs, config, run: dict):
    """``--directions FOLDER``: reuse the directions saved there, or compute, save and use them."""
    import sys

    from normfast.engine.runner.integrity import check_directions_folder

    folder = Path(args.directions)
    if check_directions_folder(folder, "--directions"):
        # every file checked here, before the output is opened: a refusal leaves no RUN.parquet.parts
        prober = command_prober(args, encoder, objective, pairs, config, saved=folder)
        saved = True
        if run["progress"]:
            print(f"normfast probe: reusing the directions in {folder}", file=sys.stderr)
    else:
        # an objective of items without --pairs draws from the probes: the saved directions are bound to them
        prober = command_prober(args, encoder, objective, pairs if pairs is not None else items, config)
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
