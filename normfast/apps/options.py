"""The options ``normfast probe``, ``normfast directions`` and ``normfast serve`` share -- the model,
the virtual-batch source, the objective and the settings of the directions -- and what they build
from them (the encoder, the pair source, the objective, the pair encoder, the config's direction part)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from normfast.apps.probe_inputs import read_pairs_file
from normfast.engine.defaults import DEFAULT_DRIFT_BATCHES, DEFAULT_GROUPS, HEAT_SAMPLING, PRESETS

__all__ = [
    "direction_arguments",
    "direction_settings",
    "encoder_arguments",
    "load_model",
    "make_objective",
    "model_arguments",
    "objective_arguments",
    "pair_encoder_for",
    "pairs_arguments",
    "read_pairs_file",
]


def model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", help="hub id, local folder (HF or sentence-transformers), 'minilm', or open_clip:ARCH[@WEIGHTS]"
    )


def encoder_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tower", choices=["image", "text"], help="open_clip tower to probe")
    p.add_argument("--no-projection", action="store_true", help="open_clip / sentence-transformers without the head")
    p.add_argument("--pooling", default=None, help="HF pooling (mean, cls, ...)")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda, cuda:N or mps (default: cuda when a GPU is visible, else cpu)",
    )


def pairs_arguments(p: argparse.ArgumentParser, pairs_help: str) -> None:
    p.add_argument("--pairs", help=pairs_help)
    p.add_argument("--anchor-key", default="anchor", help="--pairs .jsonl: key of the anchor (default: anchor)")
    p.add_argument("--positive-key", default="positive", help="--pairs .jsonl: key of the positive (default: positive)")
    p.add_argument("--label-key", default=None, help="jsonl key of class labels (supcon)")


def objective_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--objective",
        default="simcse",
        choices=["simcse", "infonce", "clip", "supcon"],
        help="the virtual objective (default: simcse, dropout views of one item: no labels needed)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="objective temperature (default: the objective's own: infonce/simcse 0.05, clip 0.07, supcon 0.1)",
    )
    p.add_argument(
        "--symmetric",
        action="store_true",
        help="infonce: average the anchor->positive and positive->anchor losses (clip is always symmetric)",
    )


def direction_arguments(p: argparse.ArgumentParser) -> None:
    """The settings the directions depend on (and the memory budget that decides how they are kept)."""
    p.add_argument(
        "--params", default="all", help="probed parameters: all, head, or a regex over parameter names (default: all)"
    )
    p.add_argument("--batches", type=int, default=16, help="M, virtual batches (>= 2; default 16)")
    p.add_argument(
        "--drift-batches",
        type=int,
        default=DEFAULT_DRIFT_BATCHES,
        help=f"M_D, virtual batches of the drift, taken from their mean update direction (one more "
        f"directional pass per batch group; >= M; default {DEFAULT_DRIFT_BATCHES}); 0: the "
        f"drift from the M heat batches, per batch",
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
    p.add_argument("--batch-size", type=int, default=32, help="pairs per virtual batch (default 32)")
    p.add_argument(
        "--optimizer", default="sgd", choices=list(PRESETS), help="optimizer preset of the law (default: sgd)"
    )
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate eta of the law (default 1e-3)")
    p.add_argument("--wd", type=float, default=1e-2, help="decoupled weight decay lambda (default 1e-2)")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (heuristic eta/(1-beta))")
    p.add_argument("--no-decay", default=None, help="regex of probed parameters without weight decay")
    p.add_argument("--seed", type=int, default=0, help="seed of the virtual batches and their dropout (default 0)")
    p.add_argument(
        "--memory-budget-mb",
        type=float,
        default=2048,
        help="working memory for the directions and the passes; directions that do not fit together "
        "are computed (and read) in groups (default 2048)",
    )


def direction_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~normfast.engine.config.ProbeConfig` fields of :func:`direction_arguments`."""
    return dict(
        params=args.params,
        optimizer=args.optimizer,
        lr=args.lr,
        weight_decay=args.wd,
        momentum=args.momentum,
        no_decay=args.no_decay,
        batches=args.batches,
        drift_batches=args.drift_batches or None,
        heat_sampling=args.heat_sampling,
        groups=args.groups,
        batch_size=args.batch_size,
        seed=args.seed,
        memory_budget_mb=args.memory_budget_mb,
    )


def load_model(args: argparse.Namespace, device: str) -> Any:
    from normfast.encoders import load_encoder

    kw = {}
    if args.tower:
        kw["tower"] = args.tower
    if args.pooling:
        kw["pooling"] = args.pooling
    return load_encoder(args.model, projection=not args.no_projection, device=device, **kw)


def make_objective(args: argparse.Namespace) -> Any:
    from normfast.engine.directions.objectives import get_objective

    kw = {} if args.temperature is None else {"temperature": args.temperature}
    if args.symmetric:
        if args.objective != "infonce":
            raise ValueError(
                f"--symmetric applies to --objective infonce, got --objective {args.objective}"
                + (" (clip is symmetric already)" if args.objective == "clip" else "")
            )
        kw["symmetric"] = True
    return get_objective(args.objective, **kw)


def pair_encoder_for(encoder: Any, objective: Any) -> Any:
    """CLIP on one open_clip tower: the other tower encodes the positives."""
    if objective.name == "clip" and hasattr(encoder, "with_tower"):
        return encoder.with_tower("text" if encoder.modality == "image" else "image")
    return None
