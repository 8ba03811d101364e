"""``normfast probe``: the command-line driver over :func:`normfast.engine.probe.probe`."""

from __future__ import annotations

from pathlib import Path

from normfast.apps.options import (
    direction_arguments,
    direction_settings,
    encoder_arguments,
    load_model,
    make_objective,
    model_arguments,
    objective_arguments,
    pair_encoder_for,
    pairs_arguments,
    read_pairs_file,
)
from normfast.data.pairs import PairSource
from normfast.data.records import read_jsonl, read_lines, read_tsv
from normfast.engine.config import MODES, ProbeConfig
from normfast.engine.probe import probe
from normfast.engine.runner.distributed import current_shard

probe_description = """\
Probe a contrastive encoder: for every input (--pooled) or every token
(--tokens) measure radial drift D, stochastic heat V2, damping kappa and the
predicted equilibrium norm R_eq, on M virtual batches of a scale-invariant
objective (nothing is trained). Rows stream to a Parquet file chunk by chunk;
an interrupted run continues with --resume.

Under torchrun the probe items are sharded over the ranks (gloo on CPU, NCCL
on GPU; directions are computed once on rank 0 and broadcast); the output is
then OUT.manifest.json naming one Parquet part per rank, which `normfast
report` reads as one table. --resume works with any number of ranks.

examples:
  normfast probe minilm --probes words.txt --objective simcse --tokens \\
      --params 'encoder\\.layer\\.5\\.' --out runs/words.parquet
  normfast probe open_clip:ViT-B-32 --tower image --probes imgs.txt \\
      --pairs pairs.tsv --objective clip --params head --out runs/clip.parquet
  normfast probe mpnet --corpus news.txt --params 'encoder\\.layer\\.11\\.' \\
      --out runs/news.parquet
  torchrun --nproc-per-node 4 -m normfast probe minilm --probes words.txt \\
      --tokens --params 'encoder\\.layer\\.5\\.' --out runs/words.parquet

probes file: .txt (one item per line), .jsonl (--text-key, default "text";
optional "id"), or .tsv (first column). Probes and pairs files are UTF-8 (a
byte-order mark is dropped); lines end at \\n, \\r\\n or \\r and hold at most
1 MiB each.

corpus file (--corpus, token rows): .jsonl (--text-key, --id-key) or plain
text, one document per line (--doc-layout lines, default) or blank-line
separated (--doc-layout blank). Each document is tokenized whole and cut into
windows of at most --window tokens that end at word boundaries; with --stride
< --window the windows overlap and each token is owned by the window where it
is nearer the middle (column `primary`). Token rows add doc_id, window,
doc_position, is_special, word_id, word and primary. Without --pairs, simcse
uses the corpus's sentences (NLTK Punkt, trained on the corpus itself) as its
virtual-batch items. Then: normfast aggregate RUN.parquet --by token|word. For image towers each item is an
image path. pairs file: .jsonl with --anchor-key/--positive-key (or
--label-key for supcon, items under --text-key), or .tsv with two columns.
SimCSE needs no pairs file: it uses the probes themselves. Given --pairs, it
reads plain items from it: .txt one item per line, .tsv the first column,
.jsonl --text-key; a pairs file works too and gives SimCSE its anchors (the
first column, or --anchor-key when the records have no --text-key)."""


def _read_probe_file(path: Path, text_key: str) -> tuple[list[str], list[str] | None]:
    fn = "probes file"
    if path.is_dir():
        raise ValueError(
            f"{fn}: {path} is a folder; expected a file of probe items (.txt one per line, .jsonl or .tsv)"
        )
    if path.suffix == ".jsonl":
        records = [rec for _, rec in read_jsonl(path, fn=fn, text_fields=(text_key,), key_fields=("id",))]
        items = [rec[text_key] for rec in records]
        has_ids = any("id" in rec for rec in records)
        ids = [str(rec.get("id", i)) for i, rec in enumerate(records)]
    elif path.suffix == ".tsv":
        items, ids, has_ids = [fields[0] for _, fields in read_tsv(path, fn=fn, columns=[0])], [], False
    else:
        items, ids, has_ids = [line for _, line in read_lines(path, fn=fn)], [], False
    if not items:
        raise ValueError(f"probes file {path} holds no probe items")
    return items, (ids if has_ids else None)


def _load_images(paths: list[str], what: str = "probe"):
    from PIL import Image, UnidentifiedImageError

    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        except (OSError, UnidentifiedImageError) as exc:
            raise ValueError(f"{what} {path!r}: cannot read it as an image ({exc})") from None
    return images


class _ImagePairs(PairSource):
    """A pairs file's image paths, opened when a virtual batch draws them: the anchors (or items) for an
    image tower, the positives too unless CLIP's text tower encodes them."""

    def __init__(self, source: PairSource, positives_are_images: bool):
        self.__dict__.update(source.__dict__)
        self.positives_are_images = positives_are_images

    def batch(self, indices):
        drawn = super().batch(indices)
        if self.kind == "items":
            return _load_images(drawn, "pairs file: item")
        first, second = drawn
        first = _load_images(first, "pairs file: anchor" if self.kind == "pairs" else "pairs file: item")
        if self.kind == "pairs" and self.positives_are_images:
            second = _load_images(second, "pairs file: positive")
        return first, second


def probe_arguments(p) -> None:
    model_arguments(p)
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
    pairs_arguments(
        p,
        "virtual-batch source (.jsonl / .tsv); optional for simcse, which reads plain "
        "items from it (.txt / .tsv / .jsonl) or a pairs file's anchors",
    )
    objective_arguments(p)
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
    direction_arguments(p)
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
    p.add_argument("--directions-per-pass", type=int, default=None, help="K directions per JVP pass")
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
        help="adaptive M: add K batches at a time until the --target-quantile of se(V2)/V2 over the "
        "first chunk is at most this (e.g. 0.1), up to --max-batches",
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
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--plots", action="store_true", help="also write the report figures next to --out")


def probe_main(args) -> int:
    import os
    import sys

    from normfast.core.checks import check_device
    from normfast.engine.runner.distributed import init_from_env

    try:  # before anything is loaded: a missing GPU is one line, not a driver error in the first transfer
        check_device("--device", args.device)
    except ValueError as exc:
        if os.environ.get("RANK", "0") == "0":  # under torchrun, said once
            print(f"normfast probe: error: {exc}", file=sys.stderr)
        return 2
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


def _probe_cli(args, device: str, root: bool) -> int:
    import sys

    from normfast.data.pairs import PairSource

    try:
        from normfast.core.paths import check_outputs

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
        if args.corpus:
            from normfast.data.corpus import read_documents

            documents = read_documents(args.corpus, layout=args.doc_layout, text_key=args.text_key, id_key=args.id_key)
        else:
            items, ids = _read_probe_file(Path(args.probes), args.text_key)
        encoder = load_model(args, device)
        corpus_pairs = None
        if args.corpus:
            from normfast.data.corpus import CorpusWindows, split_sentences

            items = CorpusWindows.from_encoder(
                documents, encoder, window=args.window, stride=args.stride, progress=root and not args.no_progress
            )
            ids = items.ids()
            corpus_pairs = split_sentences([d.text for d in documents])
        if encoder.modality == "image":
            items = _load_images(items)
        objective = make_objective(args)
        pairs = None
        if args.pairs:
            pairs = read_pairs_file(Path(args.pairs), args, objective.needs)
        elif corpus_pairs is not None:
            if objective.needs != "items":
                raise ValueError(
                    f"--objective {objective.name} needs --pairs; with --corpus only simcse "
                    f"can use the corpus's own sentences"
                )
            pairs = PairSource.from_iterable(corpus_pairs, kind="items")
        if pairs is not None and args.pairs and encoder.modality == "image":
            # the file holds image paths; under clip the positives are captions for the text tower
            pairs = _ImagePairs(pairs, positives_are_images=objective.name != "clip")
        pair_encoder = pair_encoder_for(encoder, objective)
        chunk_size = args.chunk_size if args.chunk_size is not None else (8 if args.corpus else 64)
        config = ProbeConfig(
            **direction_settings(args),
            mode=args.mode,
            output=output,
            chunk_size=chunk_size,
            directions_per_pass=args.directions_per_pass,
            uncertainty=not args.no_uncertainty,
            radial_spread=args.per_batch,
            target_rse=args.target_rse,
            max_batches=args.max_batches,
            target_quantile=args.target_quantile,
            snapshot=args.snapshot or args.snapshot_steps is not None,
            snapshot_steps=args.snapshot_steps,
        )
        common = dict(pair_encoder=pair_encoder, progress=not args.no_progress, model_name=args.model)
        if args.directions is None:
            result = probe(
                encoder,
                items,
                objective,
                pairs,
                config,
                out=args.out,
                resume=args.resume,
                overwrite=args.overwrite,
                ids=ids,
                **common,
            )
        else:
            result = _with_directions(args, encoder, items, ids, objective, pairs, config, common)
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
    return 0


def _with_directions(args, encoder, items, ids, objective, pairs, config, common):
    """``--directions FOLDER``: reuse the directions saved there, or compute, save and use them."""
    import sys

    folder = Path(args.directions)
    from normfast.engine.prober import Prober
    from normfast.engine.runner.artifact import is_artifact

    if is_artifact(folder):
        prober = Prober.load(folder, encoder, objective, pairs, config, **common)
        saved = True
        if common["progress"]:
            print(f"normfast probe: reusing the directions in {folder}", file=sys.stderr)
    else:
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--directions {folder} is a file; give a folder for the directions")
        # simcse without --pairs draws from the probes: the saved directions are bound to them
        prober = Prober(encoder, objective, pairs if pairs is not None else items, config, **common)
        # before the probe, so that an interrupted run keeps them; adaptive M chooses M on this run's
        # first chunk, so its directions are saved after the probe
        saved = config.target_rse is None
        if saved:
            prober.save(folder)
    result = prober.probe(items, args.out, resume=args.resume, overwrite=args.overwrite, ids=ids)
    if not saved:
        prober.save(folder)
    return result
