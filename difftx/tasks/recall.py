"""Multi-query associative recall (MQAR, Zoology's definition, and its noise variants; see
:mod:`difftx.eval.recall`): greedy accuracy at every queried position, on a grid of cells (variant x
length x pairs) of generated examples, or on examples read from a file (``difftx eval recall MODEL
--examples FILE``).

Token ids are the model's own: a compare model trained on recall batches (``recall_every``) is scored
in its recall block's ids, on a grid that by default goes past its training (1.5 and 2 times its most
pairs, 2 and 4 times its length); another model is scored on MQAR of its vocabulary (or
``vocab_size``). A compare model trained without recall batches takes a file only.

The capacity frontier of a model is its mean accuracy over the plain-MQAR cells of the grid (the area
under its accuracy-against-pairs curves, averaged over lengths: ``recall_frontier``, the primary
metric); ``recall_pairs_at_half`` reads the same cells as the pair count, interpolated on a log scale,
where accuracy falls through 50% (the geometric mean over lengths), censored at the grid's ends. Both
are bounded, so beside a verdict (the arms are not interchangeable) the betting test says whether the mean
difference is established. On
``recall-cpu``'s seeds both have the same power (``benchmarks/recall_frontier_power.py``, results log
2026-11-28); the frontier is the primary metric because it is never censored and its effect per unit of
range is the larger where the arms differ least.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .base import Metric, Task, parse_numbers, positive, setting
from .common import EVAL_SEED, check_context, check_memory, first_learned_step, learning_bounds, learning_steps
from .reporting import ReportContext, fmt, table
from .subject import BlockKind, register_block

FIRST_VARIANT = "mqar"
def _variants(text: str) -> tuple:
    return tuple(v.strip() for v in str(text).split(",") if v.strip())


@dataclass(frozen=True)
class RecallSettings:
    examples: str = setting("", "a JSONL file of examples, one {\"inputs\": [...], \"labels\": [...]} a line "
                                "(labels[i]: the token after inputs[0..i]; -100: not scored); default: generated "
                                "on the grid below")
    vocab_size: int = setting(0, "vocabulary of generated examples: keys from 1..V/2-1, values from V/2..V-1 (0: the "
                                 "model's vocabulary, or a compare model's recall block)")
    pairs: tuple = setting((), "key-value pair counts of the grid (each key queried once; default: a compare model's "
                               "training pairs and 1.5x and 2x its most, else 8)", parse_numbers)
    lengths: tuple = setting((), "example lengths of the grid, even (default: a compare model's training length and 2x "
                                 "and 4x it, else 64)", parse_numbers)
    variants: str = setting("mqar,reassigned", "variants of the grid: mqar, reassigned (some keys bound again with a "
                                               "new value; the query asks for the latest)")
    reassign: float = setting(0.5, "reassigned: the share of keys bound again")
    power_a: float = setting(0.01, "the gap law of the queries: P(gap g) ~ a (g+1)^(a-1); 1 is uniform")
    samples: int = setting(256, "generated examples per cell")
    attention_samples: int = setting(64, "examples whose attention is read (on the binding, by role, and each "
                                         "layer's output against the residual stream; 0: none), of the first "
                                         "plain-MQAR cell at the training length")
    batch_size: int = setting(64, "examples per forward pass")
    learned_at: float = setting(0.5, "a compare model probed during training (probe_every) learned recall at its "
                                     "first probe with at least this accuracy")

    def __post_init__(self) -> None:
        from ..eval.recall import VARIANTS, RecallSpec

        positive(self, "samples", "batch_size")
        if not (isinstance(self.learned_at, (int, float)) and 0 < self.learned_at <= 1):
            raise ValueError(f"RecallSettings.learned_at: must be in (0, 1], got {self.learned_at!r}")
        positive(self, "vocab_size", "attention_samples", allow_zero=True)
        for name in ("pairs", "lengths"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v):
                raise ValueError(f"RecallSettings.{name}: must be positive integers, got {v!r}")
        if any(L % 2 for L in self.lengths):
            raise ValueError(f"RecallSettings.lengths: must be even (pairs and queries take two positions), got "
                             f"{self.lengths}")
        bad = [v for v in _variants(self.variants) if v not in VARIANTS]
        if bad or not _variants(self.variants):
            raise ValueError(f"RecallSettings.variants: must name some of {VARIANTS}, got {self.variants!r}")
        if not self.examples:  # the fields checked now; whether the grid fits, once the model gives V (and its block)
            for variant in _variants(self.variants):
                RecallSpec(vocab_size=1 << 20, seq_len=8, n_pairs=1, variant=variant, power_a=self.power_a,
                           reassign=self.reassign)
            if self.pairs and self.lengths:
                self.grid(None, 1 << 20)

    def grid(self, block=None, vocab_size: Optional[int] = None) -> list:
        """The cells ``[(variant, length, pairs), ...]`` that fit the vocabulary (``block``'s, a
        :class:`~difftx.eval.recall.RecallBlock`, else ``vocab_size``), with their specs; a cell that does
        not fit (too many pairs for the length) is left out, and a grid with no cell is a ``ValueError``."""
        from ..eval.recall import RecallSpec

        if block is not None and self.vocab_size and self.vocab_size != block.vocab_size:
            raise ValueError(f"RecallSettings.vocab_size: {self.vocab_size}, but the model's recall block has "
                             f"{block.vocab_size} tokens (leave it 0 for a compare model)")
        V = block.vocab_size if block is not None else (self.vocab_size or vocab_size)
        pairs = self.pairs or (_default_pairs(block.pairs) if block is not None else (8,))
        lengths = self.lengths or ((block.seq_len, 2 * block.seq_len, 4 * block.seq_len) if block is not None
                                   else (64,))
        cells, errors = [], []
        for variant in _variants(self.variants):
            for L in lengths:
                for P in sorted(pairs):
                    try:
                        spec = RecallSpec(vocab_size=V, seq_len=L, n_pairs=P, variant=variant, power_a=self.power_a,
                                          reassign=self.reassign)
                    except ValueError as e:
                        errors.append(str(e))
                        continue
                    cells.append(((variant, L, P), spec))
        if not cells:
            raise ValueError(f"RecallSettings: no cell of the grid fits ({errors[0] if errors else 'empty grid'})")
        return cells


def _default_pairs(trained: tuple) -> tuple:
    most = max(trained)
    return tuple(sorted(set(trained) | {math.ceil(1.5 * most), 2 * most}))


def cell_name(cell) -> str:
    variant, L, P = cell
    return f"{variant} L={L} P={P}"


def _write_block(block, space) -> dict:
    return {"recall_task": block.to_dict() if block is not None else None}


def _read_block(data: dict, before: dict):
    from ..eval.recall import RecallBlock

    return RecallBlock.from_dict(data["recall_task"]) if data.get("recall_task") else None


# the recall training task's block (from its first_id) in compare_task.json
register_block("recall", BlockKind(_write_block, _read_block, lambda block: block.end, "recall task"))


class RecallTask(Task):
    name = "recall"
    title = "Multi-query associative recall"
    help = ("associative recall (MQAR, Zoology's definition, and variants): accuracy at every query on a grid of "
            "pairs x lengths x variants; --examples FILE")
    description = ("Greedy accuracy at every scored position of multi-query associative recall examples: generated "
                   "on a grid of cells (keys from the lower half of the vocabulary, values from the upper half, the "
                   "pairs first, each key queried once with power-law gaps, random tokens elsewhere; variant "
                   "reassigned binds some keys again) or read from a JSONL file (--examples), one example a line, all "
                   "of one length. The frontier is the mean accuracy over the plain-MQAR cells. --json keeps each "
                   "example's labelled and correct counts")
    Settings = RecallSettings

    def applies(self, subject, s: RecallSettings) -> Optional[str]:
        if not s.examples and subject.is_compare_model and subject.recall is None:
            return ("the model was trained without recall batches (recall_every = 0; --preset recall-cpu or --set "
                    "recall_every=K adds them); give --examples FILE to score it on examples in its own token ids")
        return None

    def run(self, subject, s: RecallSettings, *, progress: bool = False) -> dict:
        from ..eval.recall import IGNORE, attention_by_role, attention_mass, generate, read_examples, score
        from ..eval.residual import attention_residual_ratio

        model = subject.model
        device = next(model.parameters()).device
        if s.examples:
            examples = read_examples(s.examples, vocab_size=model.config.vocab_size)
            check_context([examples.inputs.shape[1]], model, f"recall --examples {s.examples}")
            res = score(model, examples, batch_size=s.batch_size, device=device)
            return {**res, "cells": [{"cell": "file", **_cell_summary(res)}],
                    "records": {**res["records"], "cell": ["file"] * res["examples"]}}
        block = subject.recall
        cells = s.grid(block, model.config.vocab_size)
        check_context([spec.seq_len for _, spec in cells], model, "recall --lengths")
        for _, spec in cells:
            check_memory(model, min(s.batch_size, s.samples), spec.seq_len, "recall --samples / --batch-size",
                         examples=s.samples)
        need = max(spec.vocab_size for _, spec in cells) + (block.first_id if block is not None else 0)
        if need > model.config.vocab_size:
            raise ValueError(f"recall: vocab_size {need} exceeds the model's {model.config.vocab_size}")
        shift = block.shifted if block is not None else (lambda ex: ex)
        train_len = block.seq_len if block is not None else None
        train_pairs = list(block.pairs) if block is not None else None
        out_cells, records = [], {"cell": [], "labelled": [], "correct": []}
        probe = next((c for c in cells if c[0][0] == FIRST_VARIANT and c[0][1] == (train_len or c[0][1])), cells[0])
        attention = roles = ratio = None
        it = cells
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(cells, desc="recall cells", leave=False)
        for cell, spec in it:
            examples = shift(generate(spec, s.samples, seed=EVAL_SEED))
            res = score(model, examples, batch_size=s.batch_size, device=device)
            variant, L, P = cell
            out_cells.append({"cell": cell_name(cell), "variant": variant, "seq_len": L, "n_pairs": P,
                              "beyond": _beyond(L, P, train_len, train_pairs), **_cell_summary(res)})
            for k in ("labelled", "correct"):
                records[k] += res["records"][k]
            records["cell"] += [cell_name(cell)] * len(examples)
            if cell == probe[0] and s.attention_samples:  # the attention readings, all on the same examples
                head = examples.head(s.attention_samples)
                attention = {**attention_mass(model, head, device=device), "cell": cell_name(cell)}
                roles = {**attention_by_role(model, head, device=device), "cell": cell_name(cell)}
                ratio = {**attention_residual_ratio(model, head.inputs, head.labels != IGNORE, batch_size=s.batch_size,
                                                    device=device), "cell": cell_name(cell)}
        scored = sum(records["labelled"])
        out = {"accuracy": sum(records["correct"]) / scored, "scored": scored, "examples": len(records["cell"]),
               "source": "generated", "cells": out_cells, "records": records,
               "spec": {"vocab_size": cells[0][1].vocab_size, "power_a": s.power_a, "reassign": s.reassign,
                        "variants": list(_variants(s.variants))},
               "trained": None if block is None else block.to_dict(),
               "chance": 1.0 / (cells[0][1].vocab_size - cells[0][1].vocab_size // 2),
               "frontier": frontier(out_cells), "pairs_at_half": pairs_at_half(out_cells)}
        if attention is not None:
            out["attention_mass"] = attention
            out["attention_roles"] = roles
            out["attention_output_ratio"] = ratio
        learning = _learning(subject, s.learned_at)
        if learning is not None:
            out["learning"] = learning
        return out

    def metrics(self, settings) -> list[Metric]:
        def examples_of(cells_ok):
            def per_example(r):
                rec = r["records"]
                keep = {c["cell"] for c in r["cells"] if cells_ok(c)}
                return [c / n for c, n, name in zip(rec["correct"], rec["labelled"], rec["cell"]) if name in keep]
            return per_example

        def mean_of(cells_ok):
            def get(r):
                got = [c["accuracy"] for c in r["cells"] if cells_ok(c)]
                return sum(got) / len(got) if got else None
            return get

        plain = (lambda c: c.get("variant") == FIRST_VARIANT)  # noqa: E731
        again = (lambda c: c.get("variant") == "reassigned")  # noqa: E731
        beyond = (lambda c: c.get("variant") == FIRST_VARIANT and c.get("beyond"))  # noqa: E731
        chance = (lambda r: r.get("chance"))  # noqa: E731

        def guess_floor(r: dict) -> float:
            """What a model scores on the frontier without binding keys to values: in each plain cell it answers
            one of the P values its context holds (1/P), or any value (``chance``), whichever is more."""
            ps = [c["n_pairs"] for c in r.get("cells", []) if plain(c)]
            return max(chance(r) or 0.0, sum(1 / p for p in ps) / len(ps) if ps else 0.0)

        return [
            Metric("recall_frontier", "recall frontier: mean accuracy over the plain-MQAR cells", False,
                   lambda r: r.get("frontier"), per_example=examples_of(plain), bounds=(0.0, 1.0), primary=True,
                   learned=lambda r: r.get("frontier") is not None and r["frontier"] > 2 * guess_floor(r)),
            Metric("recall_learned_step", f"training steps until recall is learned (probe accuracy >= "
                   f"{settings.learned_at}; a model that did not learn it counts as its last probe step)", True,
                   lambda r: learning_steps(r["learning"]) if r.get("learning") else None, "steps", digits=0,
                   learned=lambda r: bool(r.get("learning")) and r["learning"]["learned_step"] is not None,
                   bounds_of=lambda r: learning_bounds(r["learning"]) if r.get("learning") else None),
            Metric("recall_pairs_at_half", "recall frontier: pairs where accuracy falls through 50% (geometric mean "
                   "over lengths)", False, lambda r: r.get("pairs_at_half"), "pairs", digits=1,
                   bounds_of=pairs_range),
            Metric("recall_beyond_training", "recall accuracy beyond training (longer, or more pairs)", False,
                   mean_of(beyond), per_example=examples_of(beyond), bounds=(0.0, 1.0)),
            Metric("recall_reassigned", "recall accuracy with keys bound again (reassigned)", False, mean_of(again),
                   per_example=examples_of(again), bounds=(0.0, 1.0)),
            Metric("recall_attention_on_binding", "attention mass on the binding asked for (last layer, absolute)",
                   False, lambda r: _last_layer_mass(r), bounds=(0.0, 1.0)),
            Metric("recall_accuracy", "associative recall accuracy (every query pooled)", False,
                   lambda r: r["accuracy"], per_example=lambda r: [c / n for c, n in zip(r["records"]["correct"],
                                                                                      r["records"]["labelled"])],
                   bounds=(0.0, 1.0)),
        ]

    def report(self, ctx: ReportContext) -> str:
        head = f"## {self.title}\n\n"
        if not ctx.ran(self.name):
            return head + f"Not run: {ctx.skipped(self.name)}.\n"
        from ..eval.stats import paired_estimate

        arms, ref = ctx.all_arms, ctx.arms[0]  # every arm against the primary pair's second arm
        r0 = ctx.result(self.name, arms[0])
        if r0.get("source") != "generated":
            return head + f"Accuracy on {r0['source']}.\n\n" + ctx.comparison_table(["recall_accuracy"])
        tr = r0.get("trained") or {}
        samples = ctx.settings(self.name)["samples"]
        out = [head + f"Greedy accuracy at every query of generated MQAR examples ({samples} a cell; vocabulary "
               f"{r0['spec']['vocab_size']}, chance {r0['chance']:.4f}); trained at length "
               f"{tr.get('seq_len', '-')} on {', '.join(map(str, tr.get('pairs', [])))} pairs; cells marked * lie "
               "beyond training. The frontier is the mean accuracy over the plain-MQAR cells. Mean over seeds per arm, "
               f"and each arm's paired difference from the {ref} [95%, unadjusted; bounded-metric interval]:\n"]
        others = [a for a in arms if a != ref]
        rows = []
        for i, c in enumerate(r0["cells"]):
            vals = {a: [ctx.result(self.name, a, sd)["cells"][i]["accuracy"] for sd in ctx.seeds] for a in arms}
            row = [c["cell"] + (" *" if c.get("beyond") else "")] + [fmt(sum(v) / len(v)) for v in vals.values()]
            for a in others:
                e = paired_estimate(vals[a], vals[ref], bounds=(0.0, 1.0))
                row.append(f"{e.mean:+.3f}" + ("" if e.low is None else f" [{e.low:+.3f}, {e.high:+.3f}]"))
            rows.append(row)
        out.append(table(rows, ["cell"] + arms + [f"{a} - {ref}" for a in others]))
        rows = []
        for a in arms:
            per = [ctx.result(self.name, a, sd) for sd in ctx.seeds]
            rows.append([a, ", ".join(fmt(r["frontier"]) for r in per),
                         ", ".join(fmt(r.get("pairs_at_half"), 1) for r in per),
                         ", ".join(_learned_text(r.get("learning")) for r in per),
                         ", ".join(fmt(_last_layer_mass(r)) for r in per)])
        learning = r0.get("learning")
        out.append("Per seed (" + ", ".join(ctx.seeds) + "): the frontier, the pairs at 50%, the step at which "
                   + (f"recall was learned (the first probe during training with accuracy >= {learning['learned_at']} "
                      f"at {learning['cell']}; '>N': not by the last probe)" if learning else
                      "recall was learned (no probes during training: probe_every = 0)")
                   + " and the last layer's attention mass on the binding a query asks for (the key and its value; "
                   "L1-normalised effective map, mean over heads and queries):\n")
        out.append(table(rows, ["arm", "frontier", "pairs at 50%", "learned at", "attention on the binding"]))
        out += _mechanism_sections(ctx, self.name, arms)
        keys = [k for k in ctx.metric_keys(self.name) if k != "recall_accuracy"]
        verdicts = [c for k in keys for c in ctx.comparisons(k)]
        lines = [f"- {c['verdict']}" for c in verdicts if c is not None and c.get("verdict")]
        if lines:
            out.append("Every pair of arms, per metric (Holm over every pair; docs/compare.md, \"Statistics\"):\n")
            out.append("\n".join(lines) + "\n")
        return "\n".join(out)

    def print(self, result: dict) -> None:
        line = (f"recall accuracy {result['accuracy']:.4f} over {result['scored']:,} queries in "
                f"{result['examples']:,} examples ({result['source']})")
        if result.get("chance") is not None:
            line += f"; chance {result['chance']:.4f}"
        print(line)
        if result.get("frontier") is not None:
            half, ends = result.get("pairs_at_half"), pairs_range(result)
            edge = "" if half is None or ends is None else " (at or below the grid's fewest: censored)" \
                if half <= ends[0] else " (at or above the grid's most: censored)" if half >= ends[1] else ""
            print(f"  frontier (mean over the plain-MQAR cells) {result['frontier']:.4f}; pairs at 50% "
                  f"{fmt(half, 1)}{edge}")
        if result.get("learning"):
            g = result["learning"]
            print(f"  learned during training (probe accuracy >= {g['learned_at']} at {g['cell']}): "
                  + (f"step {g['learned_step']}" if g["learned_step"] is not None else
                     f"not by step {g['last_probe_step']}"))
        if len(result["cells"]) > 1 or "accuracy_rebound" in result["cells"][0]:
            for c in result["cells"]:
                extra = (f"  (keys bound again {c['accuracy_rebound']:.4f}, the others {c['accuracy_kept']:.4f})"
                         if "accuracy_rebound" in c else "")
                print(f"  {c['cell']:28} {c['accuracy']:.4f}{' beyond training' if c.get('beyond') else ''}{extra}")
        if "attention_mass" in result:
            a = result["attention_mass"]
            print(f"  attention at the queries of {a.get('cell', 'the first cell')} ({a['queries']}; L1-normalised "
                  "effective map, mean over heads): "
                  + "; ".join(f"layer {m['layer']} on the binding {m['answer_mean']['absolute']:.3f}, elsewhere "
                              f"{m['noise_mean']['absolute']:.3f}" for m in a["layers"]))
        if "attention_roles" in result:
            from ..eval.recall import best_heads

            a = result["attention_roles"]
            print("  the head with the most attention on each role (share of its L1-normalised row; uniform "
                  "map: " + ", ".join(f"{ROLE_LABELS[k]} {v:.3f}" for k, v in a["uniform"].items()) + "):")
            for layer in a["layers"]:
                print(f"    layer {layer['layer']}: " + ", ".join(f"{ROLE_LABELS[k]} h{h} {v:.3f}" for k, (h, v)
                                                                 in best_heads(layer).items()))
        if "attention_output_ratio" in result:
            print("  attention output / residual stream (RMS, at the queries) per layer: "
                  + ", ".join(f"{v:.3f}" for v in result["attention_output_ratio"]["ratio"]))

    def plots(self, ctx: ReportContext, folder: Path) -> dict[str, Path]:
        from ..eval import plots as P

        arms = ctx.all_arms
        if not ctx.ran(self.name) or ctx.result(self.name, arms[0]).get("source") != "generated":
            return {}
        curves: dict = {}
        for a in arms:
            per = [ctx.result(self.name, a, sd)["cells"] for sd in ctx.seeds]
            for i, c in enumerate(per[0]):
                mean = sum(p[i]["accuracy"] for p in per) / len(per)
                curves.setdefault(a, {}).setdefault(f"{c['variant']}, length {c['seq_len']}", []).append(
                    (c["n_pairs"], mean))
        made = {"recall grid": P.plot_recall_grid(curves, folder / "recall_grid.png")}
        made.update(_training_plots(ctx, arms, folder))
        return made


ROLE_LABELS = {"key": "key", "value": "value", "next_pair": "next pair", "recent": "self/recent",
               "elsewhere": "elsewhere"}


def _runs(ctx: ReportContext, task: str, arm: str) -> list[dict]:
    return [ctx.result(task, arm, sd) for sd in ctx.seeds]


def _trains(ctx: ReportContext, arm: str) -> list[dict]:
    return [ctx.train(arm, sd) for sd in ctx.seeds]


def _probed(train: dict, key: str) -> list[dict]:
    """The recall probes of a training record that carry ``key``."""
    return [p for p in train.get("probes") or [] if p.get(key) is not None]


def _mechanism_sections(ctx: ReportContext, task: str, arms: list) -> list[str]:
    """The report's lines on the mechanism per layer: where each layer's heads look from a query (by role),
    and the size of each attention layer's output against the residual stream. Results without them (stored
    by an older difftx) leave them out."""
    from ..eval.recall import ROLES, best_heads

    out = []
    if all("attention_roles" in r for a in arms for r in _runs(ctx, task, a)):
        r0 = ctx.result(task, arms[0])["attention_roles"]
        uniform = {k: sum(r["attention_roles"]["uniform"][k] for r in _runs(ctx, task, arms[0])) / len(ctx.seeds)
                   for k in ROLES}
        rows = []
        for a in arms:
            per = [r["attention_roles"]["layers"] for r in _runs(ctx, task, a)]
            for i in range(len(per[0])):
                best = [best_heads(layers[i]) for layers in per]
                rows.append([a, str(i)] + [f"{sum(b[k][1] for b in best) / len(best):.3f} ("
                                           + ", ".join(f"h{b[k][0]}" for b in best) + ")" for k in ROLES])
        out.append(f"Where each layer's heads look from a query ({r0['queries']} queries of {r0.get('cell', '-')} per "
                   "model): per arm and layer, the head with the most attention on each role (the share of its "
                   "L1-normalised effective row, mean over queries and seeds; in brackets each seed's head). Key: the "
                   "queried key; value: its value; next pair: the following pair's key and value; self/recent: the "
                   "query and the position before it; elsewhere: the rest. In each header, what a uniform map over the "
                   "causal row puts there:\n")
        out.append(table(rows, ["arm", "layer"] + [f"{ROLE_LABELS[k]} (uniform {uniform[k]:.3f})" for k in ROLES]))
    if all("attention_output_ratio" in r for a in arms for r in _runs(ctx, task, a)):
        def mean(values: list) -> str:  # over seeds; '-' where a seed has none
            return "-" if not values or None in values else fmt(sum(values) / len(values))

        rows = []
        for a in arms:
            probed = [_probed(t, "attention_output_ratio") for t in _trains(ctx, a)]
            start = [ps[0]["attention_output_ratio"] if ps and ps[0]["step"] == 0 else None for ps in probed]
            last = [ps[-1]["attention_output_ratio"] if ps else None for ps in probed]
            trained = [r["attention_output_ratio"]["ratio"] for r in _runs(ctx, task, a)]
            for i in range(len(trained[0])):
                rows.append([a, str(i), mean([v and v[i] for v in start]), mean([v and v[i] for v in last]),
                             mean([v[i] for v in trained])])
        out.append("The size of each attention layer's output against the residual stream it is added to: the RMS of "
                   "the attention output over the RMS of the block's input, mean over the queries, then over seeds; at "
                   "initialisation and at the last recall probe (the probe examples), and of the trained model on the "
                   "examples above ('-': not probed):\n")
        out.append(table(rows, ["arm", "layer", "at step 0", "at the last probe", "trained"]))
    return out


def _training_plots(ctx: ReportContext, arms: list, folder: Path) -> dict[str, Path]:
    """Along training, from the recall probes (and λ from the training history): the probe accuracy per arm, the
    attention output / residual ratio per layer and arm, and λ per layer per DIFF arm (every seed faint, the mean
    over seeds bold)."""
    from ..eval import plots as P

    made = {}
    trains = {a: _trains(ctx, a) for a in arms}
    acc = {a: [([p["step"] for p in ps], [next(iter(p["recall"].values())) for p in ps])
               for t in trains[a] for ps in [_probed(t, "recall")] if ps] for a in arms}
    acc = {a: seeds for a, seeds in acc.items() if seeds}
    if acc:
        cell = next(iter(_probed(trains[next(iter(acc))][0], "recall")[0]["recall"]))
        made["recall probe accuracy during training"] = P.plot_seed_curves(
            acc, folder / "recall_probe.png", ylabel=f"recall accuracy ({cell})",
            title="Associative recall during training (probe examples)")
    ratio: dict = {}
    for a in arms:
        for t in trains[a]:
            ps = _probed(t, "attention_output_ratio")
            for i in range(len(ps[0]["attention_output_ratio"]) if ps else 0):
                ratio.setdefault(a, {}).setdefault(f"L{i}", []).append(
                    ([p["step"] for p in ps], [p["attention_output_ratio"][i] for p in ps]))
    if ratio:
        made["attention output against the residual during training"] = P.plot_seed_panels(
            ratio, folder / "recall_output_ratio.png", ylabel="RMS(attention out) / RMS(residual)", logy=True,
            title="Each layer's attention output against the residual stream (recall probe queries)")
    lam: dict = {}
    for a in arms:
        for t in trains[a]:
            points = [(p["step"], p["lambda"]) for p in _probed(t, "lambda") if p["step"] == 0]  # initialisation
            points += [(h["step"], h["lambda"]) for h in t.get("history") or [] if h.get("lambda")]
            for i in range(len(points[0][1]) if points else 0):
                if any(v[i] is not None for _, v in points):
                    lam.setdefault(a, {}).setdefault(f"L{i}", []).append(([st for st, _ in points],
                                                                          [v[i] for _, v in points]))
    if lam:
        made["lambda per layer during training (recall)"] = P.plot_seed_panels(
            lam, folder / "recall_lambda.png", ylabel="λ",
            title="λ per layer during training (step 0: initialisation)")
    return made


def _learning(subject, learned_at: float) -> Optional[dict]:
    """When a compare model learned recall, from the recall probes of its training record (None without)."""
    rec = subject.history() if subject.is_compare_model else None
    probes = [p for p in (rec.probes or []) if p.get("recall")] if rec is not None else []
    if not probes:
        return None
    cell = next(iter(probes[0]["recall"]))
    return {"cell": cell, "learned_at": learned_at, "learned_step": first_learned_step(probes, cell, learned_at,
                                                                                        key="recall"),
            "last_probe_step": probes[-1]["step"], "steps": [p["step"] for p in probes],
            "accuracy": [p["recall"][cell] for p in probes]}


def _cell_summary(res: dict) -> dict:
    """A cell's accuracy as the mean of its examples' accuracies (each example counts once), pooled too."""
    rec = res["records"]
    per = [c / n for c, n in zip(rec["correct"], rec["labelled"])]
    out = {"accuracy": sum(per) / len(per), "pooled": res["accuracy"], "examples": res["examples"]}
    for k in ("accuracy_rebound", "accuracy_kept"):
        if k in res:
            out[k] = res[k]
    return out


def _beyond(L: int, P: int, train_len: Optional[int], train_pairs: Optional[list]) -> Optional[bool]:
    if train_len is None:
        return None
    return L > train_len or P > max(train_pairs)


def _learned_text(learning: Optional[dict]) -> str:
    if not learning:
        return "-"
    at = learning["learned_step"]
    return str(at) if at is not None else f">{learning['last_probe_step']}"


def _last_layer_mass(r: dict) -> Optional[float]:
    a = r.get("attention_mass")
    return a["layers"][-1]["answer_mean"]["absolute"] if a and a.get("layers") else None


def frontier(cells: list[dict]) -> Optional[float]:
    """The mean accuracy over the plain-MQAR cells (None without one)."""
    got = [c["accuracy"] for c in cells if c.get("variant") == FIRST_VARIANT]
    return sum(got) / len(got) if got else None


def crossing(pairs: list, accuracy: list, level: float = 0.5) -> float:
    """The pair count where ``accuracy`` (against ascending ``pairs``) first falls through ``level``,
    interpolated linearly in log2(pairs); censored at the grid's ends (the fewest pairs when even they are
    below, the most when none is)."""
    if accuracy[0] < level:
        return float(pairs[0])
    for i in range(1, len(pairs)):
        if accuracy[i] < level:
            a0, a1 = accuracy[i - 1], accuracy[i]
            x0, x1 = math.log2(pairs[i - 1]), math.log2(pairs[i])
            return float(2 ** (x0 + (a0 - level) / (a0 - a1) * (x1 - x0)))
    return float(pairs[-1])


def pairs_range(r: dict) -> Optional[tuple[float, float]]:
    """The range :func:`pairs_at_half` lies in (it is censored at the grid's ends): the fewest and the most
    pairs of the plain-MQAR cells."""
    got = [c["n_pairs"] for c in r.get("cells", []) if c.get("variant") == FIRST_VARIANT]
    return (float(min(got)), float(max(got))) if got else None


def pairs_at_half(cells: list[dict]) -> Optional[float]:
    """The geometric mean over lengths of :func:`crossing` on the plain-MQAR cells (None without one)."""
    by_len: dict = {}
    for c in cells:
        if c.get("variant") == FIRST_VARIANT:
            by_len.setdefault(c["seq_len"], []).append((c["n_pairs"], c["accuracy"]))
    if not by_len:
        return None
    logs = [math.log2(crossing([p for p, _ in v], [a for _, a in v])) for v in (sorted(x) for x in by_len.values())]
    return float(2 ** (sum(logs) / len(logs)))


TASK = RecallTask()
