"""Static decoding: one step with the same shapes and graph at every position, optionally compiled.

On a GPU a decoding step at batch 1 is bound by launches, not by FLOPs or bytes: every aten op of every layer is a
kernel launch. A :class:`~difftx.model.StaticKVCache` step has no Python value that depends on the position (the
new keys are written at a position held in a tensor, attention runs over the whole buffer with the keys beyond it
masked), so ``torch.compile(mode="reduce-overhead")`` captures it once as a CUDA graph and replays it at every
position. :func:`static_decoder` builds that step; :func:`difftx.generation.generate` runs it with
``static_cache=True`` (and ``compile=True``), ``difftx bench --decode --steps static compiled`` times it.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Union

import torch
from torch import Tensor

from .attention import AttentionKind
from .attention.cache import static_backend
from .model import StaticKVCache, Transformer

CompileOption = Union[bool, Mapping]


def check_static(model: Transformer, backend: Optional[str] = None) -> None:
    """ValueError unless every layer of ``model`` can run a static step with ``backend`` (default: each layer's
    own): the kind's forward must be :class:`AttentionKind`'s (which writes the cache at a tensor position and
    masks the keys beyond it; a kind may override ``_qkv`` and the hooks), and the backend one that reads the
    dense mask (``auto``, ``eager``, ``sdpa`` and its forms)."""
    for i, block in enumerate(getattr(model, "layers", ())):
        attn = block.attn
        if type(attn).forward is not AttentionKind.forward:
            raise ValueError(f"static_cache: the attention kind {type(attn).__name__} of layer {i} overrides "
                             f"forward, so it may not handle a cache position given as a tensor; decode it "
                             f"without static_cache")
        static_backend(backend if backend is not None else attn.backend)


# Inductor's options for a static step compiled on CPU: store a pointwise result once it has 2 or more ops instead
# of recomputing it in each consumer. Inductor's CPU default (50) inlines the new key's RoPE (a power, a cosine and
# a sine per element) into the loop of the scores over every key of the buffer (the static write is an
# index_copy of the whole buffer there, and the matrix-vector products decompose into loops): 18 ms a step against
# 3.5 ms for DIFF (D 512, 2 layers, T 1024, one thread). On CUDA the products stay cuBLAS calls, whose inputs are
# stored anyway.
CPU_INDUCTOR_OPTIONS = {"realize_opcount_threshold": 2}


def compile_options(compile: CompileOption, device: torch.device) -> Optional[dict]:
    """``torch.compile`` keywords for a static step: ``fullgraph=True, dynamic=False`` and, on CUDA,
    ``mode="reduce-overhead"`` (CUDA graphs), on CPU inductor's :data:`CPU_INDUCTOR_OPTIONS`; a mapping overrides
    or adds keywords (``{"backend": "aot_eager"}``); ``False``: None (no compiling)."""
    if compile is False or compile is None:
        return None
    opts: dict = {"fullgraph": True, "dynamic": False}
    if torch.device(device).type == "cuda":
        opts["mode"] = "reduce-overhead"
    else:
        opts["options"] = dict(CPU_INDUCTOR_OPTIONS)
    if isinstance(compile, Mapping):
        opts.update(compile)
        if opts.get("backend") not in (None, "inductor"):
            opts.pop("mode", None)  # a mode and options are inductor's alone
            opts.pop("options", None)
        elif "mode" in compile:
            opts.pop("options", None)  # torch.compile takes a mode or options, not both
    elif compile is not True:
        raise ValueError(f"compile: expected True, False or a mapping of torch.compile keywords, got {compile!r}")
    return opts


def _step(model: Transformer, cache: StaticKVCache, tokens: Tensor, positions: Optional[Tensor],
          backend: Optional[str]) -> Tensor:
    """The static step's last-position logits ``(B, V)`` (what is compiled)."""
    return model(tokens, positions=positions, cache=cache, backend=backend)[:, -1]


def static_decoder(model: Transformer, cache: StaticKVCache, backend: Optional[str] = None,
                   compile: CompileOption = False) -> Callable[[Tensor, Optional[Tensor]], Tensor]:
    """``step(tokens, positions)``: the logits ``(B, V)`` after ``tokens`` ``(B, T)`` (RoPE ``positions``
    ``(B|1, T)``, default the cache positions), written into ``cache`` at its position, which then advances by
    ``T``. ``compile``: run the step under ``torch.compile`` (:func:`compile_options`: on CUDA
    ``mode="reduce-overhead"``, CUDA graphs; the cache's tensors are then marked as static addresses, so the graph
    writes them in place). A step past the cache's end is refused before it runs."""
    check_static(model, backend)
    device = cache.pos.device
    opts = compile_options(compile, device)
    fn = _step
    cuda_graphs = False
    if opts is not None:
        fn = torch.compile(_step, **opts)
        cuda_graphs = device.type == "cuda" and opts.get("mode") in ("reduce-overhead", "max-autotune")
        if cuda_graphs:
            for t in cache.tensors():
                torch._dynamo.mark_static_address(t)

    def step(tokens: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        cache.check_room(tokens.shape[-1])
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        logits = fn(model, cache, tokens, positions, backend)
        if cuda_graphs:
            logits = logits.clone()  # the graph's output buffer is rewritten by its next replay
        cache.advance(tokens.shape[-1])
        return logits

    return step
