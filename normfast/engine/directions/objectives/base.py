"""What an objective declares, and the registry of objectives by name.

An objective carries every fact the rest of the code needs about it, as class attributes: its
settings (:class:`Setting`: keyword, type, default, help; the command line offers each as
``--NAME``), what a virtual batch holds (``needs``), its chance level as a function of the
batch size (:class:`Chance`, or none) and what "saturated" means for it, whether a second
encoder encodes its positives, and how it makes a batch from items alone. The command line's
choices and flags, the objective's health, the run metadata, the messages and the docs' table
read these declarations; nothing branches on an objective's name.

Nothing here imports torch: ``normfast probe --help`` reads the registry (a loss imports its
math from :mod:`.functional` when it runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

NEEDS = ("pairs", "labels", "items")

#: The loss-to-chance ratio below which a softmax contrastive loss is saturated (its gradient, and
#: with it drift and heat, shrinks with the loss): between the cases measured on all-MiniLM-L6-v2
#: (last layer, SimCSE at temperature 0.05, 16 batches; ``python -m bench run corpus_recipe``):
#: distinct sentences give 3.1e-5 to 6.6e-5 of chance (median gradient norm 1e-3 to 3e-3), common
#: words 1.4e-3 (median gradient norm 0.07, where the heat is 10⁴ times larger); see
#: :mod:`normfast.engine.diagnostics.health`.
SATURATED_BELOW = 3e-4


@dataclass(frozen=True)
class Setting:
    """One setting of an objective: its keyword (and attribute), default and help.

    The command line offers it as ``--NAME`` (underscores as dashes), one flag for every
    objective that declares a setting of that name; a ``bool`` setting is an off-by-default
    switch there. ``minimum`` (excluded when ``strictly``) bounds a number.
    """

    name: str
    default: Any
    help: str
    type: type = float
    minimum: float | None = None
    strictly: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, owner: str, value: Any) -> Any:
        """``value`` as this setting's type; ``TypeError`` / ``ValueError`` naming ``owner`` and the setting."""
        if self.type is bool:
            if value not in (True, False):
                raise TypeError(f"{owner}: expected {self.name} to be True or False, got {value!r}")
            return bool(value)
        if self.type is str:
            if not isinstance(value, str):
                raise TypeError(f"{owner}: expected {self.name} to be a string, got {value!r}")
            return value
        from normfast.core.checks import check_finite_scalar

        number = check_finite_scalar(owner, self.name, value, minimum=self.minimum, strictly=self.strictly)
        if self.type is int:
            if number != int(number):
                raise ValueError(f"{owner}: expected {self.name} to be an integer, got {value!r}")
            return int(number)
        return number


def temperature(default: float) -> Setting:
    """The softmax temperature of a contrastive loss over cosine logits (one meaning, one flag)."""
    return Setting(
        "temperature",
        default,
        "softmax temperature of the cosine logits; a higher one lifts a saturated objective, whose loss is near 0",
        minimum=0.0,
        strictly=True,
    )


@dataclass(frozen=True)
class Chance:
    """A loss's chance level: its value for a uniform guess, as a function of the batch size ``B``."""

    formula: str  # with B for the batch size, e.g. "log B"
    level: Callable[[int], float]

    def at(self, batch_size: int) -> float | None:
        return float(self.level(batch_size)) if batch_size and batch_size > 1 else None

    def text(self, batch_size: int) -> str:
        return self.formula.replace("B", str(batch_size))


#: softmax cross-entropy over the B candidates of a batch
LOG_B = Chance("log B", lambda b: math.log(b))


class Objective:
    """Base class of virtual objectives: what an objective declares, and a constructor from it.

    Subclasses set the attributes below and implement :meth:`loss`; a loss must be invariant to
    rescaling each embedding row by a positive factor (normalize first; the engine checks with
    :func:`~normfast.engine.directions.objectives.check_scale_invariance`). The constructor takes
    the declared settings, by keyword or in their order, and keeps each as an attribute.

    Attributes:
        name: the objective's key in the registry and in run metadata (lower case).
        summary: what its virtual batches hold, in a few words (``--objective``'s help, the docs).
        needs: what a virtual batch holds: ``"pairs"``, ``"labels"`` or ``"items"``.
        uses_dropout: run the batch forward in train mode (dropout active).
        views: for ``needs="items"``, how a batch of items becomes two views (messages).
        needs_pair_encoder: a second encoder encodes the positives (CLIP on image-text pairs: the
            other tower of an open_clip model); the command line builds it.
        declared_settings: every setting that changes the loss (:class:`Setting`).
        fixed_settings: settings the loss has but that cannot change, recorded with the others
            (CLIP is always symmetric).
        chance: the loss's chance level (:class:`Chance`), None when it has none.
        saturated_below: the loss-to-chance ratio below which a run's objective is saturated;
            None (or no chance level): never saturated by that rule. Override
            :meth:`is_saturated` (and set ``saturation``) for a rule of its own.
        saturation: what "saturated" means for it, in words, when :meth:`is_saturated` is its own.
    """

    name: str = "objective"
    summary: str = ""
    needs: str = "pairs"
    uses_dropout: bool = False
    views: str = ""
    needs_pair_encoder: bool = False
    declared_settings: tuple[Setting, ...] = ()
    fixed_settings: Mapping[str, Any] = {}
    chance: Chance | None = None
    saturated_below: float | None = None
    saturation: str | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        declared = {s.name: s for s in self.declared_settings}
        owner = type(self).__name__
        if len(args) > len(declared):
            raise TypeError(f"{owner}: takes at most {len(declared)} settings ({', '.join(declared)}), got {args}")
        for setting, value in zip(self.declared_settings, args):
            if setting.name in kwargs:
                raise TypeError(f"{owner}: got {setting.name} twice")
            kwargs[setting.name] = value
        unknown = sorted(set(kwargs) - set(declared))
        if unknown:
            have = ", ".join(declared) or "none"
            raise TypeError(f"{owner}: unexpected setting(s) {unknown}; its settings are: {have}")
        for setting in self.declared_settings:
            setattr(self, setting.name, setting.check(owner, kwargs.get(setting.name, setting.default)))

    def loss(self, za: Any, zb: Any = None, labels: Any = None) -> Any:
        """Scalar loss of one virtual batch."""
        raise NotImplementedError

    def __call__(self, za: Any, zb: Any = None, labels: Any = None) -> Any:
        return self.loss(za, zb, labels)

    def settings(self) -> dict[str, Any]:
        """Every setting that changes the loss (run metadata, summary header): the declared ones, then the fixed."""
        return {**{s.name: getattr(self, s.name) for s in self.declared_settings}, **self.fixed_settings}

    def chance_level(self, batch_size: int) -> float | None:
        """The loss of a uniform guess at this batch size, None when the loss has no chance level."""
        return None if self.chance is None else self.chance.at(batch_size)

    def is_saturated(self, loss_mean: float, batch_size: int) -> bool:
        """Whether a run's mean loss leaves the virtual batches no task: by default the loss-to-chance
        rule (``loss_mean / chance < saturated_below``); never without a chance level or a threshold."""
        chance = self.chance_level(batch_size)
        if not chance or self.saturated_below is None or not math.isfinite(loss_mean):
            return False
        return loss_mean / chance < self.saturated_below

    @classmethod
    def saturation_text(cls) -> str:
        """What "saturated" means for this objective, in words (the health line, the docs' table)."""
        if cls.saturation:
            return cls.saturation
        if cls.chance is None or cls.saturated_below is None:
            return "never by the loss-to-chance rule (the loss has no chance level)"
        return f"loss / chance < {cls.saturated_below:.0e}"

    def batch_source(self, items: str) -> str:
        """The pair source in words when the items themselves are it (``needs="items"``), for messages."""
        how = f": {self.views}" if self.views else ""
        return f"{items} ({self.name} draws its batches from them{how})"

    def __repr__(self) -> str:
        inner = ", ".join(f"{s.name}={getattr(self, s.name, s.default)}" for s in self.declared_settings)
        return f"{type(self).__name__}({inner})"


# ---------------------------------------------------------------------------------------------
# the registry: the one list of objectives (names -> classes), in the order they were registered

_REGISTRY: dict[str, type[Objective]] = {}


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def register(cls: type[Objective]) -> type[Objective]:
    """Add an objective class under its ``name`` (a module registers its objective when imported);
    returns the class, so it also works as a decorator. Checks the declarations first."""
    fn = "register"
    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        raise TypeError(f"{fn}: expected a subclass of Objective, got {cls!r}")
    name = cls.name
    if not isinstance(name, str) or not name or _key(name) != name:
        raise ValueError(f"{fn}: {cls.__name__}.name must be a lower-case key without - or _, got {name!r}")
    if cls.needs not in NEEDS:
        raise ValueError(f"{fn}: {cls.__name__}.needs must be one of {NEEDS}, got {cls.needs!r}")
    if not cls.summary:
        raise ValueError(f"{fn}: {cls.__name__}.summary is empty (the command line's help shows it)")
    if cls.chance is not None and not isinstance(cls.chance, Chance):
        raise TypeError(f"{fn}: {cls.__name__}.chance must be a Chance or None, got {cls.chance!r}")
    names = [s.name for s in cls.declared_settings]
    if len(set(names)) != len(names) or not all(isinstance(s, Setting) for s in cls.declared_settings):
        raise ValueError(f"{fn}: {cls.__name__}.declared_settings must be distinct Settings, got {names}")
    for other in _REGISTRY.values():
        for mine in cls.declared_settings:
            theirs = next((s for s in other.declared_settings if s.name == mine.name), None)
            if other.name != name and theirs is not None and theirs.type is not mine.type:
                raise ValueError(
                    f"{fn}: {cls.__name__}.{mine.name} is a {mine.type.__name__}, {other.__name__}'s a "
                    f"{theirs.type.__name__}: one command-line flag serves both; rename one"
                )
    known = _REGISTRY.get(name)
    if known is not None and known is not cls:
        raise ValueError(f"{fn}: an objective named {name!r} is already registered ({known.__module__})")
    _REGISTRY[name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove an objective from the registry (a test's temporary objective)."""
    _REGISTRY.pop(_key(name), None)


def objective_classes() -> dict[str, type[Objective]]:
    """Every registered objective, name -> class, in the order of registration."""
    return dict(_REGISTRY)


def objective_class(name: str) -> type[Objective]:
    """The class registered under ``name`` (case, ``-`` and ``_`` ignored)."""
    if not isinstance(name, str):
        raise TypeError(f"get_objective: expected a name or an Objective, got {type(name).__name__}")
    try:
        return _REGISTRY[_key(name)]
    except KeyError:
        raise ValueError(f"get_objective: unknown objective {name!r}; expected one of {sorted(_REGISTRY)}") from None


def get_objective(name: str | Objective, *args: Any, **kwargs: Any) -> Objective:
    """Objective by name (the registry: ``"simcse"``, ``"infonce"``, ``"clip"``, ``"supcon"``, ...).

    Case, ``-`` and ``_`` are ignored. Settings go to the constructor (``temperature``,
    ``symmetric``, ...: the class's ``declared_settings``). An :class:`Objective` instance is
    returned as is.
    """
    if isinstance(name, Objective):
        if args or kwargs:
            raise ValueError(f"get_objective: got an Objective instance and constructor arguments {sorted(kwargs)}")
        return name
    return objective_class(name)(*args, **kwargs)


def objective_settings(objective: Any) -> dict[str, Any]:
    """The settings of any objective: :meth:`Objective.settings`; of a loss that is no
    :class:`Objective`, its temperature if it has one."""
    if isinstance(objective, Objective):
        return dict(objective.settings())
    t = getattr(objective, "temperature", None)
    return {} if t is None else {"temperature": t}
