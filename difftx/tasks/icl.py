"""In-context learning order robustness (paper section 3.5) on the synthetic classification task
a compare model was trained on: accuracy of the same episodes in several demonstration orders
(random; alternating by class) and the best - worst spread over orders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import EVAL_SEED, Metric, Task, positive, setting
from .reporting import NAMES, ReportContext


@dataclass(frozen=True)
class ICLSettings:
    episodes: int = setting(100, "episodes, each shown in every order")
    orders: int = setting(5, "demonstration orders per order kind")

    def __post_init__(self) -> None:
        positive(self, "episodes")
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
        if subject.needle is None:
            return "a text model has no synthetic ICL task (train one with `difftx compare --set icl_every=4`)"
        return "the model was trained without ICL batches (icl_every = 0; `--set icl_every=4` adds them)"

    def run(self, subject, s: ICLSettings, *, progress: bool = False) -> dict:
        from ..eval.icl import ORDER_KINDS, evaluate_icl_order

        res = evaluate_icl_order(subject.model, subject.icl, n_episodes=s.episodes, n_orders=s.orders,
                                 seed=EVAL_SEED, progress=progress)
        res["records"] = {kind: res[kind].pop("correct") for kind in ORDER_KINDS if kind in res}
        return res

    def metrics(self, settings) -> list[Metric]:
        from ..eval.icl import ORDER_KINDS

        out = []
        for kind in ORDER_KINDS:
            out.append(Metric(f"icl_{kind}_accuracy", f"ICL accuracy, {kind} orders (mean over orders)", False,
                              lambda r, k=kind: r[k]["mean"], per_example=lambda r, k=kind: _per_episode(r, k)))
            # best - worst of a model at chance is sampling noise, not robustness: not compared then
            out.append(Metric(f"icl_{kind}_best_minus_worst", f"ICL best - worst accuracy over {kind} orders", True,
                              lambda r, k=kind: r[k]["best_minus_worst"] if r[k]["above_chance"] else None))
        return out

    def report(self, ctx: ReportContext) -> str:
        from ..eval.icl import ORDER_KINDS

        head = f"## {self.title}\n\n"
        if not ctx.ran(self.name):
            return head + f"Not run: {ctx.skipped(self.name)}.\n"
        r0, s = ctx.result(self.name), ctx.settings(self.name)
        task = r0["config"]["task"]
        out = [head + f"A synthetic classification task whose label map is drawn per sequence ({task['n_classes']} "
               f"classes, {task['n_demos']} demonstrations, chance {r0['chance']:.2f}). The same {s['episodes']} "
               f"episodes are shown in {s['orders']} orders of each kind; best - worst is the spread of accuracy over "
               "those orders (lower is more robust). Mean over seeds [95% CI]:\n",
               ctx.comparison_table(ctx.metric_keys(self.name))]
        runs = [(sd, a, k) for sd in ctx.seeds for a in ctx.arms for k in ORDER_KINDS]
        low = [f"{NAMES[a]} seed {sd} ({k})" for sd, a, k in runs
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
        print(f"ICL order robustness: {c['n_episodes']} episodes, {c['n_orders']} orders per kind, chance "
              f"{r['chance']:.2f}")
        for kind in (k for k in ORDER_KINDS if k in r):
            k = r[kind]
            line = (f"{kind:11}  mean accuracy {k['mean']:.3f}  best-worst {k['best_minus_worst']:.3f}  above chance: "
                    f"{'yes' if k['above_chance'] else 'no'}")
            if not k["above_chance"]:
                line += "  (not learned: best-worst is sampling noise, not robustness)"
            print(line)


def _per_episode(r: dict, kind: str) -> list[float]:
    """Each episode's accuracy over the orders (its mean over episodes is the kind's mean)."""
    orders = r["records"][kind]
    return [sum(col) / len(orders) for col in zip(*orders)]


TASK = ICLTask()
