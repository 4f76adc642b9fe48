"""Stacked training throughput: K models of one config as one stacked model (difftx.training.stacked)
against the same K models stepped one after the other, in model-steps per CPU-second.

Usage:
    python benchmarks/stack_throughput.py                       # cpu preset's DIFF and baseline, K = 1 2 5 10
    python benchmarks/stack_throughput.py --ks 5 --rounds 20 --arms baseline
    python benchmarks/stack_throughput.py --task needle         # loss on a few answer positions per row
    python benchmarks/stack_throughput.py --general             # also the torch.vmap path of the stack

The models are those of ``difftx compare``'s ``cpu`` preset (D = 64, 2 layers, 2 DIFF heads, its
623-token vocabulary; the baseline is its parameter-matched arm), on batches of 16 x 64 random tokens
(``--batch-size``, ``--seq-len``), one thread (``--threads``). A *model-step* is one optimizer step of
one model as the trainer takes it in one process: forward and loss (the model's ``forward(x, targets=y)``,
with ``--task needle`` on 3-9 random positions per row, the LM head run there alone), backward, per-model
gradient clipping to 1.0, AdamW (``build_optimizer``: foreach, two weight-decay groups) at the schedule's
learning rate, ``zero_grad``. Each model draws its own batches (data preparation is not timed).

``separate``: K ``Transformer`` models, each with its own optimizer, stepped one after the other.
``stacked``: one :class:`~difftx.training.stacked.StackedTransformer` of the K models and
:func:`~difftx.training.stacked.train_step` (the built-in kinds run the tree with leading-K weights).
``general`` (``--general``): the same stack forced onto the path of a kind that overrides a forward hook,
``torch.vmap`` over the one model.

``--malloc tuned`` (the default) first calls :func:`~difftx.training.stacked.tune_allocator`, which keeps
glibc from unmapping freed large blocks (a stack's tensors are K times a model's; fresh mappings cost a page
fault per 4 KiB); it applies to the whole process, so to every candidate. ``--malloc default`` measures
them with glibc's own thresholds, as the one-model trainer runs today.

Rounds alternate the order of the candidates (ABBA), each timed with this process's CPU clock;
``ratio`` is stacked (or general) throughput over separate throughput, the median of the per-round
paired ratios with its distribution-free 95% interval (:func:`difftx.eval.stats.median_interval`),
which a machine whose speed drifts between rounds does not bias. Measured: docs/results.md ("Stacked
seeds: throughput" and later entries).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from difftx import Transformer
from difftx.eval.stats import median_interval
from difftx.training.batches import Batch
from difftx.training.config import TrainConfig
from difftx.training.optim import build_optimizer
from difftx.training.stacked import StackedTransformer, train_step, tune_allocator
from difftx.training.batches import batch_loss_rows

LR = 1e-3  # any value: the step's cost does not depend on it


def arm_configs(arms: list[str]) -> dict:
    from difftx.compare.presets import get_preset

    plan = get_preset("cpu").resolve()
    return {arm: plan.arms[arm] for arm in arms}


def make_batches(cfg, k: int, n: int, batch: int, seq: int, task: str, seed: int) -> list[list[Batch]]:
    """``n`` steps of ``k`` models' batches (``[step][model]``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        step = []
        for _ in range(k):
            tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
            if task == "lm":
                step.append(Batch(tokens, kind="lm"))
                continue
            mask = torch.zeros(batch, seq, dtype=torch.bool)
            for row in range(batch):
                count = int(torch.randint(3, 10, (1,), generator=g))
                mask[row, torch.randperm(seq, generator=g)[:count]] = True
            step.append(Batch(tokens, loss_mask=mask, kind="needle", mask_total=int(mask.sum())))
        out.append(step)
    return out


def one_model_step(model, opt, b: Batch) -> float:
    """The trainer's step of one model in one process."""
    for group in opt.param_groups:
        group["lr"] = LR
    loss = model(b.tokens[:, :-1], targets=b.tokens[:, 1:], **batch_loss_rows(b))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


class Separate:
    def __init__(self, cfg, k: int, tc: TrainConfig):
        self.models = []
        for s in range(k):
            torch.manual_seed(s)
            self.models.append(Transformer(cfg))
        self.opts = [build_optimizer(m, tc) for m in self.models]

    def step(self, batches: list[Batch]) -> None:
        for m, o, b in zip(self.models, self.opts, batches):
            one_model_step(m, o, b)


class Stacked:
    def __init__(self, cfg, k: int, tc: TrainConfig, general: bool = False):
        models = []
        for s in range(k):
            torch.manual_seed(s)
            models.append(Transformer(cfg))
        self.stack = StackedTransformer.from_models(models)
        if general:
            self.stack.native = False  # torch.vmap over the one model, as for a kind that overrides a hook
        self.opt = build_optimizer(self.stack, tc)

    def step(self, batches: list[Batch]) -> None:
        train_step(self.stack, self.opt, [batches], LR, 1.0)


def bench(arm: str, cfg, k: int, args) -> dict:
    tc = TrainConfig(model="test", seq_len=16, warmup_steps=0)  # only its optimizer settings are used
    cands = {"separate": Separate(cfg, k, tc), "stacked": Stacked(cfg, k, tc)}
    if args.general:
        cands["general"] = Stacked(cfg, k, tc, general=True)
    data = make_batches(cfg, k, 4, args.batch_size, args.seq_len, args.task, seed=k)
    times: dict[str, list[float]] = {name: [] for name in cands}
    order = list(cands)
    for r in range(args.warmup + args.rounds):
        batches = data[r % len(data)]
        for name in order:
            t0 = time.process_time()
            cands[name].step(batches)
            if r >= args.warmup:
                times[name].append(time.process_time() - t0)
        order.reverse()
    out = {"arm": arm, "k": k, "params": sum(p.numel() for p in cands["separate"].models[0].parameters())}
    for name, ts in times.items():
        out[name] = {"model_steps_per_cpu_s": k / statistics.median(ts), "median_s": statistics.median(ts)}
        if name != "separate":
            med, lo, hi = median_interval([a / b for a, b in zip(times["separate"], ts)])
            out[name]["ratio"] = {"median": med, "low": lo, "high": hi, "rounds": len(ts)}
    return out


def _fmt_ratio(r: dict) -> str:
    if r["low"] is None:
        return f"{r['median']:.2f} [-]"
    return f"{r['median']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="diff,baseline", help="arms of the cpu preset (comma-separated)")
    p.add_argument("--ks", default="1,2,5,10", help="stack sizes K (comma-separated)")
    p.add_argument("--rounds", type=int, default=12, help="timed rounds per K (each steps every candidate once)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--task", default="lm", choices=["lm", "needle"],
                   help="lm: loss on every token; needle: on 3-9 random positions per row (loss masks)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--general", action="store_true",
                   help="also time the stack's general path (torch.vmap over the one model)")
    p.add_argument("--malloc", default="tuned", choices=["tuned", "default"],
                   help="tuned: difftx.training.stacked.tune_allocator() first (both candidates: one process); "
                        "default: glibc's own thresholds")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tuned = args.malloc == "tuned" and tune_allocator()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    ks = [int(k) for k in args.ks.split(",")]
    cfgs = arm_configs(arms)
    print(f"# stacked vs separate training, cpu preset models, batch {args.batch_size} x {args.seq_len}, task "
          f"{args.task}, {torch.get_num_threads()} thread(s), CPU clock, {args.rounds} rounds (ABBA), "
          f"malloc {'tuned' if tuned else 'default'}, torch {torch.__version__}")
    print("| arm | K | separate model-steps/CPU-s | stacked model-steps/CPU-s | stacked/separate [95%] |"
          + (" general model-steps/CPU-s | general/separate [95%] |" if args.general else ""))
    print("|---|---:|---:|---:|---|" + ("---:|---|" if args.general else ""))
    results = []
    for arm in arms:
        for k in ks:
            r = bench(arm, cfgs[arm], k, args)
            results.append(r)
            row = (f"| {arm} | {k} | {r['separate']['model_steps_per_cpu_s']:.1f} | "
                   f"{r['stacked']['model_steps_per_cpu_s']:.1f} | {_fmt_ratio(r['stacked']['ratio'])} |")
            if args.general:
                row += f" {r['general']['model_steps_per_cpu_s']:.1f} | {_fmt_ratio(r['general']['ratio'])} |"
            print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
