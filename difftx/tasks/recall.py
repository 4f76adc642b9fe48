"""Multi-query associative recall (MQAR, Zoology's definition, and its noise variants; see
:mod:`difftx.eval.recall`): greedy accuracy at every queried position, on examples generated from
the settings or read from a file (``difftx eval recall MODEL --examples FILE``).

Token ids are the model's own: a model trained on MQAR of ``V`` tokens is scored on MQAR of ``V``
tokens. A compare model is trained on other tasks, so only a file of examples applies to it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import Metric, Task, positive, setting
from .common import EVAL_SEED


@dataclass(frozen=True)
class RecallSettings:
    examples: str = setting("", "a JSONL file of examples, one {\"inputs\": [...], \"labels\": [...]} a line "
                                "(labels[i]: the token after inputs[0..i]; -100: not scored); default: generated "
                                "from the settings below")
    vocab_size: int = setting(0, "vocabulary of generated examples: keys from 1..V/2-1, values from V/2..V-1 (0: the "
                                 "model's vocabulary)")
    seq_len: int = setting(64, "tokens per generated example (even)")
    n_pairs: int = setting(8, "key-value pairs per generated example, each queried once")
    variant: str = setting("mqar", "mqar, or reassigned (some keys bound again with a new value; the query asks for "
                                   "the latest)")
    reassign: float = setting(0.5, "reassigned: the share of keys bound again")
    power_a: float = setting(0.01, "the gap law of the queries: P(gap g) ~ a (g+1)^(a-1); 1 is uniform")
    samples: int = setting(256, "generated examples")
    attention_samples: int = setting(64, "generated examples whose attention to the queried key is measured (0: none)")
    batch_size: int = setting(64, "examples per forward pass")

    def __post_init__(self) -> None:
        positive(self, "seq_len", "n_pairs", "samples", "batch_size")
        positive(self, "vocab_size", "attention_samples", allow_zero=True)
        if not self.examples:
            self.spec(self.vocab_size or 1 << 20)  # every other field checked now (the model gives V later)

    def spec(self, vocab_size: int):
        from ..eval.recall import RecallSpec

        return RecallSpec(vocab_size=vocab_size, seq_len=self.seq_len, n_pairs=self.n_pairs, variant=self.variant,
                          power_a=self.power_a, reassign=self.reassign)


class RecallTask(Task):
    name = "recall"
    title = "Multi-query associative recall"
    help = "associative recall (MQAR, Zoology's definition, and variants): accuracy at every query; --examples FILE"
    description = ("Greedy accuracy at every scored position of multi-query associative recall examples: generated "
                   "(keys from the lower half of the vocabulary, values from the upper half, the pairs first, each "
                   "key queried once with power-law gaps, random tokens elsewhere; variant reassigned binds some keys "
                   "again) or read from a JSONL file (--examples), one example a line, all of one length. --json "
                   "keeps each example's labelled and correct counts")
    Settings = RecallSettings

    def applies(self, subject, s: RecallSettings) -> Optional[str]:
        if not s.examples and subject.is_compare_model:
            return ("a compare model is trained on needle, text and ICL batches, not on associative recall; give "
                    "--examples FILE to score it on examples in its own token ids")
        return None

    def run(self, subject, s: RecallSettings, *, progress: bool = False) -> dict:
        from ..eval.recall import attention_mass, generate, read_examples, score

        model = subject.model
        if s.examples:
            examples = read_examples(s.examples, vocab_size=model.config.vocab_size)
            spec = None
        else:
            spec = s.spec(s.vocab_size or model.config.vocab_size)
            if spec.vocab_size > model.config.vocab_size:
                raise ValueError(f"recall: vocab_size {spec.vocab_size} exceeds the model's {model.config.vocab_size}")
            examples = generate(spec, s.samples, seed=EVAL_SEED)
        device = next(model.parameters()).device
        res = score(model, examples, batch_size=s.batch_size, device=device)
        if spec is not None and s.attention_samples:
            res["attention_mass"] = attention_mass(model, examples.head(s.attention_samples), device=device)
        return {**res, "spec": None if spec is None else spec.to_dict(),
                "chance": None if spec is None else 1.0 / (spec.vocab_size - spec.vocab_size // 2)}

    def metrics(self, settings) -> list[Metric]:
        def per_example(r):
            rec = r["records"]
            return [c / n for c, n in zip(rec["correct"], rec["labelled"])]

        return [Metric("recall_accuracy", "associative recall accuracy (all queries)", False,
                       lambda r: r["accuracy"], per_example=per_example, bounds=(0.0, 1.0))]

    def print(self, result: dict) -> None:
        line = (f"recall accuracy {result['accuracy']:.4f} over {result['scored']:,} queries in "
                f"{result['examples']:,} examples of {result['seq_len']} tokens ({result['source']})")
        if result.get("chance") is not None:
            line += f"; chance {result['chance']:.4f}"
        print(line)
        if "accuracy_rebound" in result:
            print(f"  keys bound again: {result['accuracy_rebound']:.4f}; the others: {result['accuracy_kept']:.4f}")
        if "attention_mass" in result:
            a = result["attention_mass"]
            print(f"  attention at the queries ({a['queries']}; L1-normalised effective map, mean over heads): "
                  + "; ".join(f"layer {m['layer']} on the binding {m['answer_mean']['absolute']:.3f}, elsewhere "
                              f"{m['noise_mean']['absolute']:.3f}" for m in a["layers"]))


TASK = RecallTask()
