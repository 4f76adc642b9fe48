"""Language modelling on held-out text: mean token NLL, bits per byte, NLL by position, the
AR-hit split (paper Table 6) and length extrapolation (NLL beyond the training length)."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .base import Metric, Task, positive, setting
from .common import check_context, window_nll
from .reporting import ReportContext
from .subject import BYTE_VOCAB, BlockKind, TextBlock, first_free, register_block

DEFAULT_WINDOWS = 512


@dataclass(frozen=True)
class LMSettings:
    windows: Optional[int] = setting(None, "held-out windows, spread evenly over the whole held-out stream, never "
                                           "scoring a token twice (fewer when that many do not fit; 0: every token "
                                           "once, in consecutive windows; default: every token of --data FILE, else "
                                           f"{DEFAULT_WINDOWS} windows of the held-out split)")
    overlap: bool = setting(False, "allow windows that score the same token more than once when more windows are asked "
                                   "for than fit side by side (they are then not independent examples)")
    seq_len: Optional[int] = setting(None, "predictions per window (default: the training length)")
    extrapolation_factors: tuple = setting((1, 2, 4), "context lengths, as multiples of the window, for the "
                                                       "length-extrapolation curve")
    extrapolation_windows: int = setting(8, "windows of the longest extrapolation length, spread evenly")
    batch_size: int = setting(8, "windows per forward pass")

    def __post_init__(self) -> None:
        if self.windows is not None:
            positive(self, "windows", allow_zero=True)
        positive(self, "extrapolation_windows", "batch_size")
        if self.seq_len is not None:
            positive(self, "seq_len")
        if not self.extrapolation_factors or any(not isinstance(f, int) or f <= 0
                                                 for f in self.extrapolation_factors):
            raise ValueError(f"LMSettings.extrapolation_factors: must be positive integers, got "
                             f"{self.extrapolation_factors!r}")


class LMTask(Task):
    name = "lm"
    title = "Language modelling"
    help = "held-out NLL, bits per byte, NLL by position, AR-hit split, length extrapolation"
    description = ("Scores held-out text: a compare model's held-out Shakespeare bytes; a text model's own "
                   "validation split (from its train_config.json), or with --data FILE every token of FILE once.")
    Settings = LMSettings

    def applies(self, subject, settings) -> Optional[str]:
        return None if subject.has_text else "the model was trained without LM batches (lm_every = 0)"

    def run(self, subject, s: LMSettings, *, progress: bool = False) -> dict:
        import torch

        from ..eval.lm import (ar_hit_mask, distinct_predictions, length_extrapolation, spread_windows, summarize_nll,
                               window_starts)

        held = subject.heldout()
        seq_len = s.seq_len or held.train_len
        check_context([seq_len * max(s.extrapolation_factors)], subject.model,
                      f"lm --seq-len / --extrapolation-factors (windows of {seq_len} x {max(s.extrapolation_factors)})")
        n = s.windows if s.windows is not None else (0 if subject.data is not None else DEFAULT_WINDOWS)
        windows, tail = spread_windows(held.tokens, seq_len, n, overlap=s.overlap)
        if n == 0:  # consecutive windows, then the tail
            starts = list(range(0, (windows.shape[0] + (tail is not None)) * seq_len, seq_len))
        else:
            starts = window_starts(held.tokens.numel(), seq_len, n, overlap=s.overlap)
        nll, hits = window_nll(subject.model, windows, s.batch_size, progress), ar_hit_mask(windows)
        per_window = [(float(r.mean()), r.numel()) for r in nll]
        flat_nll, flat_hits = nll.flatten(), hits.flatten()
        if tail is not None:
            t_nll = window_nll(subject.model, tail, 1, False)
            per_window.append((float(t_nll.mean()), t_nll.numel()))
            flat_nll, flat_hits = torch.cat([flat_nll, t_nll.flatten()]), torch.cat([flat_hits, ar_hit_mask(tail)[0]])
        heldout = summarize_nll(flat_nll[None], flat_hits[None], held.bytes_per_token).to_dict()
        heldout["window"] = seq_len
        heldout["nll_by_position"] = nll.mean(0).tolist() if nll.shape[0] else []
        distinct = int(flat_nll.numel()) if not (s.overlap and n > 0) else distinct_predictions(
            window_starts(held.tokens.numel(), seq_len, n, overlap=True), seq_len)
        import hashlib

        text_id = hashlib.sha256(held.tokens.numpy().astype("<i8").tobytes()).hexdigest()[:16]
        out: dict = {"source": held.source, "text_id": text_id, "train_len": held.train_len,
                     "train_len_known": getattr(held, "train_len_known", True), "window": seq_len,
                     "windows": len(per_window), "windows_asked": n, "tokens": int(flat_nll.numel()),
                     "distinct_tokens": distinct, "stream_tokens": int(held.tokens.numel()), "heldout": heldout,
                     "records": {"window_nll": [w for w, _ in per_window], "window_tokens": [n for _, n in per_window]}}
        out["dependence"] = _dependence(starts, out["records"]["window_tokens"], seq_len,
                                        document_offsets(subject, held))
        heldout["nll_interval"] = nll_interval(out).to_dict()
        try:
            ext = length_extrapolation(subject.model, held.tokens, seq_len, factors=s.extrapolation_factors,
                                       max_windows=s.extrapolation_windows, bytes_per_token=held.bytes_per_token,
                                       progress=progress)
            out["extrapolation"] = {str(f): r.to_dict() for f, r in ext.items()}
        except ValueError as e:  # a short held-out text: this sub-measure alone is skipped
            out["extrapolation_skipped"] = f"length extrapolation: {e}"
        return out

    def metrics(self, settings) -> list[Metric]:
        def held(key):
            return lambda r: r["heldout"][key]

        def bpb(r: dict) -> list[float]:
            return [w / math.log(2) / r["heldout"]["bytes_per_token"] for w in per_block(r)]

        # the examples of the two-level interval: blocks of windows (windows of one text are not independent
        # examples: difftx.eval.blocks)
        return [
            Metric("lm_nll", "LM NLL (held-out)", True, held("nll"), "nats", primary=True, per_example=per_block),
            Metric("lm_bpb", "LM bits per byte", True, held("bpb"), "bits", per_example=bpb),
            Metric("lm_ar_hit_nll", "LM NLL, AR-hit tokens", True, held("ar_hit_nll"), "nats"),
            Metric("lm_other_nll", "LM NLL, other tokens", True, held("other_nll"), "nats"),
            Metric("lm_nll_beyond_train_len", f"LM NLL beyond the window (x{max(settings.extrapolation_factors)})",
                   True, _beyond, "nats"),
        ]

    def report(self, ctx: ReportContext) -> str:
        if not ctx.ran(self.name):
            return f"## {self.title}\n\nNot measured: {ctx.skipped(self.name)}.\n"
        r = ctx.result(self.name)
        s = ctx.settings(self.name)
        return (f"## {self.title}\n\nHeld-out text: {r['source']}; {r['windows']} windows of {r['window']} "
                f"predictions ({r['tokens']:,} tokens) per model. {_examples_sentence(r)} "
                "Mean over seeds [95% CI]:\n\n"
                + ctx.comparison_table(ctx.metric_keys(self.name))
                + f"\nThe extrapolation row scores windows of {max(s['extrapolation_factors'])}x the window length "
                  "(RoPE, nothing rescaled). At 1-30M parameters published reproductions find the LM-loss gap "
                  "within seed noise (about -0.016 +- 0.023 nats at 30M); the paper's LM gains are at 3B-13B.\n")

    def plots(self, ctx: ReportContext, folder: Path) -> dict[str, Path]:
        from ..eval import plots as P

        if not ctx.ran(self.name) or "extrapolation" not in ctx.result(self.name):
            return {}
        r = ctx.result(self.name)
        f = max(r["extrapolation"], key=int)
        curves = {ctx.short(a): ctx.result(self.name, a)["extrapolation"][f]["nll_by_position"] for a in ctx.arms}
        return {"NLL by position": P.plot_nll_by_position(curves, folder / "nll_by_position.png",
                                                          train_len=r["window"])}

    def print(self, res: dict) -> None:
        h = res["heldout"]
        last = res["records"]["window_tokens"][-1] if res["records"]["window_tokens"] else res["window"]
        shape = f"{res['windows']} windows of {res['window']} predictions" + (
            f" (the last {last})" if last != res["window"] else "")
        stream = res.get("stream_tokens")
        share = "" if not stream else (" (all of it)" if res.get("distinct_tokens") == stream - 1 else
                                       f" (of its {stream - 1:,} predictable tokens)")
        length = (f"training length {res['train_len']}" if res.get("train_len_known", True) else
                  f"the training length is not recorded with this model: its maximum length {res['train_len']}")
        print(f"scored {res['source']}: {scored_tokens(res)}{share} in {shape} ({length})")
        asked = res.get("windows_asked") or 0
        if asked > res["windows"] and res.get("distinct_tokens", res["tokens"]) == res["tokens"]:
            print(f"  ({asked} windows asked for; {res['windows']} fit without scoring a token twice: "
                  "--overlap true allows more, as examples that are not independent)")
        ar = "-" if h["ar_hit_nll"] is None else f"{h['ar_hit_nll']:.4f}"
        other = "-" if h["other_nll"] is None else f"{h['other_nll']:.4f}"
        ci = nll_interval(res)
        band = "" if ci.low is None else f" [95% CI {ci.low:.4f}, {ci.high:.4f}]"
        print(f"NLL {h['nll']:.4f} nats{band}  bits/byte {h['bpb']:.4f}")
        print(f"AR-hit NLL {ar} ({h['ar_hit_fraction']:.1%} of tokens)  other NLL {other}")
        print(textwrap.fill(f"  (NLL interval: {interval_about(res, ci)})", 100, subsequent_indent="   "))
        ext = res.get("extrapolation", {})
        if ext:
            longest = max(ext, key=int)
            count = ext[longest]["n_tokens"] // (int(longest) * res["window"])
            print(f"length extrapolation, on its own sample of {count} windows of {longest}x the length (so its x1 "
                  "NLL differs from the one above):")
        for f, r in ext.items():
            beyond = r["extra"].get("nll_beyond_train_len")
            tail = "" if beyond is None else f"  beyond the window {beyond:.4f}"
            print(f"  x{f} window: NLL {r['nll']:.4f}{tail}")
        if "extrapolation_skipped" in res:
            print(f"  skipped: {res['extrapolation_skipped']}")


def scored_tokens(res: dict) -> str:
    """"3,584 distinct tokens" (and how many predictions, when windows overlap)."""
    distinct = res.get("distinct_tokens", res["tokens"])
    text = f"{distinct:,} distinct tokens"
    return text if distinct == res["tokens"] else text + f" ({res['tokens']:,} predictions: windows overlap)"


def _dependence(starts: list[int], tokens: list[int], seq_len: int, doc_offsets) -> dict:
    """How the windows relate (recorded in the result): whether they are ``consecutive`` (less than
    one window of text between neighbours on average), the text they ``span``, and the units of
    every interval over them (:func:`difftx.eval.blocks.units`): the ``bounds`` of its blocks, cut
    ``by`` document (where the text's documents are known and the windows lie in at least 4) or by
    position (blocks spanning at least ``min_block_tokens``), its ``estimand`` ("documents": over
    documents like these; "windows": over windows of this one text), the ``documents`` the windows
    lie in (``None``: not known) and a ``note`` where documents are known but too few."""
    from ..eval.blocks import MIN_BLOCK_TOKENS, units

    spacing = (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else math.inf
    doc_starts = None
    if doc_offsets is not None and len(doc_offsets) >= 2 and starts:
        import numpy as np

        doc = np.searchsorted(np.asarray(doc_offsets), np.asarray(starts) + 1, side="right")  # first prediction's
        doc_starts = (np.flatnonzero(np.diff(doc)) + 1).tolist()
    u = units(tokens, starts, doc_starts=doc_starts) if starts else None
    out = {"consecutive": spacing < 2 * seq_len, "span": starts[-1] + tokens[-1] - starts[0] if starts else 0,
           "min_block_tokens": MIN_BLOCK_TOKENS, "by": u.by if u else "position",
           "bounds": u.bounds if u else [0, 0], "estimand": u.estimand if u else "windows",
           "documents": u.documents if u else None}
    if u is not None and u.note:
        out["note"] = u.note
    return out


def document_offsets(subject, held) -> Optional[list[int]]:
    """Where the held-out stream's documents start (then its length), or ``None`` where that is not
    known: ``held.doc_offsets`` where the stream records them (a text model's validation split, or
    ``--data`` a JSONL file or a folder of files), else, for a compare model, the places of the
    separator that opens every packed document (its tokenizer's end-of-text in the model's ids:
    the bundled Shakespeare's works, the records or files of ``compare --data``). A stream that does
    not open with the separator is not a packed one: ``None``."""
    recorded = getattr(held, "doc_offsets", None)
    if recorded is not None:
        return [int(o) for o in recorded]
    sep = _separator(subject)
    tokens = held.tokens
    if sep is None or tokens.numel() == 0 or int(tokens[0]) != sep:
        return None
    return (tokens == sep).nonzero().flatten().tolist() + [int(tokens.numel())]


def _separator(subject) -> Optional[int]:
    """A compare model's document separator in its own ids (``None``: not a compare model trained on
    text, or its tokenizer cannot be read)."""
    compare = getattr(subject, "compare", None)
    offset = getattr(subject, "lm_offset", None) if compare is not None else None
    if offset is None:
        return None
    text = getattr(subject, "text", None)
    if text is None:  # the bundled Shakespeare, in bytes
        from ..data.tokenizer import ByteTokenizer

        return offset + ByteTokenizer().eos_id
    try:
        from ..data import load_tokenizer
        from ..training.checkpointing import TOKENIZER_DIR

        saved = Path(subject.folder) / TOKENIZER_DIR
        return offset + int(load_tokenizer(str(saved) if saved.is_dir() else text.tokenizer).eos_id)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot be read: documents not known
        return None


def window_layout(res: dict) -> list[int]:
    """Window-index bounds of the units of a result's intervals: its recorded blocks, else one per
    window (a result written before blocks were recorded)."""
    from ..eval.blocks import window_bounds

    dep = res.get("dependence") or {}
    return dep.get("bounds") or window_bounds(len(res["records"]["window_nll"]))


def per_block(res: dict) -> list[float]:
    """Token-weighted mean NLL of each block of :func:`window_layout`: the examples of ``lm_nll``
    in ``difftx compare``'s two-level interval."""
    from ..eval.blocks import block_means

    return block_means(res["records"]["window_nll"], res["records"]["window_tokens"], window_layout(res))


def nll_interval(res: dict, reference: Optional[dict] = None):
    """The mean NLL of a result with its 95% interval over the blocks of :func:`window_layout`
    (:class:`difftx.eval.blocks.BlockInterval`); with ``reference`` (a result on the same windows),
    of the window-by-window difference ``res - reference``."""
    from ..eval.blocks import BlockInterval, block_interval

    values, tokens = res["records"]["window_nll"], res["records"]["window_tokens"]
    if not values:  # a stream too short for one prediction
        return BlockInterval(math.nan, None, None, None, None, 0, 0.0, 0.95, "no interval: no windows")
    if reference is not None:
        import numpy as np

        values = np.asarray(values, dtype=np.float64) - np.asarray(reference["records"]["window_nll"])
    return block_interval(values, tokens, window_layout(res))


def estimand(res: dict) -> tuple[str, Optional[str]]:
    """What the NLL interval of ``res`` is about: ``(phrase, why)``, the phrase "over documents like
    these" (blocks of whole documents) or "over windows of this one text" (blocks by position; also
    a result recorded before the estimand was), and where documents are known but too few, why there
    is no interval across them (else ``None``)."""
    from ..eval.blocks import ESTIMANDS

    dep = res.get("dependence") or {}
    key = dep.get("estimand") or ("documents" if dep.get("by") == "document" else "windows")
    return ESTIMANDS[key], dep.get("note")


def interval_about(res: dict, ci=None) -> str:
    """One sentence: what the NLL interval of ``res`` is about (:func:`estimand`) and its units."""
    from ..eval.blocks import MIN_BLOCKS

    dep = res.get("dependence") or {}
    ci = ci if ci is not None else nll_interval(res)
    if "bounds" not in dep:  # a result recorded before blocks were
        return "a t interval over windows, taken as independent"
    phrase, why = estimand(res)
    documents = dep["by"] == "document"
    if ci.low is None:
        have = (f"its documents make {_blocks(ci.blocks)}" if documents else
                f"the windows span {dep['span']:,} tokens")
        need = (f"{MIN_BLOCKS} documents" if documents else
                f"{MIN_BLOCKS} blocks spanning at least {dep['min_block_tokens']:,} tokens each")
        return (f"none: windows of one text are not independent, and an interval {phrase} needs {need}; {have}"
                + (f"; {why}" if why else ""))
    whole = res.get("distinct_tokens") == (res.get("stream_tokens") or 0) - 1
    head = phrase + (" (every token is scored once, so the text's own mean has no sampling error)" if whole else "")
    windows = res["windows"] / ci.blocks
    shape = (f"{windows:,.0f} {'consecutive ' if dep['consecutive'] else ''}window{'s' if windows >= 1.5 else ''} "
             f"spanning about {dep['span'] / ci.blocks:,.0f} tokens")
    if documents:
        per = dep.get("documents") or ci.blocks
        what = "one document" if per == ci.blocks else f"about {per / ci.blocks:,.1f} whole documents"
        units = f"{_blocks(ci.blocks)} of {what} each (about {shape})"
    else:
        units = f"{_blocks(ci.blocks)} of about {shape} of text each"
    return (f"{head}: its units are {units} (t, {ci.df:.1f} df)" + (f"; {why}" if why else ""))


def _examples_sentence(r: dict) -> str:
    """The report's sentence on the examples of the text part of the interval, and what it is about."""
    dep = r.get("dependence") or {}
    if "bounds" not in dep:
        return "The windows are the examples of the interval."
    blocks = len(dep["bounds"]) - 1
    phrase, why = estimand(r)
    why = f" ({why})" if why else ""
    if blocks < 2:
        return (f"The windows make {_blocks(blocks)} spanning at least {dep['min_block_tokens']:,} tokens: the "
                f"interval is over seeds alone (text noise is not in it){why}.")
    if dep["by"] == "document":
        return (f"The interval's examples are {_blocks(blocks)} of whole documents ({dep.get('documents') or blocks} "
                f"documents): it is {phrase}.")
    return (f"The interval's examples are {_blocks(blocks)} of windows spanning at least "
            f"{dep['min_block_tokens']:,} tokens of text each: it is {phrase}{why}.")


def _blocks(n: int) -> str:
    return f"{n} block{'s' if n != 1 else ''}"


def _beyond(r: dict) -> Optional[float]:
    ext = r.get("extrapolation")
    if not ext:
        return None
    return ext[max(ext, key=int)]["extra"].get("nll_beyond_train_len")


def _write_block(block, space) -> dict:
    """The text's ids: ``lm`` (trained on LM batches), ``lm_offset`` (where they start, or would: after the blocks
    written before it) and ``lm_vocab``."""
    if block is None:
        return {"lm": False, "lm_offset": first_free(space.before("lm")), "lm_vocab": BYTE_VOCAB}
    return {"lm": True, "lm_offset": block.first_id, "lm_vocab": block.size}


def _read_block(data: dict, before: dict):
    if not data.get("lm"):
        return None
    return TextBlock(int(data.get("lm_offset", first_free(before))), int(data.get("lm_vocab", BYTE_VOCAB)))


# the LM training task's block, the text's ids, in compare_task.json
register_block("lm", BlockKind(_write_block, _read_block, lambda block: block.end, "text"))
TASK = LMTask()
