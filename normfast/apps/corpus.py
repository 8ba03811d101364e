"""The corpus recipe: every token of a corpus probed in its context, per type one call away.

:func:`probe_corpus` is the one place the recipe lives; ``normfast probe MODEL --corpus FILE``
calls it with the command line's settings. The recipe:

* **windows** -- each document is tokenized whole and cut into windows of the model's maximum
  length at word boundaries (:class:`normfast.data.corpus.CorpusWindows`), every token a row;
* **virtual batches** -- SimCSE (dropout views) on the corpus's own *sentences* (NLTK Punkt
  trained on the corpus itself, :func:`normfast.data.corpus.split_sentences`), not on the
  windows: a corpus of six documents has six windows but thirty sentences, and a batch of whole
  windows has almost nothing to tell apart;
* **temperature 0.1** -- at SimCSE's usual 0.05, distinct sentences are told apart so easily
  that the virtual loss is 3e-5 of its chance level and the run is "objective saturated" (the
  regime check): no task is left for the batches to push on. 0.1 gives 3e-3 to 6e-3 of chance on
  the two corpora measured (``python -m bench run corpus_recipe``; the docs' Concepts page);
* **the last transformer layer** (``encoder.layer.{L-1}.``), **M = 16** heat batches of **32**
  sentences (fewer when the corpus has fewer than 32: half of them, said in a warning) and the
  **per-batch drift** of those 16 batches (``drift_batches=None``): the heat and the norm are
  the job's targets, and neither depends on the drift estimator, while 1024 drift batches would
  multiply the cost of the directions by 64; every parameter instead of the last layer costs
  about twice the CPU time and memory (``python -m bench run corpus_recipe``);
* 8 windows per streamed chunk.

Every setting can be changed (``**settings`` are :class:`~normfast.engine.config.ProbeConfig`
fields); the result is a :class:`~normfast.engine.result.ProbeResult` whose per-type table is
``result.types("word")`` (or ``"token"``), as ``normfast aggregate RUN --by word`` writes it.

The module imports the engine only when called, so the command line's ``--help`` stays fast.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any, Iterable, Mapping

if TYPE_CHECKING:
    from normfast.engine.result import ProbeResult

__all__ = [
    "CORPUS_BATCHES",
    "CORPUS_BATCH_SIZE",
    "CORPUS_CHUNK",
    "CORPUS_OBJECTIVE",
    "CORPUS_TEMPERATURE",
    "corpus_objective",
    "corpus_sentences",
    "last_layer",
    "objectives_of_items",
    "probe_corpus",
]

#: the recipe's objective, by name, and its temperature (the recipe's own, not the objective's default)
CORPUS_OBJECTIVE = "simcse"
CORPUS_TEMPERATURE = 0.1
CORPUS_BATCH_SIZE = 32
CORPUS_BATCHES = 16
CORPUS_CHUNK = 8
SENTENCES = "sentences of the corpus"


def last_layer(encoder: Any) -> str:
    """The regular expression of the encoder's last transformer layer (``encoder\\.layer\\.5\\.`` for
    all-MiniLM-L6-v2), from its trainable parameters' names; ``ValueError`` naming ``params=`` when it has none."""
    from normfast.engine.directions.parameters import last_layer_pattern

    return last_layer_pattern([n for n, p in encoder.named_parameters() if p.requires_grad], "probe_corpus")


def objectives_of_items() -> list[str]:
    """The registered objectives that draw their batches from items alone (the corpus's sentences)."""
    from normfast.engine.directions.objectives import objective_classes

    return [name for name, cls in objective_classes().items() if cls.needs == "items"]


def corpus_objective(objective: Any = CORPUS_OBJECTIVE, temperature: float | None = None, **options: Any) -> Any:
    """The recipe's objective: a name becomes that objective; the recipe's own objective
    (:data:`CORPUS_OBJECTIVE`) at the recipe's temperature 0.1 unless ``temperature`` is given; an
    objective object is returned as it is (then no ``temperature``)."""
    from normfast.engine.directions.objectives import get_objective, objective_class

    if not isinstance(objective, str):
        if temperature is not None or options:
            raise ValueError(
                f"probe_corpus: temperature= applies to an objective given by name; set it on {objective!r}"
            )
        return objective
    if temperature is None and objective_class(objective) is objective_class(CORPUS_OBJECTIVE):
        temperature = CORPUS_TEMPERATURE
    return get_objective(objective, **options, **({} if temperature is None else {"temperature": temperature}))


def corpus_sentences(documents: Iterable[Any]) -> list[str]:
    """The corpus's sentences, the recipe's SimCSE items (Punkt trained on the documents themselves)."""
    from normfast.data.corpus import as_documents, split_sentences

    return split_sentences([d.text for d in as_documents(documents)])


def _documents(documents: Any, layout: str, text_key: str, id_key: str) -> list[Any]:
    from normfast.data.corpus import as_documents, read_documents

    if isinstance(documents, (str, os.PathLike)):
        return read_documents(documents, layout=layout, text_key=text_key, id_key=id_key)
    return as_documents(documents)


def probe_corpus(
    encoder: Any,
    documents: Any,
    objective: Any = CORPUS_OBJECTIVE,
    pairs: Any = None,
    *,
    temperature: float | None = None,
    config: Any = None,
    out: str | os.PathLike | None = None,
    resume: bool = False,
    overwrite: bool = False,
    window: int | None = None,
    stride: int | None = None,
    layout: str = "lines",
    text_key: str = "text",
    id_key: str = "id",
    load_options: Mapping[str, Any] | None = None,
    pair_encoder: Any = None,
    model_name: str | None = None,
    progress: bool = True,
    **settings: Any,
) -> ProbeResult:
    """Probe every token of a corpus in its context with the corpus recipe (module docstring).

    Args:
        encoder: an :class:`~normfast.encoders.Encoder`, an ``nn.Module``, or a name for
            :func:`~normfast.encoders.load_encoder` (loaded with ``load_options`` after every
            setting has been checked).
        documents: a corpus file (``.txt``: one document per line, or blank-line separated with
            ``layout="blank"``; ``.jsonl`` with ``text_key`` / ``id_key``), or documents as
            strings, ``(id, text)`` tuples or :class:`~normfast.data.corpus.Document` s.
        objective: ``"simcse"`` (default, at ``temperature`` 0.1 unless given) or any objective;
            one that needs pairs or labels needs ``pairs=``.
        pairs: the virtual-batch source; default (SimCSE) the corpus's sentences.
        temperature: the objective's temperature when ``objective`` is a name.
        config: a whole :class:`~normfast.engine.config.ProbeConfig` instead of the recipe's;
            or change single settings with ``**settings`` (``batches=``, ``batch_size=``,
            ``params=``, ``drift_batches=``, ``lr=``, ...).
        out, resume, overwrite, pair_encoder, model_name, progress: as for :func:`normfast.probe`.
        window, stride: the windows' length and step in content tokens (default: the model's
            maximum length, no overlap).

    Returns:
        The run's :class:`~normfast.engine.result.ProbeResult` (token rows with ``doc_id``,
        ``word`` and the other corpus columns); ``result.types("word")`` is the per-word table.

    Raises:
        ValueError: before the model is loaded, for a batch larger than the corpus's sentences
            (naming ``batch_size=``), settings that are not ProbeConfig fields, or both
            ``config`` and ``**settings``.
    """
    from dataclasses import fields

    from normfast.data.pairs import PairSource, as_pair_source, check_batch_size
    from normfast.engine.config import ProbeConfig

    fn = "probe_corpus"
    known = {f.name for f in fields(ProbeConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(f"{fn}: {unknown} are not ProbeConfig settings; the settings are {sorted(known)}")
    if config is not None and settings:
        raise ValueError(f"{fn}: pass config= or single settings ({sorted(settings)}), not both")
    if config is not None and config.output != "tokens":
        raise ValueError(f"{fn}: a corpus is probed token by token; got config.output={config.output!r}")
    if settings.get("output", "tokens") != "tokens":
        raise ValueError(f"{fn}: a corpus is probed token by token; got output={settings['output']!r}")
    docs = _documents(documents, layout, text_key, id_key)
    objective = corpus_objective(objective, temperature)
    if pairs is None:
        if objective.needs != "items":
            raise ValueError(
                f"{fn}: objective {objective.name!r} needs {objective.needs} (pairs=, CLI --pairs); only an "
                f"objective of items ({', '.join(objectives_of_items())}) can use the corpus's own sentences"
            )
        source = PairSource.from_iterable(corpus_sentences(docs), kind="items")
        source.what = SENTENCES
    else:
        source = as_pair_source(pairs, objective, [])
    if config is None:
        batch_size = settings.pop("batch_size", None)
        if batch_size is None:
            batch_size = CORPUS_BATCH_SIZE
            if len(source) < batch_size:
                batch_size = max(2, len(source) // 2)
                warnings.warn(
                    f"probe_corpus: the virtual batches' source holds {len(source)} {source.what}, fewer than the "
                    f"default batch size {CORPUS_BATCH_SIZE}; batches of {batch_size} (half of them, so that "
                    f"the batches differ) -- set batch_size= (CLI --batch-size) to choose",
                    UserWarning,
                    stacklevel=2,
                )
        recipe = {
            "output": "tokens",
            "batches": CORPUS_BATCHES,
            "drift_batches": None,
            "chunk_size": CORPUS_CHUNK,
            "batch_size": batch_size,
        }
        config = ProbeConfig(**{**recipe, **settings, "params": settings.get("params", "last")})
    plan = config.resolve()  # checked once, before the model loads: the engine takes the plan as it is
    if plan.batch_indices is None:
        check_batch_size(fn, config.batch_size, source)
    encoder = _loaded(encoder, load_options)
    if config.params == "last":
        plan = plan.derived(params=last_layer(encoder))
    from normfast.data.corpus import CorpusWindows
    from normfast.engine.probe import probe

    windows = CorpusWindows.from_encoder(docs, encoder, window=window, stride=stride, progress=progress)
    return probe(
        encoder,
        windows,
        objective,
        source,
        plan,
        out=out,
        resume=resume,
        overwrite=overwrite,
        pair_encoder=pair_encoder,
        progress=progress,
        model_name=model_name,
    )


def _loaded(encoder: Any, options: Mapping[str, Any] | None) -> Any:
    from normfast.encoders import Encoder, load_encoder

    if isinstance(encoder, Encoder) and not options:
        return encoder
    return load_encoder(encoder, **dict(options or {}))
