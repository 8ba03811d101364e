"""Model files from a local folder or the hub, and what is built from them: a transformers model
and its tokenizer (refused, in one line, when the folder is damaged, lacks its tokenizer, or holds
weights that do not fit its config), a sentence-transformers ``Dense`` activation (torch classes
only, unless remote code is trusted) and its pooling settings."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import os
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from normfast.core.checks import first_line
from normfast.core.paths import inside_folder


class ModelFiles:
    """Files of a model: a local folder, or a hub repository read through the hub cache."""

    def __init__(self, source: str):
        self.source = source
        self.local = os.path.isdir(source)

    def path(self, relative: str) -> str | None:
        """Local path of ``relative`` (None when the model has no such file)."""
        if self.local:  # a module path from modules.json stays inside the model folder
            candidate = str(
                inside_folder(self.source, os.path.join(*relative.split("/")), f"the model folder {self.source}")
            )
            return candidate if os.path.isfile(candidate) else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return hf_hub_download(self.source, relative)
        except EntryNotFoundError:  # includes "not in the local cache" when offline
            return None

    def json(self, relative: str) -> dict | list | None:
        path = self.path(relative)
        if path is None:
            return None
        with open(path, encoding="utf-8") as fh:
            try:
                return json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{self.source}: {relative} is not valid JSON ({exc})") from None

    def model_location(self, subfolder: str) -> tuple[str, dict]:
        """``(name_or_path, extra from_pretrained kwargs)`` for a module stored in ``subfolder``."""
        if not subfolder:
            return self.source, {}
        if self.local:
            return str(inside_folder(self.source, subfolder, f"the modules.json of {self.source}")), {}
        return self.source, {"subfolder": subfolder}


def _dtype_kwarg() -> str:
    """Name of ``from_pretrained``'s dtype argument (``torch_dtype`` before transformers 4.56)."""
    import transformers

    parts = transformers.__version__.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return "dtype"
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


#: files that carry a tokenizer's vocabulary (at least one must be in a local model folder)
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
    "sentencepiece.model",
)


def load_transformers(
    name_or_path: str, extra: dict, trust_remote_code: bool, *, uses_pooler: bool = False
) -> tuple[nn.Module, Any]:
    """Model (fp32, eager attention, safetensors preferred) and tokenizer, via the Auto classes.

    A local folder without tokenizer files is refused (transformers would build a
    vocabulary of special tokens only and turn every word into ``[UNK]``), and so is a
    tokenizer far smaller than the model's embedding table. A damaged folder (broken
    ``config.json``, missing or truncated weights) raises one ``ValueError`` naming the
    folder, the file where it can, and the fix. So do weights that do not fit the config
    (:func:`check_loaded_weights`): the model is probed only as its weights define it.
    ``uses_pooler``: the encoder pools with the model's own pooler, which must then be in
    the weights too.
    """
    from transformers import AutoModel, AutoTokenizer

    fn = "load_encoder"
    local = os.path.isdir(name_or_path)
    if local and not any(os.path.isfile(os.path.join(name_or_path, f)) for f in TOKENIZER_FILES):
        raise ValueError(
            f"{fn}: the model folder {name_or_path} has no tokenizer files (none of "
            f"{', '.join(TOKENIZER_FILES)}); without them every word would become [UNK]. Save the "
            f"tokenizer beside the model: tokenizer.save_pretrained({name_or_path!r})"
        )
    try:
        with _without_load_report():  # judged below, in one line, instead of transformers' table
            model, info = AutoModel.from_pretrained(
                name_or_path,
                attn_implementation="eager",
                trust_remote_code=trust_remote_code,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported by check_loaded_weights, with the names
                **{_dtype_kwarg(): torch.float32},
                **extra,
            )
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **extra)
    except Exception as exc:  # noqa: BLE001 - the folder's files, named in one line
        if not local:
            raise
        raise ValueError(
            f"{fn}: cannot load the model in {name_or_path}: {_load_failure(name_or_path, exc)}. "
            f"Its files are damaged or incomplete: copy the model folder again from its "
            f"source"
        ) from exc
    where = os.path.join(name_or_path, extra["subfolder"]) if extra.get("subfolder") else name_or_path
    check_loaded_weights(fn, where, model, info, uses_pooler=uses_pooler)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and vocab >= 1000 and len(tokenizer) < vocab // 10:
        raise ValueError(
            f"{fn}: the tokenizer of {name_or_path} knows {len(tokenizer)} tokens, the model's "
            f"embedding table {vocab}: the tokenizer files do not belong to this model (or are "
            f"missing); save the model's own tokenizer beside it"
        )
    return model.eval(), tokenizer


def uses_pooler(pooling: str | Sequence[str] | None) -> bool:
    """Whether a pooling setting (a mode or a sequence of modes) pools with the model's own pooler."""
    return "pooler" in ((pooling,) if isinstance(pooling, str) else tuple(pooling or ()))


def check_loaded_weights(fn: str, where: str, model: nn.Module, info: dict, *, uses_pooler: bool = False) -> None:
    """Refuse a model whose weights do not fit its config (``info``: ``from_pretrained``'s loading info).

    transformers fills a tensor the weights lack with random values, drops a tensor the model has
    no place for, and (with ``ignore_mismatched_sizes``) replaces one of another shape by random
    values; a probe of that model would measure layers nobody trained. Legitimately absent, and
    accepted: the model's ``pooler`` when the encoder does not pool with it (a checkpoint saved
    without one), a tensor tied to one that was loaded, and the head of a task checkpoint (its
    ``config.json`` names another architecture, e.g. ``BertForMaskedLM``, whose head lies outside
    the base model). Everything else raises one ``ValueError`` naming the first few tensors and
    their count.
    """
    tensors = model.state_dict(keep_vars=True)
    missing = set(info.get("missing_keys") or ())
    loaded = {t.data_ptr() for k, t in tensors.items() if k not in missing and t.numel()}
    missing = [
        k
        for k in [k for k in tensors if k in missing] + sorted(missing - set(tensors))  # the model's order
        if not (k.startswith("pooler.") and not uses_pooler)
        and not (k in tensors and tensors[k].numel() and tensors[k].data_ptr() in loaded)  # tied to a loaded one
    ]
    architectures = getattr(model.config, "architectures", None) or []
    task_checkpoint = bool(architectures) and type(model).__name__ not in architectures
    children = {name for name, _ in model.named_children()}
    unused = sorted(
        k
        for k in info.get("unexpected_keys") or ()
        if not (task_checkpoint and k.split(".", 1)[0] not in children)  # a task head, not part of the model
    )
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: m[0])
    problems = []
    if missing:
        problems.append(f"{_count(missing)} the model needs are missing from them ({_first_few(missing)})")
    if unused:
        problems.append(f"{_count(unused)} in them fit nowhere in the model and would be unused ({_first_few(unused)})")
    if mismatched:
        shapes = [f"{k}: {tuple(a)} in the weights, {tuple(b)} in the model" for k, a, b in mismatched]
        problems.append(f"{_count(shapes)} of another shape than the model's ({_first_few(shapes)})")
    if problems:
        raise ValueError(
            f"{fn}: the weights of {where} do not fit its config.json: {'; '.join(problems)}. Loaded anyway, "
            f"the model would hold random values in place of what is missing and drop what is unused, so a "
            f"probe would not measure the saved model: its weights and config.json belong to different "
            f"models, or the weights are incomplete; copy the model folder again from its source"
        )


def _count(names: Sequence[str]) -> str:
    return f"{len(names)} tensor" + ("s" if len(names) != 1 else "")


def _first_few(names: Sequence[str], shown: int = 3) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)  # a report of failed conversions stays: the error that follows points to it
        return "LOAD REPORT" not in text or "CONVERSION" in text


@contextlib.contextmanager
def _without_load_report() -> Iterator[None]:
    """transformers' table of missing and unexpected tensors, withheld: load_transformers says what matters."""
    logger = logging.getLogger("transformers.modeling_utils")
    drop = _DropLoadReport()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _load_failure(folder: str, exc: BaseException) -> str:
    """What went wrong loading a local model folder, with the file named where the error does not."""
    text = first_line(exc).rstrip(".")
    if type(exc).__name__ == "SafetensorError":
        weights = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        return f"{', '.join(weights) or 'the weights'}: {text}"
    return text


def activation_from_name(fn: str, dotted: str | None, trust_remote_code: bool) -> nn.Module:
    if dotted is None:
        return nn.Tanh()  # sentence-transformers' default for Dense
    if not dotted.startswith("torch.") and not trust_remote_code:
        raise ValueError(f"{fn}: activation {dotted!r} is not a torch class; pass trust_remote_code=True to import it")
    module_name, _, attr = dotted.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{fn}: cannot import activation {dotted!r} ({exc})") from None
    if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
        raise ValueError(f"{fn}: activation {dotted!r} is not an nn.Module class")
    return cls()


def legacy_pooling(config: dict) -> tuple[str, ...]:
    flags = {
        "pooling_mode_cls_token": "cls",
        "pooling_mode_max_tokens": "max",
        "pooling_mode_mean_tokens": "mean",
        "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
        "pooling_mode_weightedmean_tokens": "weightedmean",
        "pooling_mode_lasttoken": "lasttoken",
    }
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        return (mode,) if isinstance(mode, str) else tuple(mode)
    return tuple(mode for key, mode in flags.items() if config.get(key))
