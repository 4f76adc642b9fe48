"""``train_stacked``: K seeds of one config trained as one stacked model through the one trainer.
Each model's logged losses equal separate ``train()``'s to rel 1e-5 over 50 steps, on exactly
the same batches; probes and validation see each model's own weights; checkpoints are ordinary
(``load_model`` reads them, ``train`` resumes them); the stack's own resume is bitwise."""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path

import pytest
import torch

from difftx.checkpoint import load_model
from difftx.config import ModelConfig
from difftx.model import Transformer
from difftx.training import TrainConfig, train, train_preset
from difftx.training import checkpointing as ckpt
from difftx.training.metrics import read_metrics
from difftx.training.trainer import train_stacked

sys.path.insert(0, str(Path(__file__).parent))
from test_train_batches import VOCAB, ToySource  # noqa: E402

SEEDS = (0, 1, 2)


class Recording(ToySource):
    """The toy copy task, remembering a hash of every batch its loader hands out."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def make_loader(self, config, dist):
        loader, seen = super().make_loader(config, dist), self.seen
        original = loader.next_batch

        def next_batch():
            b = original()
            seen.append(hashlib.sha256(b.tokens.numpy().tobytes()).hexdigest()[:12])
            return b

        loader.next_batch = next_batch
        return loader


def _probe(model) -> dict:
    return {"logit_sum": float(model(torch.arange(1, 13).remainder(VOCAB).unsqueeze(0)).float().sum())}


def _config(root: Path, name: str, seed: int, **kw) -> TrainConfig:
    base = dict(out_dir=str(root / f"{name}{seed}"), steps=50, warmup_steps=5, batch_size=4, seq_len=12,
                eval_interval=0, log_interval=5, ckpt_interval=25, progress=False, lr=3e-3, seed=seed, grad_accum=2)
    return TrainConfig(**{**base, **kw})


def _logged(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)


@pytest.mark.parametrize("attention, rope, bias", [("diff", True, False), ("standard", True, False),
                                                   ("temperature", True, False), ("converted", True, False),
                                                   ("dex", True, False), ("diff", False, False),
                                                   ("standard", True, True), ("dex", True, True)])
def test_stack_equals_separate_training_on_the_same_batches(tmp_path, attention, rope, bias):
    """Every built-in kind (and NoPE, rope=False; Qwen2's q/k/v biases, qkv_bias) trains 50 steps stacked as
    alone, and keeps its own init."""
    torch.set_num_threads(1)
    model = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2 if attention == "diff" else 4,
                        max_seq_len=16, attention=attention, rope=rope, qkv_bias=bias)
    if attention == "temperature":  # its log-temperatures start at 0: the baseline's function
        assert all(not b.attn.log_temperature.any() for b in Transformer(model).layers)
    alone, together = [Recording() for _ in SEEDS], [Recording() for _ in SEEDS]
    sep = [train(_config(tmp_path, "sep", s), data=src, model_config=model, probes=(10, _probe))
           for s, src in zip(SEEDS, alone)]
    st = train_stacked([_config(tmp_path, "st", s) for s in SEEDS], data=together, model_config=model,
                       probes=[(10, _probe)] * len(SEEDS))
    for s, a, b, sa, sb in zip(SEEDS, sep, st, alone, together):
        assert sb.seen == sa.seen and len(sa.seen) == 100  # 50 steps x 2 micro-batches, the same batches
        assert sorted(b.losses) == list(range(1, 51))
        assert all(_close(a.losses[k], b.losses[k]) for k in a.losses), s
        la, lb = _logged(tmp_path / f"sep{s}"), _logged(tmp_path / f"st{s}")
        assert [r["step"] for r in la] == [r["step"] for r in lb]
        for ra, rb in zip(la, lb):  # every logged loss: the step's, each kind's, gradient norms, lambda
            for key in ("loss", "copy_loss", "lm_loss", "grad_norm"):
                assert _close(ra[key], rb[key]), (s, ra["step"], key)
            assert all(_close(x, y) for x, y in zip(ra["grad_norms"], rb["grad_norms"]))
            # lambda = exp(q1.k1) - exp(q2.k2) + lambda_init: near 0 it resolves only what float32 resolves near 1
            assert all(math.isclose(x, y, rel_tol=1e-5, abs_tol=5e-7)
                       for x, y in zip(ra["lambda"] or [], rb["lambda"] or []))
        assert sorted(a.probes) == sorted(b.probes) == [10, 20, 30, 40, 50]
        assert all(math.isclose(a.probes[k]["logit_sum"], b.probes[k]["logit_sum"], rel_tol=1e-4, abs_tol=1e-4)
                   for k in a.probes)
        # an ordinary checkpoint: load_model reads it; its weights are the separate run's to rounding
        wa = load_model(a.last_checkpoint).state_dict()
        wb = load_model(b.last_checkpoint).state_dict()
        assert all(torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-5) for k in wa)
        if attention == "temperature":  # its own parameters trained
            assert all(k.endswith("log_temperature") <= bool(wb[k].abs().max() > 0) for k in wb)
        if bias:  # the biases start at 0 and train
            assert all(k.endswith("proj.bias") <= bool(wb[k].abs().max() > 0) for k in wb)
            assert any(k.endswith("q_proj.bias") for k in wb)
    assert len({round(r.losses[50], 6) for r in st}) == len(SEEDS)  # three different models


def test_a_lambda_warmup_starts_at_the_source_and_trains_stacked_as_alone(tmp_path):
    """TrainConfig.lambda_warmup: lambda is scaled by (step - 1) / N, so the first step of a converted model with
    lambda_init 0.8 computes what lambda_init 0 computes; alone and stacked, the same losses and scales are logged;
    the trained model subtracts its whole lambda."""
    from difftx.training.optim import lambda_scale_at

    torch.set_num_threads(1)
    model = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, max_seq_len=16, attention="converted",
                        lambda_init=0.8)
    kw = dict(steps=30, ckpt_interval=0, lambda_warmup=10)
    sep = [train(_config(tmp_path, "sep", s, **kw), data=ToySource(), model_config=model) for s in SEEDS[:2]]
    st = train_stacked([_config(tmp_path, "st", s, **kw) for s in SEEDS[:2]], data=[ToySource() for _ in SEEDS[:2]],
                       model_config=model)
    zero = train(_config(tmp_path, "zero", 0, steps=1, warmup_steps=1, ckpt_interval=0), data=ToySource(),
                 model_config=model.replace(lambda_init=None))
    offset = train(_config(tmp_path, "nowarm", 0, steps=1, warmup_steps=1, ckpt_interval=0), data=ToySource(),
                   model_config=model)
    assert sep[0].losses[1] == zero.losses[1] != offset.losses[1]  # step 1 subtracts nothing
    for s, a, b in zip(SEEDS, sep, st):
        assert all(_close(a.losses[k], b.losses[k]) for k in a.losses), s
        la, lb = _logged(tmp_path / f"sep{s}"), _logged(tmp_path / f"st{s}")
        tc = _config(tmp_path, "sep", s, **kw)
        assert [r["lambda_scale"] for r in la] == [r["lambda_scale"] for r in lb] == \
            [min(1.0, (r["step"] - 1) / 10) for r in la] == [lambda_scale_at(r["step"], tc) for r in la]
        assert la[-1]["lambda_scale"] == 1.0 and all(x > 0.5 for x in la[-1]["lambda"])  # 0.8 + its learned part
        assert all(b.attn.lambda_scale == 1.0 for b in load_model(a.last_checkpoint).layers)
    assert "lambda_scale" not in _logged(tmp_path / "nowarm0")[0]
    with pytest.raises(ValueError, match="lambda_warmup=30 must be below steps=30"):
        _config(tmp_path, "bad", 0, steps=30, lambda_warmup=30)


def test_stack_resume_is_bitwise_and_train_continues_its_checkpoints(tmp_path):
    torch.set_num_threads(1)
    model = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, max_seq_len=16)
    configs = [_config(tmp_path, "full", s) for s in SEEDS]
    full = train_stacked(configs, data=[ToySource() for _ in SEEDS], model_config=model)
    half = [_config(tmp_path, "half", s) for s in SEEDS]
    first = train_stacked(half, data=[ToySource() for _ in SEEDS], model_config=model, stop_at=20)
    assert [r.step for r in first] == [20] * 3
    rest = train_stacked(half, data=[ToySource() for _ in SEEDS], model_config=model, resume=True)
    for f, a, b in zip(full, first, rest):
        assert b.resumed_from == 20 and {**a.losses, **b.losses} == f.losses  # bitwise
        wf, wb = load_model(f.last_checkpoint).state_dict(), load_model(b.last_checkpoint).state_dict()
        assert all(torch.equal(wf[k], wb[k]) for k in wf)
    # one model of the stack continued alone by the ordinary trainer: the same trajectory to rounding
    solo = train(_config(tmp_path, "half", 1, steps=60), data=ToySource(), model_config=model, resume=True)
    assert solo.resumed_from == 50 and sorted(solo.losses) == list(range(51, 61))


def test_text_data_with_validation(tmp_path):
    torch.set_num_threads(1)
    src = tmp_path / "text.txt"
    src.write_text(" ".join(f"word{i % 37} and {i % 11}" for i in range(3000)))
    kw = dict(data_source=str(src), cache_dir=str(tmp_path / "cache"), val_fraction=0.1, steps=8, warmup_steps=2,
              batch_size=4, seq_len=32, eval_interval=4, eval_batches=2, log_interval=2, ckpt_interval=0,
              progress=False)
    sep = [train(train_preset("test", out_dir=str(tmp_path / f"sep{s}"), seed=s, **kw)) for s in SEEDS[:2]]
    model = sep[0].model_config
    st = train_stacked([train_preset("test", out_dir=str(tmp_path / f"st{s}"), seed=s, **kw) for s in SEEDS[:2]],
                       data=[None, None], model_config=model)
    for a, b in zip(sep, st):
        assert sorted(a.val_losses) == sorted(b.val_losses) == [4, 8]
        assert all(_close(a.losses[k], b.losses[k]) for k in a.losses)
        assert all(_close(a.val_losses[k], b.val_losses[k]) for k in a.val_losses)


def test_what_a_stack_refuses(tmp_path):
    model = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=2, max_seq_len=16)
    with pytest.raises(ValueError, match=r"may differ only in .*differs from .* in \['lr'\]"):
        train_stacked([_config(tmp_path, "a", 0), _config(tmp_path, "a", 1, lr=1e-3)], data=[ToySource()] * 2,
                      model_config=model)
    with pytest.raises(ValueError, match="its own out_dir"):
        train_stacked([_config(tmp_path, "b", 0), _config(tmp_path, "b", 0)], data=[ToySource()] * 2,
                      model_config=model)
    with pytest.raises(ValueError, match="as many data sources"):
        train_stacked([_config(tmp_path, "c", 0)], data=[], model_config=model)
    train(_config(tmp_path, "d", 0, steps=10, ckpt_interval=5), data=ToySource(), model_config=model, stop_at=5)
    with pytest.raises(ValueError, match="resume from different steps"):
        train_stacked([_config(tmp_path, "d", 0), _config(tmp_path, "d", 1)], data=[ToySource()] * 2,
                      model_config=model, resume=True)
    # the refusal wrote nothing: d0 resumes as it was saved (10 steps); d1 was never started
    assert '"steps": 10' in (tmp_path / "d0" / ckpt.TRAIN_CONFIG_NAME).read_text()
    assert not (tmp_path / "d1" / "metrics.jsonl").exists()
    done = train_stacked([_config(tmp_path, "d", 0, steps=10)], data=[ToySource()], model_config=model, resume=True)
    assert done[0].resumed_from == 5 and done[0].step == 10


def test_a_diverging_model_stops_the_stack_naming_it(tmp_path, monkeypatch):
    from difftx.training import TrainingDivergedError
    from difftx.training.stacked import StackedTransformer

    model = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=2, max_seq_len=16)
    real = StackedTransformer.losses

    def nan_for_the_second(self, *a, **k):
        out = real(self, *a, **k)
        return out * torch.tensor([1.0, float("nan"), 1.0])

    monkeypatch.setattr(StackedTransformer, "losses", nan_for_the_second)
    with pytest.raises(TrainingDivergedError, match=r"g1: loss is nan at step 1; stopped before applying"):
        train_stacked([_config(tmp_path, "g", s) for s in SEEDS], data=[ToySource() for _ in SEEDS],
                      model_config=model)
