"""difftx compare: end to end on the smoke preset, resume, paired data order, the eval subcommand."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from difftx.cli import main
from difftx.compare import get_preset, run_compare
from difftx.compare.schema import from_json, read_results, results_json, to_json, validate_results
from difftx.compare.summary import DIFFERENT_RUNS, ONE_PER_STACK
from difftx.compare.stream import CompareStream
from difftx.compare.stream import batch_for_step, lm_streams
from difftx.tasks.training import first_learned_step

# the smoke preset trimmed further to keep the whole module well under a minute
FAST = {"steps": 6, "warmup_steps": 1, "log_every": 3, "probe_every": 3, "probe_samples": 1,
        "tasks": {"needle": {"samples_per_cell": 1, "grid": ((1, 1), (2, 2)), "depths": (0.0, 1.0),
                             "heatmap_cell": (2, 2)},
                  "attention": {"samples": 1, "cells": ((1, 1), (2, 2)), "depths": (0.0,)}, "lm": {"windows": 2},
                  "outliers": {"tokens": 64},
                  "quant": {"bits": (4,), "needle_samples": 1, "cells": ((1, 1), (2, 2)), "depths": (0.0, 1.0)},
                  "icl": {"instances": 2, "queries": 2, "orders": 2}, "diagnostics": {"cell": (2, 2)}}}


def as_sets(overrides: dict, prefix: str = "") -> list[str]:
    """``--set`` arguments (dotted paths) for nested overrides."""
    out = []
    for k, v in overrides.items():
        if isinstance(v, dict):
            out += as_sets(v, f"{prefix}{k}.")
        else:
            out.append(f"--set={prefix}{k}={json.dumps(v)}")
    return out



def primary(res: dict) -> dict:
    """The DIFF-vs-baseline comparisons of a ``results.json`` object."""
    return res["comparisons"]["diff vs baseline"]["metrics"]

@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compare") / "run"
    sets = as_sets(FAST)
    rc = main(["compare", "--preset", "smoke", "--seeds", "2", "--out", str(out), "--workers", "1",
               "--no-progress", *sets])
    assert rc == 0
    return out


def test_outputs_and_schema(smoke):
    for name in ("results.json", "report.md", "compare.json"):
        assert (smoke / name).is_file(), name
    text = (smoke / "results.json").read_text()
    res = json.loads(text, parse_constant=lambda c: pytest.fail(f"results.json holds {c}: not strict JSON"))
    validate_results(res)
    assert res["seeds"] == [0, 1] and res["schema_version"] == 5
    assert json.loads((smoke / "compare.json").read_text())["schema_version"] == 3  # the folder's version
    assert res["preset"]["model"] == {"dim": 32, "n_layers": 1, "n_heads": 1, "init": "normal"}
    assert res["preset"]["primary"] == ["diff", "baseline"]
    # the preset's description speaks of the preset as written: the setup says what --set changed
    assert "(the preset as written; set here: steps 6, preset 12;" in (smoke / "report.md").read_text()
    new = read_results(smoke / "results.json")
    assert to_json(new) == {**res, "schema_version": 5}  # read and written back: the same file
    # a version 4 file (the model's fields flat in the preset, no primary pair) reads as the same results
    old = json.loads(text)
    old["schema_version"] = 4
    old["preset"].pop("primary")
    old["preset"].update(old["preset"].pop("model"))
    (smoke.parent / "v4.json").write_text(json.dumps(old))
    v4 = read_results(smoke.parent / "v4.json")
    assert v4.preset == new.preset and to_json(v4) == to_json(new)
    # a version 3 file (DIFF vs baseline under "comparison" with flat per-arm fields, the other pairs under
    # "arm_comparisons", arms without labels) reads as the same results
    old["schema_version"] = 3
    pairs = old.pop("comparisons")
    first = pairs.pop("diff vs baseline")["metrics"]
    for c in first.values():
        c.update({"diff": c["values"]["diff"], "baseline": c["values"]["baseline"], "diff_mean": c["means"]["diff"],
                  "baseline_mean": c["means"]["baseline"], "diff_ci": c["cis"]["diff"],
                  "baseline_ci": c["cis"]["baseline"]})
    old["comparison"], old["arm_comparisons"] = first, {k: c["metrics"] for k, c in pairs.items()}
    for a in old["arms"].values():
        del a["label"], a["description"]
    (smoke.parent / "v3.json").write_text(json.dumps(old))
    v3 = read_results(smoke.parent / "v3.json")
    assert v3.comparisons == new.comparisons and v3.arms == new.arms and v3.runs == new.runs
    # a version 2 file (before the mean stood beside the verdict) still reads
    old["schema_version"] = 2
    for comps in [old["comparison"], *old.get("arm_comparisons", {}).values()]:
        for c in comps.values():
            for k in ("mean_p_adjusted", "mean_established", "seeds_for_mean"):
                c.pop(k, None)
    (smoke.parent / "v2.json").write_text(json.dumps(old))
    assert read_results(smoke.parent / "v2.json").primary.key == "diff vs baseline"
    old["schema_version"] = 1
    (smoke.parent / "v1.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="results schema version 1; this difftx reads versions 2, 3, 4, 5"):
        read_results(smoke.parent / "v1.json")
    # the smoke model has one head per layer: no pair of heads, so head redundancy is null with its reason
    diag = res["runs"]["0"]["baseline"]["tasks"]["diagnostics"]
    assert diag["head_redundancy"] == [None] or diag["head_redundancy"][0] is not None
    assert res["runs"]["0"]["diff"]["tasks"]["diagnostics"]["head_redundancy"] == [None]
    assert "single head" in res["runs"]["0"]["diff"]["tasks"]["diagnostics"]["null_reasons"]["head_redundancy"]
    assert res["arms"]["diff"]["config"]["attention"] == "diff"
    assert res["arms"]["baseline"]["config"]["attention"] == "standard"
    # parameter-matched: equal up to lambda vectors and subln gains
    n_d, n_b = res["arms"]["diff"]["parameters"], res["arms"]["baseline"]["parameters"]
    assert 0 < n_d - n_b < 0.01 * n_b
    for key in ("lm_nll", "needle_1_1", "needle_2_2", "attn_noise_1_1", "outlier_logit_top1",
                "icl_random_accuracy", "icl_alternating_accuracy"):
        c = primary(res)[key]
        assert c["paired"]["n"] == 2 and c["verdict"]
        assert abs(c["paired"]["mean"] - (sum(c["values"]["diff"]) - sum(c["values"]["baseline"])) / 2) < 1e-9
    pngs = sorted(p.name for p in (smoke / "plots").glob("*.png"))
    assert {"needle_accuracy.png", "attention_to_answer.png", "outliers.png", "lambda_per_layer.png",
            "needle_loss.png", "quant_nll.png"} <= set(pngs)
    for rel in res["plots"].values():
        assert (smoke / rel).stat().st_size > 1000
    report = (smoke / "report.md").read_text()
    assert "0.85" in report and "**Scale.**" in report  # the paper's numbers, labelled as another scale
    assert "no detectable difference" in report or "DIFF is" in report or "not compared" in report
    # the answer first: at most three lines, then the verdict table, one line of method, then the setup
    head = report[:report.index("## Verdicts\n")].splitlines()
    assert head[0].startswith("# DIFF vs parameter-matched Transformer") and len([x for x in head[1:] if x]) <= 3
    assert head[2].startswith("**No verdict") and "2 paired seeds" in head[4] and head[6].startswith("Regime: ")
    # 2 windows of the bundled validation split (its 4 works) lie in 2 documents: too few to be across documents
    assert "held-out LM intervals over windows of this one text (the windows lie in 2 documents" in head[6]
    table = report[report.index("## Verdicts\n"):report.index("## Setup")]
    assert "| pair | metric | difference: mean [95%], or mean; median [95%] | Holm p | verdict |" in table
    nll = primary(res)["lm_nll"]["paired"]  # an unbounded metric's printed interval is of the median seed difference
    assert nll["interval_of"] == "median" and "median" in nll and primary(res)["needle_1_1"]["paired"]["interval_of"] \
        == "mean"
    assert "| DIFF - baseline | LM NLL (held-out) | " in table and "too few seeds: 2 of 6" in table
    assert table.count("Method, in one line") == 1 and "`docs/compare.md`" in table and "**Statistics.**" not in report
    for c in primary(res).values():  # gated comparisons carry no verdict of direction
        assert (c["gated"] is None) or (c["better"] is None and ("not compared" in c["verdict"]
                                                                 or "not measured" in c["verdict"]))
    assert {c["family"] for c in primary(res).values()} == {"primary", "exploratory"}
    assert "paper" in report
    assert ("Neither model has learned retrieval" in report) == (primary(res)["needle_1_1"]["gated"] is not None)
    assert "## In-context learning order robustness" in report
    assert "## Training" in report and "needle_probe.png" in pngs
    probes = res["runs"]["1"]["baseline"]["train"]["probes"]
    assert [p["step"] for p in probes] == [3, 6] and set(probes[0]["accuracy"]) == {"1/1", "2/2"}
    assert all(len(p["max_attention_logit"]) == 1 and p["max_attention_logit"][0] > 0 for p in probes)  # per layer
    # cost and stability: throughput, spikes and the largest attention logit are compared per seed
    assert "### Cost and stability" in report
    assert {"loss_vs_time.png", "lambda_during_training.png", "max_attention_logit.png"} <= set(pngs)
    for key in ("train_tokens_per_s", "grad_spikes", "max_attention_logit"):
        assert primary(res)[key]["family"] == "exploratory" and len(primary(res)[key]["values"]["diff"]) == 2
    train = res["runs"]["0"]["diff"]["tasks"]["training"]
    last = res["runs"]["0"]["diff"]["train"]["history"][-1]
    assert train["cost"]["tokens"] == last["tokens"] > 0 and train["cost"]["time_s"] == last["time_s"] > 0
    assert train["stability"]["final_lambda"] == last["lambda"]
    learned = [first_learned_step(r[k]["train"]["probes"], "1/1", 0.9) for r in res["runs"].values() for k in r]
    assert (primary(res)["needle_learned_step"]["gated"] is None) == any(x is not None for x in learned)
    icl = res["runs"]["0"]["diff"]["tasks"]["icl"]
    orders = FAST["tasks"]["icl"]["orders"]
    assert [len(a) for a in icl["random"]["accuracy"]] == [orders] * 2  # instances x orders
    assert len(icl["records"]["class_sorted"]["instance_spread"]) == 2  # per instance
    for o in ("random", "class_sorted", "alternating"):  # best - worst: compared only where every model learned it
        learned = all(r[k]["tasks"]["icl"][o]["above_chance"] for r in res["runs"].values() for k in r)
        assert (f"icl_{o}_best_minus_worst" in primary(res)) == learned
    chance = [r[k]["tasks"]["icl"][o]["above_chance"] for r in res["runs"].values() for k in r
              for o in ("random", "class_sorted", "alternating")]
    assert ("No model learned the ICL task" in report) == (not any(chance))
    assert ("Not above chance" in report) == (any(chance) and not all(chance))
    assert "batches: 50% needle, 33.3% LM (Shakespeare bytes), 16.7% ICL" in report


def test_cli_rejects_unknown_preset_fields(tmp_path, capsys):
    assert main(["compare", "--preset", "smoke", "--out", str(tmp_path / "x"), "--set", "stepz=3"]) == 2
    assert "stepz" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_schema_checker_rejects_broken_results(smoke):
    res = json.loads((smoke / "results.json").read_text())
    broken = json.loads(json.dumps(res))
    del broken["runs"]["1"]["baseline"]["tasks"]["quant"]
    with pytest.raises(ValueError, match="quant"):
        validate_results(broken)
    broken = json.loads(json.dumps(res))
    broken["comparisons"]["diff vs baseline"]["metrics"]["lm_nll"]["values"]["diff"] = [1.0]
    with pytest.raises(ValueError, match="one value per seed"):
        validate_results(broken)


def test_resume_does_not_redo_finished_parts(smoke):
    marker = smoke / "seed0" / "diff" / "train.json"
    before = marker.stat().st_mtime_ns
    (smoke / "seed1" / "baseline" / "evals" / "needle.json").unlink()
    res = run_compare("smoke", 2, smoke, progress=False, workers=1, **FAST)
    assert marker.stat().st_mtime_ns == before
    assert not any(d["trained"] for d in res.get("this_run").values())
    assert res.get("this_run")["seed1/baseline"]["evaluated"] == ["needle"]
    assert all(not d["evaluated"] for k, d in res.get("this_run").items() if k != "seed1/baseline")
    validate_results(json.loads(results_json(res)))


def test_other_settings_in_the_same_folder_are_refused(smoke):
    with pytest.raises(ValueError, match="compare.json"):
        run_compare("smoke", 2, smoke, progress=False, workers=1, **{**FAST, "steps": 7})
    # execution settings (threads, workers, device) may change on resume
    res = run_compare("smoke", 2, smoke, progress=False, workers=1, threads=1, **FAST)
    assert not any(d["trained"] or d["evaluated"] for d in res.get("this_run").values())


def test_paired_data_order_depends_on_the_seed_only():
    plan = get_preset("smoke", **FAST).resolve()
    space, mix = plan.space, plan.mixture
    lm = lm_streams()[0]

    def batches(seed):
        rng = random.Random(f"difftx-compare-data:{seed}")
        return [batch_for_step(s, mix, space, rng, lm) for s in range(1, 7)]

    a, b, c = batches(0), batches(0), batches(1)
    assert [x[0] for x in a] == ["needle", "needle", "lm", "icl", "needle", "lm"]
    assert all(torch.equal(x[1], y[1]) for x, y in zip(a, b))
    assert not all(torch.equal(x[1], y[1]) for x, y in zip(a, c))
    # the trainer's batch source gives the same batches, the same for both arms of a seed (the
    # stream knows nothing of the model)
    loader = CompareStream(mix, space, 0, lm).make_loader(batch_size=mix.batch_size)
    for kind, tokens, mask, _ in a:
        got = loader.next_batch()
        assert got.kind == kind and torch.equal(got.tokens, tokens)
        assert (got.loss_mask is None) == (mask is None) and (mask is None or torch.equal(got.loss_mask, mask))
    assert int(a[2][1].min()) >= space.block("lm").first_id  # LM bytes live past the needle vocabulary
    assert int(a[0][1].max()) < space.block("lm").first_id
    assert int(a[3][1].min()) >= space.block("icl").first_id > int(a[2][1].max())  # ICL ids past the bytes
    assert int(a[3][1].max()) < space.vocab_size


def test_both_arms_of_a_seed_train_on_the_same_batches(tmp_path, monkeypatch):
    """Recorded where the trainer draws them: DIFF and its baseline get identical batches (tokens
    and loss masks) in the same order; another seed gets others."""
    from difftx.compare import stream as stream_mod
    from difftx.compare.train import train_model

    seen: list = []
    real = stream_mod.CompareLoader.next_batch

    def recording(self):
        b = real(self)
        seen.append((b.kind, b.tokens.clone(), None if b.loss_mask is None else b.loss_mask.clone()))
        return b

    monkeypatch.setattr(stream_mod.CompareLoader, "next_batch", recording)
    p = get_preset("smoke", **{**FAST, "probe_every": 0})
    runs = {}
    for arm, seed in (("diff", 0), ("baseline", 0), ("diff", 1)):
        seen.clear()
        train_model(arm, p.resolve(), seed, tmp_path / f"{arm}{seed}", progress=False)
        runs[arm, seed] = list(seen)
    a, b, c = runs["diff", 0], runs["baseline", 0], runs["diff", 1]
    assert len(a) == len(b) == p.steps and [x[0] for x in a] == [x[0] for x in b]
    for x, y in zip(a, b):
        assert torch.equal(x[1], y[1]) and (x[2] is None) == (y[2] is None)
        assert x[2] is None or torch.equal(x[2], y[2])
    assert not all(torch.equal(x[1], y[1]) for x, y in zip(a, c))


def test_probing_during_training_changes_nothing(tmp_path):
    """Needle probes touch no random state and no weights: the trained model is bit-identical."""
    from difftx.checkpoint import load_model
    from difftx.compare.train import train_model

    weights = []
    for every in (0, 2):
        p = get_preset("smoke", **{**FAST, "probe_every": every})
        rec = train_model("diff", p.resolve(), 0, tmp_path / str(every), progress=False)
        assert len(rec["probes"]) == (3 if every else 0)
        weights.append(load_model(tmp_path / str(every) / "model").state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_an_interrupted_model_resumes_mid_training_exactly(tmp_path, monkeypatch):
    """A model stopped after a checkpoint continues from it on the next call and ends exactly as
    the uninterrupted one (weights, loss history, probes)."""
    import difftx.training
    from difftx.checkpoint import load_model
    from difftx.compare.train import TrainingInterrupted, train_model

    p = get_preset("smoke", **{**FAST, "steps": 12, "log_every": 2, "probe_every": 4}).resolve()
    full = train_model("diff", p, 0, tmp_path / "full", progress=False)
    real = difftx.training.train_stacked  # on a CPU a model alone trains as a stack of one
    monkeypatch.setattr(difftx.training, "train_stacked", lambda *a, **k: real(*a, **k, stop_at=6))
    with pytest.raises(TrainingInterrupted, match="after step 6"):
        train_model("diff", p, 0, tmp_path / "cut", progress=False)
    assert not (tmp_path / "cut" / "train.json").exists()
    assert (tmp_path / "cut" / "train" / "checkpoints").is_dir()
    monkeypatch.setattr(difftx.training, "train_stacked", real)
    resumed = train_model("diff", p, 0, tmp_path / "cut", progress=False)
    assert resumed["resumed_from"] == 6 and full["resumed_from"] is None
    untimed = lambda hist: [{k: v for k, v in h.items() if k != "time_s"} for h in hist]  # noqa: E731
    assert untimed(resumed["history"]) == untimed(full["history"]) and resumed["probes"] == full["probes"]
    assert [h["step"] for h in full["history"]] == list(range(2, 13, 2))
    assert all({"grad_norm", "grad_norms", "tokens", "time_s", "lr", "lambda"} <= set(h) for h in full["history"])
    # every step's gradient norm, once; training time runs on across the resume
    assert [len(h["grad_norms"]) for h in full["history"]] == [2] * 6
    assert all(a["time_s"] < b["time_s"] for a, b in zip(resumed["history"], resumed["history"][1:]))
    assert {k for h in full["history"] for k in h if k.endswith("_loss")} == {"needle_loss", "lm_loss", "icl_loss"}
    a, b = load_model(tmp_path / "full" / "model").state_dict(), load_model(tmp_path / "cut" / "model").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "cut" / "train" / "checkpoints").exists()  # deleted once the model is saved


def test_a_diverging_model_stops_with_a_clear_error(tmp_path, monkeypatch):
    from difftx.compare.train import train_model
    from difftx import model as model_mod
    from difftx.training import TrainingDivergedError

    real = model_mod.head_loss
    monkeypatch.setattr(model_mod, "head_loss", lambda *a: real(*a) * float("nan"))
    with pytest.raises(TrainingDivergedError, match=r"training baseline \(seed 3\) diverged: loss is nan at step 1"):
        train_model("baseline", get_preset("smoke", **FAST).resolve(), 3, tmp_path / "m", progress=False)
    assert not (tmp_path / "m" / "train.json").exists()


def test_the_stream_is_rank_sliced_and_resumable():
    """Two ranks' batches are the halves of one process's; a loader restored from a state dict
    continues the same stream."""
    plan = get_preset("smoke", **FAST).resolve()
    stream = CompareStream(plan.mixture, plan.space, 5)
    one = stream.make_loader(batch_size=8)
    two = [stream.make_loader(batch_size=4, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(5):
        whole, halves = one.next_batch(), [loader.next_batch() for loader in two]
        assert torch.equal(torch.cat([h.tokens for h in halves]), whole.tokens)
        assert all(h.kind == whole.kind and h.mask_total == whole.mask_total for h in halves)
        if whole.loss_mask is not None:
            assert torch.equal(torch.cat([h.loss_mask for h in halves]), whole.loss_mask)
            assert whole.mask_total == int(whole.loss_mask.sum())
    state = json.loads(json.dumps(one.state_dict()))  # it goes into trainer_state.json
    again = stream.make_loader(batch_size=8)
    again.load_state_dict(state)
    for _ in range(3):
        x, y = one.next_batch(), again.next_batch()
        assert x.kind == y.kind and torch.equal(x.tokens, y.tokens)
    with pytest.raises(ValueError, match="global_batch"):
        stream.make_loader(batch_size=4).load_state_dict(state)


def test_batch_shares_follow_the_schedule():
    assert get_preset("cpu").resolve().mixture.shares() == {"needle": 0.75, "lm": 0.125, "icl": 0.125, "recall": 0.0}
    none = get_preset("cpu", icl_every=0, lm_every=0).resolve().mixture
    assert none.shares() == {"needle": 1.0, "lm": 0.0, "icl": 0.0, "recall": 0.0}
    mixed = get_preset("cpu", recall_every=3).resolve().mixture  # recall takes every 3rd step that is neither
    assert mixed.shares() == pytest.approx({"needle": 0.5, "lm": 0.125, "icl": 0.125, "recall": 0.25})
    mix = get_preset("smoke", **FAST).resolve().mixture
    assert [mix.step_kind(s) for s in range(1, 13)].count("icl") == 12 * mix.shares()["icl"] == 2


def test_learning_speed_is_primary_and_keeps_censored_runs(smoke):
    """Steps until learned are compared whenever some model learned: a model that did not learn
    counts as its last probe step (censored), and nothing is compared when no model learned."""
    from difftx.compare.summary import all_comparisons, pair_key

    def paired_comparisons(res, settings):
        return all_comparisons(from_json(res), settings)[pair_key("diff", "baseline")].metrics

    res = json.loads((smoke / "results.json").read_text())
    settings = get_preset("smoke", **FAST).task_settings()
    steps = {("0", "diff"): 3, ("0", "baseline"): 6, ("1", "diff"): 3, ("1", "baseline"): 3}
    for (s, k), at in steps.items():
        res["runs"][s][k]["tasks"]["training"]["learned_step"] = at
    c = paired_comparisons(res, settings)["needle_learned_step"]
    assert c["values"] == {"diff": [3.0, 3.0], "baseline": [6.0, 3.0]} and c["paired"]["mean"] == -1.5
    assert c["lower_is_better"] and "steps" in c["verdict"] and c["family"] == "primary"
    train = res["runs"]["1"]["baseline"]["tasks"]["training"]
    train["learned_step"], train["last_probe_step"] = None, 6  # one model never learned: counted as step 6
    c = paired_comparisons(res, settings)["needle_learned_step"]
    assert c["values"]["baseline"] == [6.0, 6.0] and c["gated"] is None
    # steps lie in [0, last probe step]: the comparison is bounded there (intervals inside the budget)
    last = max(r[k]["tasks"]["training"]["last_probe_step"] for r in res["runs"].values() for k in r)
    assert c["bounds"] == [0.0, float(last)] and c["paired"]["tests"] == "exchangeability"
    assert c["paired"]["betting_p"] is not None and "mean_established" in c  # the mean, beside the verdict
    for r in res["runs"].values():
        for k in r:
            r[k]["tasks"]["training"]["learned_step"] = None
    c = paired_comparisons(res, settings)["needle_learned_step"]
    assert c["gated"] and "not learned" in c["verdict"] and c["better"] is None


def test_first_learned_step():
    probes = [{"step": 5, "accuracy": {"1/1": 0.2}}, {"step": 10, "accuracy": {"1/1": 0.95}},
              {"step": 15, "accuracy": {"1/1": 0.5}}]
    assert first_learned_step(probes, "1/1", 0.9) == 10
    assert first_learned_step(probes, "1/1", 0.99) is None
    assert first_learned_step(probes, "2/2", 0.9) is None


def test_batch_loss_on_masked_positions_equals_the_full_loss():
    """The LM head applied to the loss positions alone gives the full-logits cross-entropy."""
    from difftx.model import Transformer
    from difftx.training import Batch
    from difftx.training.batches import batch_loss_rows

    def batch_loss(model, tokens, mask):  # the trainer's loss of one batch in one process
        b = Batch(tokens, loss_mask=mask, mask_total=None if mask is None else int(mask.sum()))
        return model(tokens[:, :-1], targets=tokens[:, 1:], **batch_loss_rows(b))

    plan = get_preset("smoke", **FAST).resolve()
    torch.manual_seed(0)
    model = Transformer(plan.arms["diff"])
    rng = random.Random(3)
    for step in (1, 3, 4):  # needle, LM and ICL batches
        kind, tokens, mask, _ = batch_for_step(step, plan.mixture, plan.space, rng, lm_streams()[0])
        tgt = tokens[:, 1:] if mask is None else tokens[:, 1:].masked_fill(~mask, -100)
        full = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tgt.flatten(),
                                                 ignore_index=-100)
        assert torch.allclose(batch_loss(model, tokens, mask), full, atol=1e-6), kind


def test_preset_validation():
    with pytest.raises(ValueError, match="needle cell.*1 <= R <= N"):
        get_preset("smoke", tasks={"needle": {"grid": "2/3"}})
    with pytest.raises(ValueError, match="tasks.needle.grid.*max_needles=4"):
        get_preset("smoke", tasks={"needle": {"grid": ((6, 2),)}})
    with pytest.raises(ValueError, match="unknown setting.*samplez"):
        get_preset("smoke", tasks={"needle": {"samplez": 3}})
    with pytest.raises(ValueError, match="unknown task"):
        get_preset("smoke", tasks={"nedle": {}})
    with pytest.raises(ValueError, match="unknown compare preset"):
        get_preset("nope")
    with pytest.raises(ValueError, match="icl_every.*multiple of lm_every"):
        get_preset("smoke", lm_every=2, icl_every=4)
    with pytest.raises(ValueError, match="ComparePreset.icl_\\*.*multiple of n_classes"):
        get_preset("smoke", icl_demos=7)
    with pytest.raises(ValueError, match="ICLSettings.orders"):
        get_preset("smoke", tasks={"icl": {"orders": 1}})


@pytest.mark.parametrize("task", ["needle", "lm", "outliers", "quant", "icl"])
def test_eval_subcommand_on_a_compare_checkpoint(smoke, task, tmp_path, capsys):
    out = tmp_path / "r.json"
    flags = {"needle": ["--samples-per-cell", "1"], "lm": ["--windows", "2"], "quant": ["--needle-samples", "1"],
             "icl": ["--instances", "2", "--queries", "2", "--orders", "2"], "outliers": ["--tokens", "64"]}[task]
    rc = main(["eval", task, str(smoke / "seed0" / "diff" / "model"), *flags, "--no-progress", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["task"] == task and res["attention"] == "diff"
    if task == "needle":
        assert set(res["grid"]["accuracy"]) == {"1/1", "2/2", "4/2"} and res["dropped_cells"] == ["6/2"]
    if task == "lm":
        assert res["heldout"]["nll"] > 0 and res["heldout"]["bpb"] == pytest.approx(
            res["heldout"]["nll"] / torch.log(torch.tensor(2.0)).item(), rel=1e-5)


def test_eval_subcommand_on_a_text_checkpoint(tmp_path, capsys):
    from difftx.checkpoint import save_model
    from difftx.config import ModelConfig
    from difftx.model import Transformer

    torch.manual_seed(0)
    folder = save_model(Transformer(ModelConfig(vocab_size=257, dim=32, n_layers=1, n_heads=2, max_seq_len=32)),
                        tmp_path / "ckpt")
    assert main(["eval", "lm", str(folder), "--tokenizer", "byte", "--windows", "2", "--no-progress"]) == 0
    assert "bits/byte" in capsys.readouterr().out
    assert main(["eval", "outliers", str(tmp_path / "missing"), "--no-progress"]) != 0


def _flags(settings) -> list[str]:
    """`difftx eval` flags that reproduce ``settings`` (the text form each field parses)."""
    import dataclasses

    from difftx.tasks.base import format_setting

    out = []
    for f in dataclasses.fields(settings):
        v = getattr(settings, f.name)
        if v is not None and v != ():
            out += ["--" + f.name.replace("_", "-"), format_setting(f, v)]
    return out


@pytest.mark.parametrize("arm", ["diff", "baseline"])
def test_eval_gives_what_compare_stored_for_every_task(smoke, arm, tmp_path):
    """`difftx eval TASK` on a compare model, with the preset's settings as flags, gives the very
    numbers compare stored for that model: one code path (difftx.tasks), for every task."""
    from difftx.tasks import TASKS

    settings = get_preset("smoke", **FAST).task_settings()
    res = json.loads((smoke / "results.json").read_text())
    for name, task in TASKS.items():
        stored = res["runs"]["0"][arm]["tasks"][name]
        out = tmp_path / f"{name}.json"
        args = ["eval", name, str(smoke / "seed0" / arm / "model"), *_flags(settings[name]), "--no-progress",
                "--json", str(out)]
        if "skipped" in stored:
            assert main(args) == 2, name
            continue
        assert main(args) == 0, name
        fresh = json.loads(out.read_text())
        metrics = task.metrics(settings[name])
        for m in metrics:  # a peer metric read against the model itself: its value at its own budget
            got, want = (m.get(fresh, fresh), m.get(stored, stored)) if m.peer else (m.get(fresh), m.get(stored))
            _assert_close(got, want, f"{name}: {m.key}")
        _assert_close(fresh.get("records"), stored.get("records"), name)


def _assert_close(a, b, where: str) -> None:
    """Nested JSON values equal, numbers to 1e-6 relative."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            _assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-6, abs=1e-9), where
    else:
        assert a == b, where


def test_a_folder_of_an_older_results_schema_is_refused(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "compare.json").write_text(json.dumps({"preset": get_preset("smoke").to_dict()}))
    with pytest.raises(ValueError, match="folder version 1.*new --out"):
        run_compare("smoke", 1, tmp_path / "old", progress=False, workers=1)


def test_comparisons_are_gated_on_learning_and_adjusted(smoke):
    """A cell no model learned is not compared; the primary needle mean pools the learned cells'
    prompts only; exploratory p-values are Holm-adjusted."""
    from difftx.compare.summary import NOT_LEARNED, all_comparisons, pair_key

    res = json.loads((smoke / "results.json").read_text())
    settings = get_preset("smoke", **FAST).task_settings()
    for s, run in res["runs"].items():
        for arm, r in run.items():
            rec = r["tasks"]["needle"]["records"]
            # DIFF retrieves every single needle; nobody gets past the copy floor at 2/2
            rec["correct_fraction"] = [(1.0 if arm == "diff" else 0.5) if c == "1/1" else 0.5 * (i % 2)
                                       for i, c in enumerate(rec["cell"])]
            for cell in ("1/1", "2/2"):
                vals = [v for v, c in zip(rec["correct_fraction"], rec["cell"]) if c == cell]
                r["tasks"]["needle"]["grid"]["accuracy"][cell] = sum(vals) / len(vals)
    C = all_comparisons(from_json(res), settings)[pair_key("diff", "baseline")].metrics
    assert C["needle_1_1"]["gated"] is None
    assert C["needle_2_2"]["gated"] == NOT_LEARNED and C["needle_2_2"]["better"] is None
    assert "not compared" in C["needle_2_2"]["verdict"]
    mean = C["needle_mean"]
    n_cell = sum(c == "1/1" for c in res["runs"]["0"]["diff"]["tasks"]["needle"]["records"]["cell"])
    assert mean["gated"] is None and mean["examples_used"] == n_cell  # the 2/2 prompts are left out
    assert mean["values"] == {"diff": [1.0, 1.0], "baseline": [0.5, 0.5]}
    assert mean["family"] == "primary" and mean["paired"]["mean"] == pytest.approx(0.5)
    # attention to the answer is compared where both models learned the cell (1/1 here), not at 2/2
    assert C["attn_answer_1_1"]["gated"] is None
    assert C["attn_answer_2_2"]["gated"] == "not learned by both models at this budget: not compared"
    explore = [c for c in C.values() if c["family"] == "exploratory" and c["gated"] is None]
    assert all(c["p_adjusted"] >= c["paired"]["p_value"] - 1e-12 for c in explore)


def test_a_learning_rate_sweep_runs_one_compare_per_value_and_tabulates_them(tmp_path, capsys):
    """`--sweep lr=a,b`: a whole comparison per value (min_lr scaled with lr), then sweep.md with
    every primary metric per value and each arm at its own best value."""
    out = tmp_path / "sweep"
    args = ["compare", "--preset", "smoke", "--seeds", "2", "--out", str(out), "--workers", "1", "--no-progress",
            "--sweep", "lr=0.001,0.004", *as_sets(FAST)]
    assert main(args) == 0
    assert "best lr by LM NLL" in capsys.readouterr().out
    for v, min_lr in ((0.001, 0.0001), (0.004, 0.0004)):
        meta = json.loads((out / f"lr={v:g}" / "compare.json").read_text())["preset"]
        assert meta["lr"] == v and abs(meta["min_lr"] - min_lr) < 1e-12
    s = json.loads((out / "sweep.json").read_text())
    assert [p["value"] for p in s["points"]] == [0.001, 0.004] and s["best"]["metric"] == "lm_nll"
    lm = {p["value"]: p["metrics"]["lm_nll"] for p in s["points"]}
    for arm in ("baseline", "diff"):
        assert s["best"]["mean"][arm] == min(lm[v][arm][0] for v in lm)
    md = (out / "sweep.md").read_text()
    assert "| 0.001 |" in md and "Each arm at its own best `lr`" in md
    assert main(["compare", "--preset", "smoke", "--out", str(tmp_path / "x"), "--sweep", "lr=0.001",
                 "--set", "lr=0.002"]) == 2
    assert main(["compare", "--preset", "smoke", "--out", str(tmp_path / "x"), "--sweep", "tasks=1,2"]) == 2


def test_more_arms_in_one_paired_compare(tmp_path, capsys):
    """`--arms gated,no_subtraction`: every arm trained per seed; DIFF vs baseline, every arm vs the
    baseline and DIFF vs every arm compared, with Holm over all of them; the report has a column per
    arm; a later run with other arms reuses the finished models and trains only the new arm's, and
    does not compare machine measurements across the two invocations."""
    from difftx.eval.stats import holm

    out = tmp_path / "arms"
    args = ["compare", "--preset", "smoke", "--seeds", "2", "--out", str(out), "--workers", "1", "--no-progress",
            "--arms", "gated,no_subtraction", *as_sets(FAST)]
    assert main(args) == 0
    res = json.loads((out / "results.json").read_text())
    assert list(res["arms"]) == ["baseline", "diff", "gated", "no_subtraction"]
    assert res["arms"]["gated"]["config"]["attention"] == "gated"
    assert res["arms"]["no_subtraction"]["config"]["subtract"] is False
    assert res["arms"]["gated"]["parameters"] > res["arms"]["baseline"]["parameters"]
    assert list(res["comparisons"]) == ["diff vs baseline", "gated vs baseline", "no_subtraction vs baseline",
                                        "diff vs gated", "diff vs no_subtraction"]
    assert [c["primary"] for c in res["comparisons"].values()] == [True, False, False, False, False]
    c = res["comparisons"]["gated vs baseline"]["metrics"]["lm_nll"]
    assert c["arms"] == ["gated", "baseline"] and len(c["values"]["gated"]) == 2
    assert abs(c["paired"]["mean"] - (sum(c["values"]["gated"]) - sum(c["values"]["baseline"])) / 2) < 1e-9
    assert c["verdict"].startswith("LM NLL (held-out): gated - baseline")
    everything = [x for pair in res["comparisons"].values() for x in pair["metrics"].values()]
    first = [x for x in everything if x["family"] == "primary" and x["p_adjusted"] is not None]
    assert len(first) >= 5  # LM NLL of five pairs at least
    assert [x["p_adjusted"] for x in first] == pytest.approx(holm([x["paired"]["p_value"] for x in first]))
    report = (out / "report.md").read_text()
    assert "## Arms" in report and "| metric | baseline | diff | gated | no_subtraction |" in report
    assert "| gated - baseline | LM NLL (held-out) |" in report and "| DIFF - gated |" in report
    # one invocation, but each arm's two seeds trained as one stack: one throughput measurement per stack
    tput = res["comparisons"]["gated vs baseline"]["metrics"]["train_tokens_per_s"]
    assert tput["gated"] == ONE_PER_STACK and tput["paired"]["low"] is None and tput["cis"]["gated"] == [None, None]
    assert "one measurement per stack" in report and "not a sample of seeds (no interval)" in report
    capsys.readouterr()
    # a later run with other arms: the finished ones are reused, the new one is trained; machine measurements
    # (throughput, loss at equal wall-clock) are not compared across invocations
    again = main(["compare", "--preset", "smoke", "--seeds", "2", "--out", str(out), "--workers", "1",
                  "--no-progress", "--arms", "gated,baseline_head_norm", *as_sets(FAST)])
    assert again == 0
    # said before it trains: 2 seeds cannot give a verdict among the 4 arms' 5 comparisons
    assert "difftx compare: note: 2 seeds cannot give a verdict when all 5 comparisons of the 4 arms are made: " \
        "8 seeds needed" in capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert list(res["arms"]) == ["baseline", "diff", "gated", "baseline_head_norm"]
    assert sorted(k for k, d in res.get("this_run").items() if d["trained"]) == ["seed0/baseline_head_norm",
                                                                             "seed1/baseline_head_norm"]
    assert primary(res)["train_tokens_per_s"]["gated"] == ONE_PER_STACK
    new_vs_old = res["comparisons"]["baseline_head_norm vs baseline"]["metrics"]
    assert new_vs_old["train_tokens_per_s"]["gated"] == DIFFERENT_RUNS
    assert new_vs_old["grad_spikes"]["gated"] is None  # not a machine measurement
    # (the smoke preset's curves may be too short for a loss at equal wall-clock; where it is read, it is gated too)
    assert new_vs_old["loss_at_equal_time"]["gated"] == DIFFERENT_RUNS  # with a value or not (a slowed run)


def test_token_efficiency_from_the_held_out_curves(smoke):
    """Every compare turns the models' held-out loss curves into the token ratio of the paper's
    Fig. 3b: per curve point and overall, in results.json, report.md and a plot."""
    res = json.loads((smoke / "results.json").read_text())
    e = res["token_efficiency"]["diff"]
    curve = res["runs"]["0"]["diff"]["train"]["heldout_curve"]
    assert e["tokens"] == sorted({t for t in curve["tokens"] if t > 0}) and len(e["ratios"]) == len(e["tokens"])
    assert all(r["value"] is None or r["value"] > 0 for r in e["ratios"])
    assert len(e["per_seed"]) == 2 and e["overall"]["n"] in (0, 2)
    report = (smoke / "report.md").read_text()
    assert "## Token efficiency (paper Fig. 3b)" in report
    assert (smoke / "plots" / "token_efficiency.png").is_file()
    # the gap in nats at every point both arms' curves share, paired over seeds (issue 30)
    gap = e["gap"]
    assert [g["tokens"] for g in gap] == e["tokens"] and all(len(g["values"]) == 2 and g["n"] == 2 for g in gap)
    assert "gap, nats: mean; median [95%]" in report and (smoke / "plots" / "gap_along_training.png").is_file()
    assert all(g["interval_of"] == "median" for g in gap)
    assert res["regime"]["diff"]["n_layers"] == res["arms"]["diff"]["config"]["n_layers"]
    assert "## Regime (against the paper's recipe)" in report


def test_a_machine_measurement_is_present_whatever_the_timing(smoke):
    """The loss at equal wall-clock exists only when both models logged a loss within the shorter
    training time, which depends on the machine's load. A slowed model must not drop the metric:
    it stays in the comparison, with null values and why (before: the key set of a busy run
    differed from an idle one's, and the torchrun test failed under load)."""
    from difftx.compare.report import render_report
    from difftx.compare.schema import Comparison, dumps_strict, validate_results
    from difftx.compare.summary import all_comparisons, pair_key
    from difftx.tasks import TASKS, settings_from_dict

    res = json.loads((smoke / "results.json").read_text())
    settings = {name: settings_from_dict(TASKS[name].Settings, t["settings"], name) for name, t in res["tasks"].items()}
    fast = all_comparisons(from_json(res), settings)[pair_key("diff", "baseline")].metrics
    slowed = json.loads(json.dumps(res))
    for arm, scale in (("diff", 1000.0), ("baseline", 0.001)):  # the diff model ran 10^6 times slower
        t = slowed["runs"]["0"][arm]["tasks"]["training"]
        t["curve"]["time_s"] = [None if x is None else x * scale for x in t["curve"]["time_s"]]
        t["cost"]["time_s"] *= scale
    slowed = from_json(slowed)
    slow = all_comparisons(slowed, settings)[pair_key("diff", "baseline")].metrics
    assert set(slow) == set(fast)
    c = slow["loss_at_equal_time"]
    assert c["gated"].startswith("not measured in this run") and c["paired"]["mean"] is None and c["better"] is None
    slowed.comparisons = {pair_key("diff", "baseline"): Comparison(("diff", "baseline"), slow, True)}
    validate_results(json.loads(dumps_strict(to_json(slowed))))
    assert "Not measured in this run: training loss at equal wall-clock" in render_report(slowed, {})
    # arms trained by different invocations: that reason, whatever the timing (a CI failure under load said
    # "no value" for a slowed run instead)
    for s in slowed.seeds:
        slowed.run(s, "diff").tasks["training"]["invocation"] = "another"
    apart = all_comparisons(slowed, settings)[pair_key("diff", "baseline")].metrics["loss_at_equal_time"]
    assert apart["gated"] == DIFFERENT_RUNS and apart["paired"]["mean"] is None
    slowed.comparisons = all_comparisons(slowed, settings)
    rep = render_report(slowed, {})
    assert "Not compared (trained by different invocations (the machine is measured within one run)): training " \
           "throughput; training loss at equal wall-clock." in rep and "Not measured in this run" not in rep


def test_stacked_seeds_give_the_results_of_separate_training(smoke, tmp_path):
    """The smoke fixture trains each arm's two seeds as one stack (the default on a CPU); with
    ``stack=1`` every model trains alone. Every training loss and every comparison agree to float32
    rounding (the wall-clock ones aside)."""
    out = tmp_path / "alone"
    assert main(["compare", "--preset", "smoke", "--seeds", "2", "--out", str(out), "--workers", "1",
                 "--no-progress", *as_sets({**FAST, "stack": 1})]) == 0
    got, want = (json.loads((d / "results.json").read_text()) for d in (smoke, out))
    for s in ("0", "1"):
        for arm in ("diff", "baseline"):
            g, w = got["runs"][s][arm]["train"], want["runs"][s][arm]["train"]
            assert g["stacked"] == 2 and "stacked" not in w
            for key in ("needle_loss", "lm_loss", "icl_loss", "grad_norm"):
                a, b = ([h.get(key) for h in r["history"]] for r in (g, w))
                assert [x is None for x in a] == [x is None for x in b], (s, arm, key)
                assert [x for x in a if x is not None] == pytest.approx([x for x in b if x is not None], rel=1e-5)
    timed = {"train_tokens_per_s", "loss_at_equal_time"}
    assert set(primary(got)) == set(primary(want))
    for key, c in primary(want).items():
        if key not in timed:
            for arm, vals in c["values"].items():
                assert primary(got)[key]["values"][arm] == pytest.approx(vals, rel=1e-4, abs=1e-6), key


def test_stack_size_rule(monkeypatch):
    """Automatic stacks on a CPU: one per worker process for each arm, at most 16, at most what fits in a
    quarter of the memory per worker; ``stack=1`` none, ``stack=K`` K; none under torchrun or for one seed."""
    from difftx.compare import jobs as jobs_mod

    cpu = get_preset("cpu").resolve()
    assert [jobs_mod.stack_size(cpu, 8, w, False) for w in (1, 2, 4, 8)] == [8, 8, 4, 2]
    assert jobs_mod.stack_size(cpu, 40, 2, False) == jobs_mod.MAX_STACK == 16
    assert jobs_mod.stack_size(cpu, 1, 2, False) == 1 and jobs_mod.stack_size(cpu, 8, 2, True) == 1
    assert jobs_mod.stack_size(get_preset("cpu", stack=1).resolve(), 8, 2, False) == 1
    assert jobs_mod.stack_size(get_preset("cpu", stack=3).resolve(), 8, 2, False) == 3
    monkeypatch.setattr(jobs_mod, "memory_bytes", lambda: 4 * 2 * 3 * jobs_mod.model_bytes(cpu))  # room for 3
    assert jobs_mod.stack_size(cpu, 8, 2, False) == 3
    jobs = jobs_mod.plan_jobs(cpu, [0, 1, 2, 3, 4], Path("out"), 2)
    assert [(k, s) for k, s, _ in jobs] == [("baseline", (0, 1)), ("diff", (0, 1)), ("baseline", (2, 3)),
                                           ("diff", (2, 3)), ("baseline", (4,)), ("diff", (4,))]


def test_a_second_look_is_recorded_and_adjusted(smoke, tmp_path):
    """Adding a seed to a folder already read is a second look: recorded (seeds, date, commit) in results.json, its
    p-values (verdict and mean) multiplied by the second look's factor (alpha spent over looks: x32.9, where the first
    look's is x1.053), the report saying so and what a third look would cost; reading the same seeds again is the same
    look. No p-value in results.json is 0."""
    import shutil

    from difftx.compare.summary import all_comparisons
    from difftx.eval.stats import look_factor

    out = tmp_path / "looks"
    shutil.copytree(smoke, out)
    argv = ["compare", "--preset", "smoke", "--out", str(out), "--workers", "1", "--no-progress", *as_sets(FAST)]
    assert main([*argv, "--seeds", "3"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [x["seeds"] for x in res["looks"]] == [[0, 1], [0, 1, 2]] and res["look"] == 2
    assert res["looks"][1]["date"] == res["created"]
    assert ("second look at 3 seeds (this folder was read before at 2 seeds), adjusted: p-values x32.9; a third look "
            "(more seeds into this folder) would test at p x132") in (out / "report.md").read_text()
    settings = get_preset("smoke", **FAST).task_settings()
    once = all_comparisons(from_json({**res, "look": 1}), settings, power=False)["diff vs baseline"].metrics
    twice = all_comparisons(from_json(res), settings, power=False)["diff vs baseline"].metrics
    checked = [k for k, c in once.items() if c["p_adjusted"] is not None]
    ratio = look_factor(2) / look_factor(1)

    def again(p):  # the second look's p from the first's (a first look's p of 1 may have been capped)
        return None if p is None else 1.0 if p >= 1.0 else min(1.0, p * ratio)

    assert checked and all(twice[k]["p_adjusted"] == pytest.approx(again(once[k]["p_adjusted"])) for k in checked)
    assert all(twice[k].get("mean_p_adjusted") == pytest.approx(again(once[k].get("mean_p_adjusted")))
               for k in checked)
    assert all(once[k]["look_factor"] == pytest.approx(look_factor(1), abs=1e-4) and twice[k]["look_factor"] ==
               pytest.approx(look_factor(2), abs=1e-4) for k in checked)

    def zero_p(obj, where=""):  # a p-value of exactly 0 anywhere (keys p, p_*, *_p, *_p_*)
        if isinstance(obj, dict):
            return [f"{where}.{k}" for k, v in obj.items() if (k == "p" or k.startswith("p_") or k.endswith("_p") or
                                                               "_p_" in k) and v == 0 and not isinstance(v, bool)] + \
                [x for k, v in obj.items() for x in zero_p(v, f"{where}.{k}")]
        return [x for i, v in enumerate(obj) for x in zero_p(v, f"{where}[{i}]")] if isinstance(obj, list) else []

    assert not zero_p(res)
    assert main([*argv, "--seeds", "3"]) == 0  # the same seeds: the same look
    assert json.loads((out / "results.json").read_text())["look"] == 2
    assert main([*argv, "--seeds", "2"]) == 0  # the first look's seeds: read as the first look
    res = json.loads((out / "results.json").read_text())
    assert res["look"] == 1 and len(res["looks"]) == 2


def test_a_damaged_results_file_is_refused_not_counted_afresh(smoke, tmp_path, capsys):
    """A truncated results.json held the earlier looks: reading the folder again is refused in one line naming it
    (the next look's p-values would otherwise go unadjusted), and the damaged file is left for the user."""
    import shutil

    out = tmp_path / "damaged"
    shutil.copytree(smoke, out)
    text = (out / "results.json").read_text()
    (out / "results.json").write_text(text[: len(text) // 2])
    capsys.readouterr()
    argv = ["compare", "--preset", "smoke", "--out", str(out), "--workers", "1", "--no-progress", *as_sets(FAST)]
    assert main([*argv, "--seeds", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{out / 'results.json'}: unreadable" in err and "earlier looks" in err, err
    assert (out / "results.json").read_text() == text[: len(text) // 2]
    assert not (out / "seed2").exists()  # refused before any training


def test_a_run_whose_budget_failed_is_told_to_train_longer_not_to_add_seeds(smoke):
    """Where no model learned what any primary metric measures, the opening says the steps failed, and the seeds a
    verdict needs (a family of 0) are not advised: more seeds cannot help (recall-cpu at 400 steps once said '6')."""
    from difftx.compare.report import opening
    from difftx.compare.summary import NOT_LEARNED

    res = read_results(smoke / "results.json")
    comps = {k: {m: dict(c) for m, c in v.metrics.items()} for k, v in res.comparisons.items()}
    for c in (c for v in comps.values() for c in v.values() if c["primary"]):
        c.update(gated=NOT_LEARNED, better=None)
    answer, sure, _ = opening(comps, res)
    assert answer.startswith("**No verdict: no model learned what the primary metrics measure** in 6 steps, so more "
                             "seeds cannot help: train longer"), answer
    assert "a verdict needs at least" not in sure and "run more (`--seeds`)" not in sure, sure
