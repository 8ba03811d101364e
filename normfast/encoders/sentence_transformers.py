"""sentence-transformers folders (Transformer + Pooling + Dense; the Normalize module is skipped)."""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch
from torch import nn

from normfast.core.checks import first_line

from .hf import HFEncoder
from .hf_files import ModelFiles, activation_from_name, legacy_pooling, load_transformers, uses_pooler
from .pooling import DenseLayer, L2Normalize


class SentenceTransformerEncoder(HFEncoder):
    """A sentence-transformers model (local folder or hub id), read without the
    sentence-transformers package.

    ``modules.json`` is followed in order:

    * ``Transformer`` -- the transformers model and tokenizer of its folder, loaded
      through the Auto classes (fp32, eager attention, safetensors preferred,
      no remote code unless ``trust_remote_code``); ``max_seq_length`` and
      ``do_lower_case`` from its ``sentence_bert_config.json``.
    * ``Pooling`` -- the mode from its ``config.json`` (``mean``, ``cls``,
      ``max``, ``mean_sqrt_len_tokens``, ``weightedmean``, ``lasttoken``, or
      several, concatenated).
    * ``Dense`` -- a :class:`DenseLayer` with weights from ``model.safetensors``
      (or ``pytorch_model.bin``, read with ``weights_only=True``) and the
      activation named in its config (only ``torch`` classes unless
      ``trust_remote_code``). A final Dense with identity activation is the
      :meth:`head`.
    * ``Normalize`` -- dropped when it is last: the probe needs the raw,
      unnormalized embedding (sentence-transformers' ``encode`` output is this
      encoder's pooled output divided by its norm). One that sits between
      modules is kept (:class:`L2Normalize`).

    Any other module type raises ``ValueError``. The dense head follows the
    pooling, so head mode is exact for every pooling mode including ``max``; the
    token-level embeddings apply the dense layers per position.

    Args:
        source: folder or hub id.
        pooling: override the folder's pooling mode.
        projection: False drops the Dense/Normalize modules after the pooling
            (probe the raw pooled transformer output).
        device: where to put the model.
        trust_remote_code: allow model code and activation classes from outside
            torch/transformers.
        staged: see :class:`HFEncoder`.
    """

    def __init__(
        self,
        source: str | os.PathLike,
        *,
        pooling: str | Sequence[str] | None = None,
        projection: bool = True,
        device: str | torch.device = "cpu",
        trust_remote_code: bool = False,
        staged: bool | str = "auto",
    ):
        fn = "SentenceTransformerEncoder"
        source = os.fspath(source)
        files = ModelFiles(source)
        modules = files.json("modules.json")
        if modules is None:
            raise ValueError(f"{fn}: {source!r} has no modules.json, so it is not a sentence-transformers model")
        if not isinstance(modules, list) or not modules:
            raise ValueError(f"{fn}: {source!r}: modules.json must be a non-empty list of modules")
        entries = sorted(modules, key=lambda m: m.get("idx", 0))
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in entries]
        supported = ("Transformer", "Pooling", "Dense", "Normalize")
        for kind, entry in zip(kinds, entries):
            if kind not in supported:
                raise ValueError(
                    f"{fn}: {source!r}: module type {entry.get('type')!r} is not "
                    f"supported (supported: {', '.join(supported)})"
                )
        if len(kinds) < 2 or kinds[0] != "Transformer" or kinds.count("Transformer") != 1:
            raise ValueError(f"{fn}: {source!r}: expected exactly one Transformer module, first; got {kinds}")
        if kinds.count("Pooling") != 1 or kinds[1] != "Pooling":
            raise ValueError(
                f"{fn}: {source!r}: expected one Pooling module right after the "
                "Transformer (modules on token embeddings are not supported); "
                f"got {kinds}"
            )

        # Pooling (read first: a model saved without its pooler is refused only when the pooling uses it)
        pooling_path = str(entries[kinds.index("Pooling")].get("path", ""))
        pooling_config = files.json(f"{pooling_path}/config.json") if pooling_path else None
        folder_modes = legacy_pooling(pooling_config or {}) or ("mean",)
        modes = folder_modes if pooling is None else pooling

        # Transformer
        subfolder = str(entries[0].get("path", "") or "")
        bert_config = (
            files.json(f"{subfolder}/sentence_bert_config.json" if subfolder else "sentence_bert_config.json") or {}
        )
        name_or_path, extra = files.model_location(subfolder)
        model, tokenizer = load_transformers(name_or_path, extra, trust_remote_code, uses_pooler=uses_pooler(modes))

        # Dense / Normalize after the pooling; a trailing Normalize is dropped
        tail = list(zip(kinds, entries))[kinds.index("Pooling") + 1 :]
        skipped = []
        while tail and tail[-1][0] == "Normalize":
            skipped.append(tail.pop()[1].get("type"))
        dense: list[nn.Module] = []
        for kind, entry in tail:
            if not projection:
                skipped.append(entry.get("type"))
            elif kind == "Normalize":
                dense.append(L2Normalize())
            else:
                path = str(entry.get("path", ""))
                dense.append(type(self)._load_dense(fn, files, path, trust_remote_code))

        super().__init__(
            model,
            tokenizer,
            pooling=modes,
            dense=dense,
            max_length=bert_config.get("max_seq_length"),
            lowercase=bool(bert_config.get("do_lower_case", False)),
            staged=staged,
        )
        self.name = source
        self.source = source
        self.folder_pooling = folder_modes
        #: whether the Dense (and inner Normalize) modules after the pooling run (projection=True)
        self.projection = bool(projection)
        #: module types from modules.json that this encoder does not run
        self.skipped_modules = skipped
        self.to(device)

    def settings(self) -> dict[str, Any]:
        """:meth:`HFEncoder.settings` plus the projection choice and the modules.json modules not run."""
        return {**super().settings(), "projection": self.projection, "skipped_modules": list(self.skipped_modules)}

    @staticmethod
    def _load_dense(fn: str, files: ModelFiles, path: str, trust_remote_code: bool) -> DenseLayer:
        config = files.json(f"{path}/config.json")
        if config is None:
            raise ValueError(f"{fn}: {files.source!r}: Dense module {path!r} has no config.json")
        source = config.get("module_input_name", "sentence_embedding")
        if source != "sentence_embedding":
            raise ValueError(
                f"{fn}: {files.source!r}: Dense module {path!r} reads {source!r}; "
                "only Dense layers on the sentence embedding are supported"
            )
        try:
            activation = activation_from_name(fn, config.get("activation_function"), trust_remote_code)
            layer = DenseLayer(
                config["in_features"],
                config["out_features"],
                bias=config.get("bias", True),
                activation=activation,
                use_residual=config.get("use_residual", False),
            )
        except KeyError as exc:
            raise ValueError(f"{fn}: {files.source!r}: Dense config {path}/config.json lacks {exc}") from None
        weights_path = files.path(f"{path}/model.safetensors")
        try:
            if weights_path is not None:
                from safetensors.torch import load_file

                state = load_file(weights_path)
            else:
                weights_path = files.path(f"{path}/pytorch_model.bin")
                if weights_path is None:
                    raise ValueError(
                        f"{fn}: {files.source!r}: Dense module {path!r} has neither "
                        "model.safetensors nor pytorch_model.bin"
                    )
                state = torch.load(weights_path, map_location="cpu", weights_only=True)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged weights file, named in one line
            raise ValueError(
                f"{fn}: cannot read the Dense weights {weights_path}: {first_line(exc)}. The file is damaged "
                f"or incomplete: copy the model folder again from its source"
            ) from exc
        try:
            layer.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise ValueError(
                f"{fn}: {files.source!r}: Dense weights in {path!r} do not fit its config: {exc}"
            ) from None
        return layer


def is_sentence_transformer(obj: object) -> bool:
    """Whether ``obj`` is a live ``sentence_transformers.SentenceTransformer`` (without importing the package)."""
    return any(
        cls.__name__ == "SentenceTransformer" and cls.__module__.startswith("sentence_transformers")
        for cls in type(obj).__mro__
    )


def wrap_sentence_transformer(model: nn.Module, *, staged: bool | str = "auto") -> HFEncoder:
    """An :class:`HFEncoder` over a live ``SentenceTransformer``'s own modules (shared, not copied), so that
    it sees the model as it trains: Transformer, Pooling, then Dense / Normalize (a trailing Normalize is
    dropped, as for a folder). Wrapping switches the transformer to eager attention (forward-mode AD needs
    it; the same math as the fused kernels). ``ValueError`` for any other module layout."""
    fn = "load_encoder"
    modules = list(model)
    kinds = [type(m).__name__ for m in modules]
    if len(modules) < 2 or kinds[0] != "Transformer" or kinds[1] != "Pooling":
        raise ValueError(
            f"{fn}: a SentenceTransformer must start with a Transformer and a Pooling module to be wrapped, got {kinds}"
        )
    transformer, pooling = modules[0], modules[1]
    tokenizer = getattr(transformer, "tokenizer", None)
    modes = pooling.pooling_mode
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    tail = list(zip(kinds[2:], modules[2:]))
    while tail and tail[-1][0] == "Normalize":
        tail.pop()
    dense: list[nn.Module] = []
    for kind, module in tail:
        if kind == "Normalize":
            dense.append(L2Normalize())
        elif kind == "Dense" and getattr(module, "module_input_name", "sentence_embedding") == "sentence_embedding":
            layer = DenseLayer(
                module.in_features,
                module.out_features,
                bias=module.linear.bias is not None,
                activation=module.activation_function,
                use_residual=bool(getattr(module, "use_residual", False)),
            )
            layer.linear = module.linear  # the live parameters, not a copy
            if hasattr(module, "residual") and hasattr(layer, "residual"):
                layer.residual = module.residual
            dense.append(layer)
        else:
            raise ValueError(
                f"{fn}: SentenceTransformer module {kind} ({type(module).__module__}) is not supported "
                f"after the pooling (supported: Dense on the sentence embedding, Normalize)"
            )
    encoder = HFEncoder(
        transformer.auto_model,
        tokenizer,
        pooling=modes,
        dense=dense,
        max_length=getattr(transformer, "max_seq_length", None),
        lowercase=bool(getattr(transformer, "do_lower_case", False)),
        staged=staged,
    )
    encoder.name = str(getattr(transformer.auto_model.config, "_name_or_path", "") or type(model).__name__)
    return encoder
