"""Stage views and forward-mode-AD helpers shared by the adapters."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

# ---------------------------------------------------------------------------
# forward-mode AD and stage views


_FORWARD_AD_READY = False


def _load_forward_ad_quietly() -> None:
    """Load torch's forward-AD decompositions once, without the deprecation warning they raise.

    On first use forward-mode AD registers decompositions through ``torch.jit.script``, which
    torch 2.9+ deprecates with a ``FutureWarning`` that users cannot act on. One tiny JVP under a
    filter for exactly that message loads them; every later JVP runs with the user's filters.
    """
    global _FORWARD_AD_READY
    if _FORWARD_AD_READY:
        return
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
        torch.func.jvp(torch.sin, (torch.zeros(1),), (torch.ones(1),))
    _FORWARD_AD_READY = True


@contextlib.contextmanager
def forward_ad_safe() -> Iterator[None]:
    """Context in which forward-mode AD (``torch.func.jvp``) works through attention.

    Selects the math backend of ``scaled_dot_product_attention`` and turns the
    ``nn.MultiheadAttention`` fast path off: the fused kernels behind both have
    no forward-mode derivative. The previous fast-path setting is restored on
    exit, also when the body raises.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _load_forward_ad_quietly()
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


def _resolve(root: nn.Module, dotted: str) -> torch.Tensor:
    # Plain attribute walk rather than get_parameter(): under functional_call the
    # parameters are temporarily plain tensors, which get_parameter rejects.
    obj: Any = root
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


class StageView(nn.Module):
    """The parameters of one stage, listed under their encoder-level names.

    Names are resolved on the encoder each time they are listed, so the view
    follows whatever tensors the encoder currently holds. The encoder is kept in
    a list so that the view does not adopt it as a child module.
    """

    def __init__(self, root: nn.Module, names: Sequence[str]):
        super().__init__()
        self._root = [root]
        self.parameter_names = list(names)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        root = self._root[0]
        for name in self.parameter_names:
            yield (f"{prefix}.{name}" if prefix else name), _resolve(root, name)

    def parameters(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        for _, p in self.named_parameters():
            yield p

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a stage view only lists parameters; run stages through Encoder.forward")

    def extra_repr(self) -> str:
        return f"{len(self.parameter_names)} parameters"


def stage_list(encoder: nn.Module, labels: Sequence[str], assign: Callable[[str], int]) -> list[tuple[str, nn.Module]]:
    """Group ``encoder.named_parameters()`` into stages: ``assign(name)`` gives the stage index."""
    names: list[list[str]] = [[] for _ in labels]
    for name, _ in encoder.named_parameters():
        names[assign(name)].append(name)
    return [(label, StageView(encoder, group)) for label, group in zip(labels, names)]


def block_index(name: str, prefix: str) -> int | None:
    """``k`` when ``name`` starts with ``prefix + "k."``, else None."""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix) :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def check_texts(fn: str, items: Any) -> list[str]:
    if isinstance(items, str):
        raise TypeError(f"{fn}: expected a sequence of strings, got a single str (wrap it in a list)")
    try:
        texts = list(items)
    except TypeError:
        raise TypeError(f"{fn}: expected a sequence of strings, got {type(items).__name__}") from None
    if not texts:
        raise ValueError(f"{fn}: expected at least one item, got an empty sequence")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"{fn}: expected strings, got {type(t).__name__} at index {i}")
    return texts
