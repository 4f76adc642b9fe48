"""What several tasks share: the needle cells a model can pose, the probe prompts of one cell
(attention, quant, diagnostics and outliers read the model on them), a needle evaluation in the
subject's form, per-token NLL of held-out windows, and the seed of every evaluation's examples.
Task modules import from here, never from one another; this module imports no other of the package."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

EVAL_SEED = 1234  # prompts, windows and episodes of every evaluation: the same for every model and seed
DEFAULT_CELL = (4, 2)  # probe cell of attention / quant / diagnostics, clipped to what the task has
PROBE_DEPTH = 0.5
NO_NEEDLES = ("the model was trained without needle batches (language modelling only: lm_every = 1, as compare "
              "--data and difftx scale train; compare --data --synthetic adds the needle task)")
NO_NEEDLES_RECALL = "the model was trained on associative recall alone (no needle batches)"


def no_needles(kinds) -> str:
    """Why a compare model trained on batches of ``kinds`` alone (task names, none of them the needle task) has no
    needle probes or needle evaluations: the wording of an LM-only or a recall-only model, else the kinds named."""
    kinds = list(kinds)
    if set(kinds) <= {"lm"}:
        return NO_NEEDLES
    if kinds == ["recall"]:
        return NO_NEEDLES_RECALL
    return f"the model was trained without needle batches (on {', '.join(kinds)} batches)"

FROM_SOURCE = ("a comparison from a source (--from) trains on LM batches and, with --synthetic, recall batches only: "
               "the {task} task needs token ids of its own, which the source's vocabulary does not have")
MAX_EXTRAPOLATION = 8  # an evaluation's sequences: at most this many times the model's context (RoPE extrapolation)


TEXT_CONTEXT = 256  # the natural-language needle prompts' default length, whatever the model's context


def check_context(lengths, model, what: str, *, text: bool = False) -> None:
    """Refuse (one line naming ``what``, the flag) sequences longer than :data:`MAX_EXTRAPOLATION` times the model's
    context (``max_seq_len``, what it trained on): beyond it the scores say little, and their cost grows with the
    square of the length. Before any work. ``text``: natural-language needle prompts, which need room for their
    sentences whatever the context: up to :data:`MAX_EXTRAPOLATION` times :data:`TEXT_CONTEXT` at least."""
    context = model.config.max_seq_len
    limit = MAX_EXTRAPOLATION * max(context, TEXT_CONTEXT if text else 0)
    too_long = sorted({int(n) for n in lengths if n > limit})
    if too_long:
        base = f"{MAX_EXTRAPOLATION}x the model's context ({context} tokens, max_seq_len)"
        if limit > MAX_EXTRAPOLATION * context:
            base = (f"{limit} tokens (text prompts: {MAX_EXTRAPOLATION}x {TEXT_CONTEXT}; the model's context is "
                    f"{context})")
        raise ValueError(f"{what}: length(s) {too_long} exceed {base}: give lengths up to {limit}")


def check_memory(model, batch: int, length: int, what: str, examples: int = 0) -> None:
    """Refuse (one line naming ``what`` and the estimate) an evaluation whose batch of ``batch`` x ``length`` tokens,
    with ``examples`` sequences of ``length`` held at once, needs more than 80% of the memory available on the
    model's device: the logits, two attention maps per head and layer in flight, and the examples' token arrays."""
    from ..generation import _fmt_bytes, available_memory

    cfg = model.config
    need = 4 * batch * length * cfg.vocab_size + 4 * 2 * batch * cfg.n_heads * length ** 2 + 16 * examples * length
    device = next(model.parameters()).device
    avail = available_memory(device)
    if avail is not None and need > 0.8 * avail:
        raise ValueError(f"{what}: {examples or batch:,} sequence(s) of {length:,} tokens in batches of {batch:,} "
                         f"would need about {_fmt_bytes(need)}, more than the {_fmt_bytes(avail)} of memory available "
                         f"on {device.type}; ask for fewer")


def first_learned_step(probes: list[dict], cell: str, threshold: float, key: str = "accuracy") -> Optional[int]:
    """The first probed step whose accuracy (``probe[key]``) at ``cell`` reaches ``threshold`` (None: never)."""
    return next((p["step"] for p in probes if p[key].get(cell, 0.0) >= threshold), None)


def learning_steps(r: dict) -> Optional[float]:
    """Steps until a task was learned (``r["learned_step"]``, from probes during training); a model that had not learned it by its last probe
    counts as that step (censored: each seed's paired difference moves toward 0, though the mean over
    seeds can move either way, e.g. +1000 and -3000 with the second censored to -500 give +250
    instead of -1000; the sign-flip p-value stays exact under exchangeable arms). ``None`` without
    probes."""
    at = r["learned_step"] if r["learned_step"] is not None else r["last_probe_step"]
    return None if at is None else float(at)


def learning_bounds(r: dict) -> Optional[tuple[float, float]]:
    """Steps until learned lie in ``[0, last probe step]`` (the censoring bound)."""
    return None if r.get("last_probe_step") is None else (0.0, float(r["last_probe_step"]))


def recall_prompts(subject, n: int) -> tuple["torch.Tensor", str]:
    """``(n, L)`` generated MQAR examples in the ids of a compare model trained on recall batches (its
    most pairs, at its training length; the evaluation seed) and what they are."""
    from ..eval.recall import generate

    block = subject.recall
    spec = block.spec(max(block.pairs))
    return block.shifted(generate(spec, n, seed=EVAL_SEED)).inputs, f"recall examples ({spec.n_pairs} pairs, " \
        f"length {spec.seq_len})"


def no_needle_task(subject) -> Optional[str]:
    """Why a needle task does not apply to ``subject`` (a compare model trained without needle
    batches), else ``None``."""
    if subject.needle is not None or not subject.is_compare_model:
        return None
    if subject.from_source:
        return FROM_SOURCE.format(task="needle")
    return no_needles(name for name, block in subject.compare.space.blocks.items() if block is not None)


def _most(subject) -> tuple[int, int]:
    """The most needles and queried keys the subject's needle task can pose (a compare model's task
    has its own; the natural-language form is bounded by its city list)."""
    from ..eval.needle_text import CITIES

    t = subject.needle
    return (t.max_needles, t.max_query) if t is not None else (len(CITIES), len(CITIES))


def fitting_cells(subject, cells, *, at_least_one: bool = False) -> list[tuple[int, int]]:
    """The cells of ``cells`` the subject's needle task can pose (the others are left out); with
    ``at_least_one``, a ``ValueError`` when none can."""
    max_n, max_r = _most(subject)
    fit = [(n, r) for n, r in cells if n <= max_n and r <= max_r]
    if at_least_one and not fit:
        raise ValueError(f"none of the cells {cells} fits the model's needle task")
    return fit


def probe_cell(subject, cell: Optional[tuple[int, int]]) -> tuple[int, int]:
    """``cell`` (default 4/2) clipped to what the subject's needle task can pose."""
    n, r = DEFAULT_CELL if cell is None else cell
    max_n, max_r = _most(subject)
    n = min(n, max_n)
    return n, min(r, max_r, n)


def probe_prompts(subject, cell: Optional[tuple[int, int]], samples: int, context_len: int = 256):
    """``samples`` prompts of the probe cell (:func:`probe_cell`) at depth 0.5 with a role per
    position (synthetic for a compare model, natural-language for a text model) and a description
    of them."""
    from ..eval.needle import needle_samples
    from ..eval.needle_text import text_needle_probes

    n, r = probe_cell(subject, cell)
    if subject.needle is not None:
        probes, form = needle_samples(subject.needle, n, r, PROBE_DEPTH, samples, seed=EVAL_SEED), "synthetic"
    else:
        tok = subject.tokenizer
        probes = text_needle_probes(tok.encode, tok.decode, n, r, PROBE_DEPTH, samples, context_len, seed=EVAL_SEED)
        form = "text"
    return probes, {"form": form, "cell": f"{n}/{r}", "depth": PROBE_DEPTH, "n_samples": len(probes)}


def run_needles(subject, grid, depths, samples: int, *, lengths=None, context_len: int = 256,
                backend: Optional[str] = None, use_cache: bool = True, batch_size: int = 50, progress: bool = False):
    """:class:`difftx.eval.needle.NeedleResult` of the subject's form (same prompts for every model)."""
    from ..eval.needle import evaluate_needles
    from ..eval.needle_text import evaluate_needles_text

    if subject.needle is not None:
        return evaluate_needles(subject.model, subject.needle, grid=grid, depths=depths, lengths=lengths,
                                samples_per_cell=samples, seed=EVAL_SEED, backend=backend, use_cache=use_cache,
                                batch_size=batch_size, progress=progress)
    tok = subject.tokenizer
    return evaluate_needles_text(subject.model, tok.encode, tok.decode, context_len=context_len, grid=grid,
                                 depths=depths, lengths=lengths, samples_per_cell=samples, seed=EVAL_SEED,
                                 stop_tokens=[tok.eos_id], backend=backend, batch_size=batch_size,  # it was 8
                                 progress=progress)


def window_nll(model, windows: torch.Tensor, batch_size: int, progress: bool,
               backend: Optional[str] = None) -> torch.Tensor:
    """Per-token NLL ``(N, T)`` of ``windows`` ``(N, T + 1)``, in batches."""
    from ..eval.lm import batched_token_nll

    return batched_token_nll(model, windows, batch_size, backend=backend, progress=progress)
