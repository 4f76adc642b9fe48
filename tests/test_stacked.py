"""Stacked training (difftx.training.stacked): K seeds of one arm as one stacked model match the same
seeds trained one by one by the trainer, and the stack's own resume is bitwise."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

from difftx import Transformer
from difftx.config import ARMS, ModelConfig, arm_config
from difftx.model import lm_loss
from difftx.training import Batch, TrainConfig, TrainingDivergedError, train
from difftx.training.metrics import read_metrics
from difftx.training.optim import build_optimizer, lr_at
from difftx.training.stacked import (
    StackedTransformer,
    load_optimizer_states,
    optimizer_state_of,
    train_step,
)

# the cpu compare preset's model shape (D = 64, 2 layers, 2 DIFF heads) on a smaller vocabulary and batch
BASE = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=2, max_seq_len=24)
SEEDS = (11, 12, 13)
STEPS, HALF, BATCH, SEQ = 50, 25, 4, 24


class Source:
    """A batch source whose loaders record what they serve. Each seed its own stream: every 4th step an
    LM batch (loss on every position), the others "needle" batches with loss masks of a different
    number of positions per row and per model (the stack pads them)."""

    def __init__(self):
        self.served: dict[int, list] = {}

    def make_loader(self, config, dist=None):
        return Loader(config.seed, config.batch_size, self.served.setdefault(config.seed, []))


class Loader:
    def __init__(self, seed: int, batch: int, log: list):
        self.seed, self.batch, self.log, self.step = seed, batch, log, 0

    def next_batch(self) -> Batch:
        self.step += 1
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.step)
        tokens = torch.randint(0, BASE.vocab_size, (self.batch, SEQ + 1), generator=g)
        self.log.append((self.step, tokens))
        if self.step % 4 == 0:
            return Batch(tokens, kind="lm")
        mask = torch.rand(self.batch, SEQ, generator=g) < 0.1 + 0.02 * (self.seed % 5)
        mask[:, -1] = True  # never empty
        return Batch(tokens, loss_mask=mask, kind="needle", mask_total=int(mask.sum()))

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def _train_config(cfg: ModelConfig, seed: int, out) -> TrainConfig:
    return TrainConfig(model=cfg.to_dict(), out_dir=str(out), steps=STEPS, batch_size=BATCH, seq_len=SEQ, lr=3e-3,
                       min_lr=3e-4, warmup_steps=10, weight_decay=0.1, grad_clip=1.0, eval_interval=0, log_interval=10,
                       ckpt_interval=0, progress=False, tensorboard=False, device="cpu", seed=seed)


def _initial_stack(cfg: ModelConfig) -> StackedTransformer:
    models = []
    for seed in SEEDS:
        torch.manual_seed(seed)  # what the trainer does before it builds the model
        models.append(Transformer(cfg))
    return StackedTransformer.from_models(models)


def _run_stack(stack, opt, loaders, tc, first: int, last: int) -> tuple[dict, dict]:
    losses, norms = {}, {}
    for step in range(first, last + 1):
        out = train_step(stack, opt, [[loader.next_batch() for loader in loaders]], lr_at(step, tc), tc.grad_clip)
        losses[step], norms[step] = out.losses, out.grad_norms
    return losses, norms


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# the regime map's arms too: a head output scale decoupled from lambda_init, a scaled normed baseline, torch's init
@pytest.mark.parametrize("arm", ["diff", "baseline", "diff_out_0.2", "baseline_head_norm_out_0.2@torch"])
def test_stack_matches_separate_training_and_resumes_bitwise(arm, tmp_path):
    name, _, init = arm.partition("@")
    cfg = arm_config(BASE.replace(init=init or "normal"), name)
    # the reference: each seed trained by the trainer on its own
    ref_source, ref = Source(), {}
    for seed in SEEDS:
        tc = _train_config(cfg, seed, tmp_path / f"{arm}-{seed}")
        result = train(tc, data=ref_source, model_config=cfg)
        logged = [r for r in read_metrics(tmp_path / f"{arm}-{seed}" / "metrics.jsonl") if "grad_norms" in r]
        norms = dict(enumerate((n for r in logged for n in r["grad_norms"]), start=1))  # every step's
        ref[seed] = (result.losses, norms)

    tcs = [_train_config(cfg, seed, tmp_path / "unused") for seed in SEEDS]
    source = Source()
    stack = _initial_stack(cfg)
    opt = build_optimizer(stack, tcs[0])
    loaders = [source.make_loader(tc) for tc in tcs]
    losses, norms = _run_stack(stack, opt, loaders, tcs[0], 1, HALF)
    # a checkpoint at step HALF, per model in the trainer's format (through torch.save / torch.load)
    saved = _roundtrip({"models": [stack.state_dict_of(i) for i in range(len(SEEDS))],
                        "optim": [optimizer_state_of(opt, stack, i) for i in range(len(SEEDS))],
                        "loaders": [loader.state_dict() for loader in loaders]})
    more_losses, more_norms = _run_stack(stack, opt, loaders, tcs[0], HALF + 1, STEPS)
    losses, norms = {**losses, **more_losses}, {**norms, **more_norms}

    # exactly the same batches, every loss within 1e-5 (relative), and the clipping at work
    for seed in SEEDS:
        assert len(source.served[seed]) == len(ref_source.served[seed]) == STEPS
        for (s1, t1), (s2, t2) in zip(source.served[seed], ref_source.served[seed]):
            assert s1 == s2 and torch.equal(t1, t2)
    worst = 0.0
    for i, seed in enumerate(SEEDS):
        ref_losses, ref_norms = ref[seed]
        assert sorted(ref_losses) == list(range(1, STEPS + 1))
        for step in range(1, STEPS + 1):
            worst = max(worst, abs(losses[step][i] - ref_losses[step]) / abs(ref_losses[step]))
            assert norms[step][i] == pytest.approx(ref_norms[step], rel=1e-4)
    assert worst < 1e-5, f"largest relative loss difference {worst:.2e}"
    assert max(max(n) for n in norms.values()) > tcs[0].grad_clip  # some steps were clipped

    # the stack's own resume from that checkpoint: bitwise the same losses and weights to the end
    stack3 = StackedTransformer.from_state_dicts(cfg, saved["models"])
    opt3 = build_optimizer(stack3, tcs[0])
    load_optimizer_states(opt3, stack3, saved["optim"])
    loaders3 = [Source().make_loader(tc) for tc in tcs]
    for loader, state in zip(loaders3, saved["loaders"]):
        loader.load_state_dict(state)
    second, _ = _run_stack(stack3, opt3, loaders3, tcs[0], HALF + 1, STEPS)
    assert second == more_losses  # bitwise: floats compared exactly
    for name, p in stack.named_stacked():
        assert torch.equal(dict(stack3.named_stacked())[name], p), name


def test_checkpoint_format_is_the_trainers():
    """state_dict_of / optimizer_state_of give what the one-model trainer saves: a model loads it, and an
    optimizer built by build_optimizer takes the state under the same names and groups."""
    cfg = arm_config(BASE, "diff").replace(tie_embeddings=True)
    stack = _initial_stack(cfg)
    tc = _train_config(cfg, 0, "unused")
    opt = build_optimizer(stack, tc)
    source = Source()
    loaders = [source.make_loader(_train_config(cfg, s, "unused")) for s in SEEDS]
    _run_stack(stack, opt, loaders, tc, 1, 2)
    for i in range(len(SEEDS)):
        sd = stack.state_dict_of(i)
        model = Transformer(cfg)
        model.load_state_dict(sd)  # strict: every key, a tied head under both names
        assert model.lm_head.weight is model.tok_embeddings.weight
        ref = build_optimizer(model, tc)
        names = {id(p): n for n, p in model.named_parameters()}
        ours = optimizer_state_of(opt, stack, i)
        assert [[names[id(p)] for p in g["params"]] for g in ref.param_groups] == \
            [g["params"] for g in ours["param_groups"]]
        for g_ref, g_ours in zip(ref.param_groups, ours["param_groups"]):
            assert {k: v for k, v in g_ref.items() if k not in ("params", "lr")} == \
                {k: v for k, v in g_ours.items() if k not in ("params", "lr")}
        for name, st in ours["state"].items():
            p = dict(model.named_parameters())[name]
            assert st["exp_avg"].shape == p.shape and float(st["step"]) == 2.0


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_every_arm_one_step_matches(arm):
    """Every arm's stacked loss and gradients equal each model's own, on LM and masked batches."""
    cfg = arm_config(BASE.replace(dim=32, vocab_size=40), arm)
    stack = _initial_stack(cfg)
    models = [Transformer(cfg) for _ in SEEDS]
    for i, m in enumerate(models):
        m.load_state_dict(stack.state_dict_of(i))
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (len(SEEDS), 2, 17), generator=g)
    mask = torch.rand(len(SEEDS), 2, 16, generator=g) < 0.3
    mask[:, :, 0] = True
    for masked in (False, True):
        stack.zero_grad()
        got = stack.losses(tokens, mask if masked else None, [int(m.sum()) for m in mask] if masked else None)
        got.sum().backward()
        for i, m in enumerate(models):
            m.zero_grad()
            x, y = tokens[i, :, :-1], tokens[i, :, 1:]
            # an independent oracle: the full logits and F.cross_entropy (sum over the mask / its count)
            loss = F.cross_entropy(m(x)[mask[i]], y[mask[i]], reduction="sum") / int(mask[i].sum()) if masked \
                else lm_loss(m(x), y)
            loss.backward()
            assert float(got[i].detach()) == pytest.approx(float(loss.detach()), rel=1e-5)
            for name, p in stack.named_stacked():
                ref = dict(m.named_parameters())[name].grad
                # a lambda vector's gradient is a sum with cancellation (A1 - lambda A2 at lambda near 0.8): float32
                # sums in another order differ by up to ~4e-4 of its largest element (float64: ~1e-6)
                tol = (1e-3 if "lambda_" in name else 1e-6) * float(ref.abs().max()) + 1e-9
                torch.testing.assert_close(p.grad[i], ref, rtol=1e-4, atol=tol)


def test_refuses_mixed_batches():
    stack = _initial_stack(BASE)
    opt = build_optimizer(stack, _train_config(BASE, 0, "unused"))
    t = torch.zeros(2, 9, dtype=torch.long)
    mixed = [Batch(t, kind="lm"), Batch(t, kind="needle", loss_mask=torch.ones(2, 8, dtype=torch.bool)), Batch(t)]
    with pytest.raises(ValueError, match="differ"):
        train_step(stack, opt, [mixed], 1e-3, 1.0)


class DocSource(Source):
    """Source's batches with packed documents (doc_ids), for a grad-accumulation run."""

    def make_loader(self, config, dist=None):
        return DocLoader(config.seed, config.batch_size, self.served.setdefault(config.seed, []))


class DocLoader(Loader):
    def next_batch(self) -> Batch:
        b = super().next_batch()
        g = torch.Generator().manual_seed(self.step)
        cuts = torch.rand(b.tokens.shape, generator=g) < 0.1
        b.doc_ids = cuts.cumsum(1)
        return b


def test_grad_accumulation_and_packed_documents_match_the_trainer(tmp_path):
    cfg, steps = arm_config(BASE, "diff"), 4
    ref_source, ref = DocSource(), {}
    tcs = []
    for seed in SEEDS:
        tc = _train_config(cfg, seed, tmp_path / str(seed)).replace(steps=steps, grad_accum=2, warmup_steps=2)
        tcs.append(tc)
        ref[seed] = train(tc, data=ref_source, model_config=cfg).losses
    source = DocSource()
    stack = _initial_stack(cfg)
    opt = build_optimizer(stack, tcs[0])
    loaders = [source.make_loader(tc) for tc in tcs]
    for step in range(1, steps + 1):
        micro = [[loader.next_batch() for loader in loaders] for _ in range(2)]
        out = train_step(stack, opt, micro, lr_at(step, tcs[0]), tcs[0].grad_clip, doc_mask=True)
        for i, seed in enumerate(SEEDS):
            assert out.losses[i] == pytest.approx(ref[seed][step], rel=1e-5)


def test_divergence_stops_before_the_update():
    stack = _initial_stack(BASE)
    opt = build_optimizer(stack, _train_config(BASE, 0, "unused"))
    with torch.no_grad():
        stack.model_tree.norm.weight[1].fill_(float("nan"))
    before = [p.detach().clone() for p in stack.parameters()]
    batches = [Source().make_loader(_train_config(BASE, s, "unused")).next_batch() for s in SEEDS]
    with pytest.raises(TrainingDivergedError) as e:
        train_step(stack, opt, [batches], 1e-3, 1.0)
    assert e.value.models == [1] and e.value.what == "loss"
    for p, q in zip(stack.parameters(), before):
        assert torch.allclose(p, q, rtol=0, atol=0, equal_nan=True)
    assert all(p.grad is None for p in stack.parameters())


def test_model_view_is_an_ordinary_transformer():
    stack = _initial_stack(BASE)
    state = torch.random.get_rng_state()
    m = stack.model(2)
    assert torch.equal(torch.random.get_rng_state(), state)
    ref = Transformer(BASE)
    ref.load_state_dict(stack.state_dict_of(2))
    x = torch.randint(0, BASE.vocab_size, (2, 9))
    assert torch.equal(m(x), ref(x))


def test_float64_and_no_autocast():
    cfg = arm_config(BASE.replace(dim=32, vocab_size=40), "diff")
    models = []
    for seed in SEEDS:
        torch.manual_seed(seed)
        models.append(Transformer(cfg).double())
    stack = StackedTransformer.from_models(models)
    assert stack.model_tree.tok_embeddings.weight.dtype == torch.float64
    tokens = torch.randint(0, cfg.vocab_size, (len(SEEDS), 2, 17))
    got = stack.losses(tokens)
    for i, m in enumerate(models):
        # the trainer's lm_loss takes the cross-entropy in float32 (logits.float()): so does the stack
        ref = lm_loss(m(tokens[i, :, :-1]), tokens[i, :, 1:])
        assert float(got[i].detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="autocast"):
        stack.losses(tokens)


@pytest.mark.parametrize("arm", ["diff", "baseline"])
def test_long_sequences_blocks_and_recomputed_maps(arm):
    """Sequences longer than a block (CHUNK_ROWS) and than STORE_MAX_KEYS (maps recomputed in the backward),
    with packed documents: the same loss and gradients as each model's own."""
    from difftx.attention import kernels

    T = kernels.STORE_MAX_KEYS + 40
    assert T > kernels.CHUNK_ROWS
    cfg = arm_config(BASE.replace(dim=32, vocab_size=40, max_seq_len=T), arm)
    stack = _initial_stack(cfg)
    models = [stack.model(i) for i in range(len(SEEDS))]
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (len(SEEDS), 1, T + 1), generator=g)
    docs = (torch.rand(len(SEEDS), 1, T, generator=g) < 0.01).cumsum(-1)
    got = stack.losses(tokens, doc_ids=docs)
    got.sum().backward()
    for i, m in enumerate(models):
        loss = lm_loss(m(tokens[i, :, :-1], doc_ids=docs[i]), tokens[i, :, 1:])
        loss.backward()
        assert float(got[i].detach()) == pytest.approx(float(loss.detach()), rel=1e-5)
        for name, p in stack.named_stacked():
            ref = dict(m.named_parameters())[name].grad
            torch.testing.assert_close(p.grad[i], ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()) + 1e-9)


def _benchmark(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_floor_counts_the_flops_of_each_product_form():
    floor = _benchmark("step_floor")
    assert floor.gemm_flops("aten::bmm", [[8, 1152, 64], [8, 64, 192]]) == 2 * 8 * 1152 * 64 * 192
    assert floor.gemm_flops("aten::baddbmm_", [[512, 72, 16], [512, 72, 72], [512, 72, 16], [], []]) == \
        2 * 512 * 72 * 72 * 16
    assert floor.gemm_flops("aten::mm", [[10, 3], [3, 7]]) == 2 * 10 * 3 * 7
    assert floor.gemm_flops("aten::addmm", [[7], [10, 3], [3, 7], [], []]) == 2 * 10 * 3 * 7


def test_step_floor_benchmark_runs_on_the_mixture(tmp_path, capsys):
    import json

    floor = _benchmark("step_floor")
    out = tmp_path / "floor.json"
    assert floor.main(["--preset", "smoke", "--k", "2", "--steps", "4", "--warmup", "1", "--seeds", "2",
                       "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert {r["arm"] for r in got["rows"]} == {"diff", "baseline"}
    for r in got["rows"]:
        assert 0 < r["gemm_share"] < 1 and r["gemm_gflop"] > 0 and r["draw_ms"] > 0
        assert set(r["by_kind"]) <= {"needle", "lm", "icl"} and sum(v["steps"] for v in r["by_kind"].values()) == 4
    assert 0 < got["floor_s"] < got["now_s"]
    assert "matrix products alone at peak" in capsys.readouterr().out
