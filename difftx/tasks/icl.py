"""In-context learning order robustness (paper section 3.5) on the synthetic classification task
a compare model was trained on: task instances, each one label map and one demonstration set
shown in several orders (random, class-sorted, alternating by class) and scored on many queries;
the spread of accuracy over the orders of one instance (best - worst), averaged over instances."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import Metric, Task, positive, setting
from .common import EVAL_SEED
from .reporting import ReportContext
from .subject import BlockKind, register_block


@dataclass(frozen=True)
class ICLSettings:
    instances: int = setting(50, "task instances (one label map and demonstration set each)")
    queries: int = setting(20, "queries per instance, each scored in every order")
    orders: int = setting(5, "demonstration orders per order kind")

    def __post_init__(self) -> None:
        positive(self, "instances", "queries")
        if not isinstance(self.orders, int) or self.orders < 2:
            raise ValueError(f"ICLSettings.orders: need at least 2 orders to measure robustness, got {self.orders!r}")


class ICLTask(Task):
    name = "icl"
    title = "In-context learning order robustness"
    help = "ICL accuracy over demonstration orders and its best - worst spread (compare models with ICL training)"
    Settings = ICLSettings

    def applies(self, subject, settings) -> Optional[str]:
        if subject.icl is not None:
            return None
        if subject.from_source:
            from .common import FROM_SOURCE

            return FROM_SOURCE.format(task="ICL")
        if subject.text is not None and subject.needle is None:
            return ("the model was trained without ICL batches (compare --data trains on the text alone; --synthetic "
                    "adds the ICL task)")
        if subject.needle is None and not subject.is_compare_model:
            return "a text model has no synthetic ICL task (train one with `difftx compare --set icl_every=4`)"
        return "the model was trained without ICL batches (icl_every = 0; `--set icl_every=4` adds them)"

    def run(self, subject, s: ICLSettings, *, progress: bool = False) -> dict:
        from ..eval.icl import ORDER_KINDS, evaluate_icl_instances

        res = evaluate_icl_instances(subject.model, subject.icl, n_instances=s.instances, n_queries=s.queries,
                                     n_orders=s.orders, seed=EVAL_SEED, progress=progress)
        res["records"] = {kind: {"instance_accuracy": res[kind].pop("instance_accuracy"),
                                 "instance_spread": res[kind].pop("instance_spread")} for kind in ORDER_KINDS}
        return res

    def metrics(self, settings) -> list[Metric]:
        from ..eval.icl import ORDER_KINDS

        out = []
        for kind in ORDER_KINDS:
            out.append(Metric(f"icl_{kind}_accuracy", f"ICL accuracy, {kind} orders (mean over orders)", False,
                              lambda r, k=kind: r[k]["mean"],
                              per_example=lambda r, k=kind: r["records"][k]["instance_accuracy"], bounds=(0.0, 1.0)))
            # best - worst of a model at chance is sampling noise, not robustness: not compared then
            out.append(Metric(f"icl_{kind}_best_minus_worst", f"ICL best - worst accuracy over {kind} orders of one "
                              "instance", True,
                              lambda r, k=kind: r[k]["best_minus_worst"] if r[k]["above_chance"] else None,
                              per_example=lambda r, k=kind: r["records"][k]["instance_spread"], bounds=(0.0, 1.0)))
        return out

    def report(self, ctx: ReportContext) -> str:
        from ..eval.icl import ORDER_KINDS

        head = f"## {self.title}\n\n"
        if not ctx.ran(self.name):
            return head + f"Not run: {ctx.skipped(self.name)}.\n"
        r0, s = ctx.result(self.name), ctx.settings(self.name)
        task = r0["config"]["task"]
        out = [head + f"A synthetic classification task ({task['n_classes']} classes, {task['n_demos']} "
               f"demonstrations, chance {r0['chance']:.2f}). {s['instances']} task instances, each one label map and "
               f"one demonstration set shown in {s['orders']} orders of each kind (random, class-sorted, alternating "
               f"by class) and scored on {s['queries']} queries; best - worst is the spread of accuracy over the "
               "orders of one instance, averaged over instances (lower is more robust). Mean over seeds [95% CI]:\n",
               ctx.comparison_table(ctx.metric_keys(self.name))]
        runs = [(sd, a, k) for sd in ctx.seeds for a in ctx.arms for k in ORDER_KINDS]
        low = [f"{ctx.name(a)} seed {sd} ({k})" for sd, a, k in runs
               if not ctx.result(self.name, a, sd)[k]["above_chance"]]
        rule = ("(mean accuracy within two binomial standard errors of chance): its best - worst is sampling noise, "
                "so best - worst is compared only where every seed of both models is above chance")
        if len(low) == len(runs):
            out.append(f"**No model learned the ICL task** in any seed or order kind {rule}.\n")
        elif low:
            out.append(f"**Not above chance** {rule}: " + ", ".join(low) + ".\n")
        return "\n".join(out)

    def print(self, r: dict) -> None:
        from ..eval.icl import ORDER_KINDS

        c = r["config"]
        print(f"ICL order robustness: {c['n_instances']} instances x {c['n_queries']} queries, {c['n_orders']} "
              f"orders per kind, chance {r['chance']:.2f}; best-worst: spread over the orders of one instance")
        for kind in (k for k in ORDER_KINDS if k in r):
            k = r[kind]
            line = (f"{kind:11}  mean accuracy {k['mean']:.3f}  best-worst {k['best_minus_worst']:.3f}  above chance: "
                    f"{'yes' if k['above_chance'] else 'no'}")
            if not k["above_chance"]:
                line += "  (not learned: best-worst is sampling noise, not robustness)"
            print(line)


def _write_block(block, space) -> dict:
    return {"icl_task": block.to_dict() if block is not None else None}


def _read_block(data: dict, before: dict):
    from ..eval.icl import ICLBlock

    return ICLBlock(**data["icl_task"]) if data.get("icl_task") else None


# the ICL training task's block (from its first_id) in compare_task.json
register_block("icl", BlockKind(_write_block, _read_block, lambda block: block.vocab_size, "ICL task"))
TASK = ICLTask()
