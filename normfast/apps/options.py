"""The command line's options, each built once, in groups the commands compose: the model and its
encoder, the virtual-batch source, the objective (the registry's choices and each objective's own
settings as flags), the settings the directions depend on, the per-item settings and the output
kind; and what the commands build from them (the load options, the objective, the pair encoder,
the config's fields).

A command may say its own default for an option (``defaults``: the demo probes one layer) and
how it words it (``notes``: the corpus recipe's defaults); the option itself -- its flag, type and
meaning -- is said here only. Nothing here imports torch: ``normfast probe --help`` builds it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Mapping, Sequence

from normfast.apps.probe_inputs import read_pairs_file
from normfast.engine.defaults import DEFAULT_DRIFT_BATCHES, DEFAULT_GROUPS, HEAT_SAMPLING, PRESETS
from normfast.engine.directions.objectives import Setting, get_objective, objective_class, objective_classes

__all__ = [
    "DEFAULT_OBJECTIVE",
    "direction_settings",
    "direction_arguments",
    "encoder_arguments",
    "load_model",
    "load_options",
    "make_objective",
    "model_arguments",
    "objective_arguments",
    "objective_options",
    "objective_settings_given",
    "output_arguments",
    "pair_encoder_for",
    "pairs_arguments",
    "per_item_arguments",
    "read_pairs_file",
    "resolve_device",
]

#: the objective of a command that names none: dropout views of items, no labels needed
DEFAULT_OBJECTIVE = "simcse"


def _add(
    p: argparse.ArgumentParser,
    options: Mapping[str, tuple[str, dict[str, Any], str, str | None]],
    only: Sequence[str] | None,
    defaults: Mapping[str, Any] | None,
    notes: Mapping[str, str] | None,
) -> None:
    """Add ``options`` (dest -> flag, argparse keywords, help with ``{default}``, default in words),
    those in ``only`` when given, with a command's own defaults and wording of them."""
    defaults, notes = defaults or {}, notes or {}
    for dest in only or options:
        flag, kw, text, default_words = options[dest]
        words = notes.get(dest, default_words)
        p.add_argument(flag, dest=dest, default=defaults.get(dest), help=text.format(default=words), **kw)


def model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", help="hub id, local folder (HF or sentence-transformers), 'minilm', or open_clip:ARCH[@WEIGHTS]"
    )


def encoder_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tower", choices=["image", "text"], help="open_clip tower to probe")
    p.add_argument("--no-projection", action="store_true", help="open_clip / sentence-transformers without the head")
    p.add_argument("--pooling", default=None, help="HF pooling (mean, cls, ...)")
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda when a GPU is visible, else cpu)"
    )


def resolve_device(args: argparse.Namespace) -> str:
    """``--device``, or cuda when a GPU is visible, else cpu."""
    if args.device is not None:
        return str(args.device)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_options(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """The keywords of :func:`~normfast.encoders.load_encoder` that the encoder options give."""
    options: dict[str, Any] = {"projection": not args.no_projection, "device": device}
    if args.tower:
        options["tower"] = args.tower
    if args.pooling:
        options["pooling"] = args.pooling
    return options


def load_model(args: argparse.Namespace, device: str | None = None) -> Any:
    from normfast.encoders import load_encoder

    return load_encoder(args.model, **load_options(args, device or resolve_device(args)))


def pairs_arguments(
    p: argparse.ArgumentParser,
    pairs_help: str,
    text_key_help: str = "jsonl key of the items of a --pairs file (default: text)",
) -> None:
    p.add_argument("--pairs", help=pairs_help)
    p.add_argument("--anchor-key", default="anchor", help="--pairs .jsonl: key of the anchors (default: anchor)")
    p.add_argument(
        "--positive-key", default="positive", help="--pairs .jsonl: key of the positives (default: positive)"
    )
    p.add_argument("--label-key", default=None, help="jsonl key of class labels (supcon)")
    p.add_argument("--text-key", default="text", help=text_key_help)


# ---------------------------------------------------------------------------------------------
# the objective: the registry's choices, and every objective's settings as flags


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


def _settings_by_name() -> dict[str, list[tuple[str, Setting]]]:
    """Setting name -> (objective, its setting) for every registered objective that declares it."""
    out: dict[str, list[tuple[str, Setting]]] = {}
    for name, cls in objective_classes().items():
        for setting in cls.declared_settings:
            out.setdefault(setting.name, []).append((name, setting))
    return out


def objective_options() -> tuple[str, ...]:
    """The dests of the objective's options: ``objective`` and every registered objective's settings."""
    return ("objective", *_settings_by_name())


def _setting_help(name: str, owners: list[tuple[str, Setting]], note: str | None) -> str:
    everyone = len(owners) == len(objective_classes())
    setting = owners[0][1]
    parts = []
    if setting.type is not bool:
        shown = {_shown(s.default) for _, s in owners}
        if len(shown) == 1:
            parts.append(f"default {shown.pop()}")
        else:
            parts.append("default: the objective's own: " + ", ".join(f"{o} {_shown(s.default)}" for o, s in owners))
    fixed = {o: c.fixed_settings[name] for o, c in objective_classes().items() if name in c.fixed_settings}
    parts += [f"{o}: always {_shown(value)}" for o, value in fixed.items()]
    if note:
        parts.append(note)
    who = "" if everyone else ", ".join(o for o, _ in owners) + ": "
    return f"{who}{setting.help}" + (f" ({'; '.join(parts)})" if parts else "")


def objective_arguments(
    p: argparse.ArgumentParser, default: str | None = DEFAULT_OBJECTIVE, notes: Mapping[str, str] | None = None
) -> None:
    """``--objective`` (the registry's names) and one flag per setting any registered objective declares."""
    classes = objective_classes()
    p.add_argument(
        "--objective",
        default=default,
        choices=list(classes),
        help="the virtual objective: "
        + ", ".join(f"{name} ({cls.summary})" for name, cls in classes.items())
        + f"; default {DEFAULT_OBJECTIVE}",
    )
    for name, owners in _settings_by_name().items():
        setting = owners[0][1]
        kw: dict[str, Any] = {"action": "store_true"} if setting.type is bool else {"type": setting.type}
        text = _setting_help(name, owners, (notes or {}).get(name))
        p.add_argument(setting.flag, dest=name, default=None, help=text, **kw)


def objective_settings_given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of ``--objective`` given on the command line; a flag the objective does not have is
    refused, naming the objectives it applies to."""
    name = args.objective
    cls = objective_class(name)
    mine = {s.name for s in cls.declared_settings}
    given = {}
    for setting_name, owners in _settings_by_name().items():
        value = getattr(args, setting_name, None)
        if value is None:
            continue
        if setting_name not in mine:
            flag = owners[0][1].flag
            fixed = cls.fixed_settings.get(setting_name)
            raise ValueError(
                f"{flag} applies to --objective {', '.join(o for o, _ in owners)}, got --objective {name}"
                + (f" ({name}: always {_shown(fixed)})" if fixed is not None else "")
            )
        given[setting_name] = value
    return given


def make_objective(args: argparse.Namespace) -> Any:
    """The objective ``--objective`` names, with the settings given."""
    return get_objective(args.objective, **objective_settings_given(args))


def pair_encoder_for(encoder: Any, objective: Any) -> Any:
    """The second encoder of an objective that needs one (CLIP on one open_clip tower: the other tower)."""
    if objective.needs_pair_encoder and hasattr(encoder, "with_tower"):
        return encoder.with_tower("text" if encoder.modality == "image" else "image")
    return None


def command_prober(
    args: argparse.Namespace,
    encoder: Any,
    objective: Any,
    pairs: Any,
    config: Any,
    *,
    saved: Path | None = None,
    kind: Any = None,
) -> Any:
    """The Prober a command runs: over the directions saved in ``saved`` (``Prober.load``, which checks them
    against these inputs), or over directions computed from ``pairs``; with the pair encoder the objective
    needs (``kind``: the objective to ask when ``objective`` is None, the saved one), the model's name and
    the progress bars as the command line says."""
    from normfast.engine.prober import Prober

    inputs = dict(
        pair_encoder=pair_encoder_for(encoder, objective if kind is None else kind),
        model_name=args.model,
        progress=not args.no_progress,
    )
    if saved is not None:
        return Prober.load(saved, encoder, objective, pairs, config, **inputs)
    return Prober(encoder, objective, pairs, config, **inputs)


def computed_prober(args: argparse.Namespace, settings: argparse.Namespace, **config_fields: Any) -> Any:
    """The Prober over directions computed now from ``--pairs`` (``normfast directions``, ``normfast serve``
    without saved ones): the objective, the pair source and the direction settings, read from ``settings``
    (``args``, or ``args`` with the defaults filled in) plus ``config_fields``, checked once before the model
    loads."""
    from normfast.engine.config import ProbeConfig

    objective = make_objective(settings)
    pairs = read_pairs_file(Path(args.pairs), settings, objective.needs)
    config = ProbeConfig(**direction_settings(settings), **config_fields).resolve()  # checked once, here
    encoder = load_model(args, args.device)
    return command_prober(args, encoder, objective, pairs, config)


# ---------------------------------------------------------------------------------------------
# the settings of the directions, and those that act per item

#: dest -> (flag, argparse keywords, help with {default}, the default in words)
DIRECTION_OPTIONS: dict[str, tuple[str, dict[str, Any], str, str | None]] = {
    "params": (
        "--params",
        {},
        "probed parameters: all, head, last (the last transformer layer), or a regex over parameter names ({default})",
        "default: all",
    ),
    "batches": ("--batches", {"type": int}, "M, virtual batches of the heat (>= 2; {default})", "default 16"),
    "drift_batches": (
        "--drift-batches",
        {"type": int},
        "M_D, virtual batches of the drift, taken from their mean update direction (one more directional pass "
        "per batch group; >= M; {default}); 0: the drift from the M heat batches, per batch",
        f"default {DEFAULT_DRIFT_BATCHES}",
    ),
    "heat_sampling": (
        "--heat-sampling",
        {"choices": list(HEAT_SAMPLING)},
        "how the heat's M batches are chosen: energy (drawn from the M_D drift batches by their gradient "
        "energy and weighted, so that a few rare high-energy batches cannot move the heat's level between seeds) "
        "or uniform (the first M, unweighted: the plain estimator); {default}",
        "default energy",
    ),
    "groups": (
        "--groups",
        {"type": int},
        "K, batch groups behind every error bar (se_D, sign stability, se_V2, se_Q, R_eq intervals; t with "
        "K-1 dof; {default})",
        f"default {DEFAULT_GROUPS}",
    ),
    "batch_size": (
        "--batch-size",
        {"type": int},
        "pairs (or items) per virtual batch, at most as many as the source holds ({default})",
        "default 32",
    ),
    "optimizer": (
        "--optimizer",
        {"choices": list(PRESETS)},
        "optimizer preset of the law: sgd (the scale-invariant branch) or adamw (the scale-free branch, a "
        "heuristic; {default})",
        "default sgd",
    ),
    "no_decay": ("--no-decay", {}, "regex of probed parameters without weight decay", None),
    "seed": ("--seed", {"type": int}, "seed of the virtual batches and of dropout ({default})", "default 0"),
}

PER_ITEM_OPTIONS: dict[str, tuple[str, dict[str, Any], str, str | None]] = {
    "lr": ("--lr", {"type": float}, "learning rate eta of the law ({default})", "default 1e-3"),
    "wd": ("--wd", {"type": float}, "decoupled weight decay lambda ({default})", "default 1e-2"),
    "momentum": ("--momentum", {"type": float}, "SGD momentum (heuristic eta/(1-beta))", None),
    "memory_budget_mb": (
        "--memory-budget-mb",
        {"type": float},
        "working memory for the directions and the passes, in MB ({default}): directions that do not fit "
        "together are computed (and read) in groups (directions-outer loop order)",
        "default 2048",
    ),
}

#: option (dest) -> the ProbeConfig field it sets, where the names differ
CONFIG_FIELD = {"wd": "weight_decay"}


def direction_arguments(
    p: argparse.ArgumentParser,
    only: Sequence[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    notes: Mapping[str, str] | None = None,
) -> None:
    """The settings the directions depend on (``only`` those named; a command's own ``defaults``, and
    ``notes`` that replace the default's words). Left out, an option is None: the config's default."""
    _add(p, DIRECTION_OPTIONS, only, defaults, notes)


def per_item_arguments(
    p: argparse.ArgumentParser,
    only: Sequence[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    notes: Mapping[str, str] | None = None,
) -> None:
    """The settings that act per item (the law's lr, wd and momentum) and the memory budget."""
    _add(p, PER_ITEM_OPTIONS, only, defaults, notes)


def output_arguments(p: argparse.ArgumentParser, default: str | None, tokens_help: str, pooled_help: str) -> None:
    """``--tokens`` / ``--pooled``: one row per token position or per input."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tokens", dest="output", action="store_const", const="tokens", help=tokens_help)
    g.add_argument("--pooled", dest="output", action="store_const", const="pooled", help=pooled_help)
    p.set_defaults(output=default)


def direction_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~normfast.engine.config.ProbeConfig` fields the direction and per-item options give
    (those left out keep the config's, or a recipe's, defaults; ``--drift-batches 0``: None)."""
    out = {}
    for dest in (*DIRECTION_OPTIONS, *PER_ITEM_OPTIONS):
        value = getattr(args, dest, None)
        if value is not None:
            out[CONFIG_FIELD.get(dest, dest)] = value
    if "drift_batches" in out:
        out["drift_batches"] = out["drift_batches"] or None
    return out
