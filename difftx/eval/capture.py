"""Record attention maps and hidden states of a model forward, from outside the model.

Analysis stays off the fast path: nothing is threaded through :class:`difftx.Transformer`.
Inside ``with capture_attention(model) as cap:`` every attention module's ``forward`` is
temporarily wrapped so that it runs a maps-returning kernel (``eager`` by default) with
``return_maps=True``; the maps are kept and the module's ordinary output is returned, so the
model computes exactly what it computes with that kernel. Leaving the block restores the
modules. Hidden states (each block's output, the residual stream) come from forward hooks.

Legend: ``B`` batch, ``T`` query rows of one call, ``S`` keys, ``H`` output heads,
``C`` maps per head (2 for ``diff``, 1 otherwise), ``D`` model width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from ..attention.modules import AttentionKind


@dataclass
class CapturedMaps:
    """One attention call of one layer, float32 on CPU.

    ``logits`` ``(B, C*H', T, S)``: scaled pre-softmax logits (masked entries ``-inf``); for
    ``diff`` sub-head ``2h + c`` is component ``c`` of head ``h``; for ``diff_v2`` the ``2H``
    query heads. ``probs``: their softmax. ``effective`` ``(B, H, T, S)``: the map applied to
    the values: ``A1 - lam * A2`` (``diff``), ``a_2j - sigmoid(lambda_proj(x))_j a_2j+1`` per
    query row (``diff_v2``), ``probs`` (``standard``). ``lam``: scalar tensor (``diff``),
    ``(B, T, H)`` (``diff_v2``) or ``None``. ``q_offset``: key index of query row 0 (non-zero
    while decoding with a KV cache).
    """

    layer: int
    kind: str
    logits: Tensor
    probs: Tensor
    effective: Tensor
    lam: Optional[Tensor]
    q_offset: int


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules of ``model`` in layer order (``model.layers[i].attn``)."""
    mods = [m for m in model.modules() if isinstance(m, AttentionKind)]
    if not mods:
        raise ValueError(f"{type(model).__name__} has no difftx attention modules to capture")
    return mods


class AttentionCapture:
    """Context manager recording per-layer :class:`CapturedMaps` (and optionally hidden states).

    ``backend``: the kernel every attention call uses while capturing; it must support
    ``return_maps`` (``eager``, or a kernel from :mod:`difftx.eval.quant`).
    ``store``: keep the maps in :attr:`maps` (``maps[layer]`` is a list, one entry per
    forward call: a prefill then one per decoded token). ``callback(captured)`` is called
    for every call (stream statistics without storing anything with ``store=False``).
    ``hidden_states``: also record each block's output ``(B, T, D)`` in :attr:`hidden`
    (``hidden[layer]`` a list per call), or pass them to ``hidden_callback(layer, x)``.
    """

    def __init__(self, model: torch.nn.Module, *, backend: str = "eager", store: bool = True,
                 callback: Optional[Callable[[CapturedMaps], None]] = None, hidden_states: bool = False,
                 hidden_callback: Optional[Callable[[int, Tensor], None]] = None):
        if hasattr(model, "_orig_mod"):  # torch.compile wrapper: its graph would bypass the wrapped forwards
            raise ValueError("AttentionCapture: pass the uncompiled model (model._orig_mod), not a torch.compile "
                             "wrapper; analysis runs eagerly")
        self.model, self.backend, self.store, self.callback = model, backend, store, callback
        self.want_hidden = hidden_states or hidden_callback is not None
        self.hidden_callback = hidden_callback
        self.modules = attention_modules(model)
        self.maps: list[list[CapturedMaps]] = [[] for _ in self.modules]
        self.hidden: list[list[Tensor]] = [[] for _ in self.modules]
        self._saved: list[tuple[torch.nn.Module, object]] = []
        self._hooks: list = []

    # -- recording ------------------------------------------------------------------------------
    def _record(self, layer: int, module, x: Tensor, maps, q_offset: int) -> None:
        eff, lam = module.capture_maps(x, maps)  # the kind's own reading of its maps
        logits, probs = maps.logits.detach().float().cpu(), maps.probs.detach().float().cpu()
        eff, lam = eff.detach().float().cpu(), None if lam is None else lam.detach().float().cpu()
        cap = CapturedMaps(layer, module.kind, logits, probs, eff, lam, q_offset)
        if self.store:
            self.maps[layer].append(cap)
        if self.callback is not None:
            self.callback(cap)

    def _wrap(self, layer: int, module) -> Callable:
        original = module.forward
        capture_backend = self.backend

        def forward(x, *, positions=None, mask=None, cache=None, backend=None, return_maps=False):
            # the caller's ``backend`` is overridden: capturing needs a maps-returning kernel
            out, maps = original(x, positions=positions, mask=mask, cache=cache, backend=capture_backend,
                                 return_maps=True)
            self._record(layer, module, x, maps, 0 if mask is None else mask.q_offset)
            return (out, maps) if return_maps else out

        return forward

    def _hidden_hook(self, layer: int):
        def hook(_module, _inputs, output):
            h = output.detach().float().cpu()
            if self.hidden_callback is not None:
                self.hidden_callback(layer, h)
            if self.store:
                self.hidden[layer].append(h)
        return hook

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> "AttentionCapture":
        for i, m in enumerate(self.modules):
            self._saved.append((m, m.__dict__.get("forward")))
            m.forward = self._wrap(i, m)
        if self.want_hidden:
            blocks = getattr(self.model, "layers", None)
            if blocks is None or len(blocks) != len(self.modules):
                raise ValueError("hidden states need a model with .layers (one block per attention module)")
            self._hooks = [b.register_forward_hook(self._hidden_hook(i)) for i, b in enumerate(blocks)]
        return self

    def __exit__(self, *exc) -> None:
        for m, previous in self._saved:
            if previous is None:
                del m.forward
            else:
                m.forward = previous
        self._saved.clear()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- access ---------------------------------------------------------------------------------
    def last(self, layer: int) -> CapturedMaps:
        """The most recent call's maps of ``layer``."""
        if not self.maps[layer]:
            raise ValueError(f"no attention maps were captured for layer {layer} (store=False or no forward yet)")
        return self.maps[layer][-1]

    def clear(self) -> None:
        self.maps = [[] for _ in self.modules]
        self.hidden = [[] for _ in self.modules]


def capture_attention(model: torch.nn.Module, **kwargs) -> AttentionCapture:
    """``with capture_attention(model) as cap: model(tokens)`` then ``cap.maps[layer][call]``."""
    return AttentionCapture(model, **kwargs)


@torch.no_grad()
def layer_lambdas(model: torch.nn.Module) -> list[Optional[float]]:
    """The learned lambda per layer (its kind's ``lambda_reading``): ``diff``'s, ``None`` for layers whose
    lambda is not a parameter (``standard``; ``diff_v2``'s is per token, see :class:`CapturedMaps`)."""
    return [m.lambda_reading() for m in attention_modules(model)]


def max_abs_attention_logits(model: torch.nn.Module, tokens: Tensor) -> list[float]:
    """The largest ``|scaled pre-softmax attention logit|`` of each layer over one forward of
    ``tokens`` ``(B, T)`` (masked entries left out; for DIFF both maps of each head count)."""
    out = [0.0] * len(attention_modules(model))

    def keep(c: CapturedMaps) -> None:
        finite = c.logits[torch.isfinite(c.logits)]
        if finite.numel():
            out[c.layer] = max(out[c.layer], float(finite.abs().max()))

    with torch.no_grad(), AttentionCapture(model, store=False, callback=keep):
        model(tokens)
    return out
