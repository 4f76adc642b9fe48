"""The trainer with a batch source (difftx.training.batches): loss masks, batch kinds, an exact
model config without tokenizer, the probe hook, exact resume, and the masked loss."""

from __future__ import annotations

import json
import random

import pytest
import torch

from difftx.config import ModelConfig
from difftx.training import Batch, TrainConfig, train
from difftx.training.metrics import read_metrics
from difftx.training.batches import batch_loss_rows

VOCAB = 12
MODEL = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=2, max_seq_len=16)


class ToySource:
    """Copy task: a random prefix, then its copy; odd steps train on the copy only ("copy"),
    even steps on every position ("lm"). A global batch per step, rows sliced by rank."""

    def make_loader(self, config, dist):
        return ToyLoader(config.batch_size, dist.rank, dist.world_size, config.seed)


class ToyLoader:
    def __init__(self, batch_size, rank, world_size, seed):
        self.b, self.rank, self.world = batch_size, rank, world_size
        self.rng, self.step = random.Random(f"toy:{seed}"), 0

    def next_batch(self):
        self.step += 1
        rows = []
        for _ in range(self.b * self.world):
            n = self.rng.randint(2, 5)
            head = [self.rng.randrange(1, VOCAB) for _ in range(n)]
            rows.append(head + [0] + head + [0] * (12 - 2 * n))  # (T+1 = 13)
        tokens = torch.tensor(rows)
        mask = torch.zeros(len(rows), 12, dtype=torch.bool)
        for i, r in enumerate(rows):
            n = r.index(0)
            mask[i, n:2 * n] = True  # targets = the copy
        lo, hi = self.rank * self.b, (self.rank + 1) * self.b
        if self.step % 2 == 0:
            return Batch(tokens[lo:hi], kind="lm")
        return Batch(tokens[lo:hi], loss_mask=mask[lo:hi], kind="copy", mask_total=int(mask.sum()))

    def state_dict(self):
        v, internal, g = self.rng.getstate()
        return {"step": self.step, "rng": [v, list(internal), g]}

    def load_state_dict(self, state):
        v, internal, g = state["rng"]
        self.rng.setstate((v, tuple(internal), g))
        self.step = state["step"]


def _cfg(out, **kw):
    base = dict(model=MODEL.to_dict(), out_dir=str(out), steps=8, batch_size=4, seq_len=12, lr=1e-2, min_lr=1e-3,
                warmup_steps=1, eval_interval=0, log_interval=2, ckpt_interval=0, progress=False, tensorboard=False,
                device="cpu", seed=3)
    return TrainConfig(**{**base, **kw})


def test_batch_source_kinds_probes_and_exact_resume(tmp_path):
    calls = []

    def probe(model):
        assert not model.training and not torch.is_grad_enabled()
        calls.append(1)
        return {"param_sum": float(sum(p.sum() for p in model.parameters()))}

    full = train(_cfg(tmp_path / "full"), data=ToySource(), model_config=MODEL, probes=(3, probe))
    assert sorted(full.losses) == list(range(1, 9)) and full.losses[8] < full.losses[1]
    assert sorted(full.probes) == [3, 6, 8] and len(calls) == 3  # every 3 steps and at the last
    recs = read_metrics(tmp_path / "full" / "metrics.jsonl")
    logs = [r for r in recs if "loss" in r]
    assert [r["step"] for r in logs] == [2, 4, 6, 8]
    for r in logs:  # one copy step and one LM step per interval of 2
        assert r["copy_loss"] == pytest.approx(full.losses[r["step"] - 1], rel=1e-6)
        assert r["lm_loss"] == pytest.approx(full.losses[r["step"]], rel=1e-6)
    assert [(r["step"], r["probe"]) for r in recs if "probe" in r] == [(s, full.probes[s]) for s in (3, 6, 8)]
    # the exact model, no tokenizer saved
    ckpt = full.last_checkpoint
    assert json.loads((ckpt / "config.json").read_text()) == MODEL.to_dict() and not (ckpt / "tokenizer").exists()
    # stopped at step 4 and resumed: the same trajectory, bit for bit (loader state in trainer_state.json)
    cfg = _cfg(tmp_path / "resumed")
    first = train(cfg, data=ToySource(), model_config=MODEL, stop_at=4, probes=(3, probe))
    second = train(cfg, data=ToySource(), model_config=MODEL, resume=True, probes=(3, probe))
    assert {**first.losses, **second.losses} == full.losses
    assert {**first.probes, **second.probes} == full.probes
    assert [r for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl") if "probe" in r][-1]["step"] == 8


def test_masked_loss_is_the_mean_over_the_global_batch():
    """The trainer's loss of a masked batch (the model's forward with batch_loss_rows) against the full
    logits' cross-entropy over the mask: one rank's mean, and two ranks' halves averaged."""
    from difftx import Transformer

    torch.manual_seed(0)
    model = Transformer(MODEL)
    tokens = torch.randint(0, VOCAB, (2, 9))
    x, y = tokens[:, :-1], tokens[:, 1:]
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, [1, 4, 7]] = mask[1, [0, 2, 5, 6]] = True  # 3 + 4 = 7 positions
    full = torch.nn.functional.cross_entropy(model(x)[mask], y[mask])

    def loss(rows, total=None, world=1):
        b = Batch(tokens[rows], loss_mask=mask[rows], mask_total=total)
        return model(x[rows], targets=y[rows], **batch_loss_rows(b, world_size=world))

    assert torch.allclose(loss(slice(None)), full)
    assert torch.allclose(loss(slice(None), 7), full)
    # two ranks holding 3 and 4 of the 7 positions: the mean of their losses is the global mean
    assert torch.allclose((loss(slice(0, 1), 7, 2) + loss(slice(1, 2), 7, 2)) / 2, full)


def test_batch_source_refuses_validation_and_bad_probes(tmp_path):
    with pytest.raises(ValueError, match="eval_interval"):
        train(_cfg(tmp_path / "a", eval_interval=2), data=ToySource(), model_config=MODEL)
    with pytest.raises(ValueError, match="probes"):
        train(_cfg(tmp_path / "b"), data=ToySource(), model_config=MODEL, probes=(2, None))


def test_divergence_with_a_batch_source_stops_with_a_clear_error(tmp_path, monkeypatch):
    from difftx import model as model_mod
    from difftx.training import TrainingDivergedError

    real = model_mod.head_loss
    monkeypatch.setattr(model_mod, "head_loss", lambda *a: real(*a) * float("nan"))
    with pytest.raises(TrainingDivergedError, match="loss is nan at step 1"):
        train(_cfg(tmp_path / "nan"), data=ToySource(), model_config=MODEL)


@pytest.mark.parametrize("tie", [False, True])
def test_single_process_state_dicts_equal_the_distributed_checkpoint_ones(tie):
    """The single-process shortcut of ``full_state_dicts`` (no torch.distributed.checkpoint
    import) returns what ``get_model_state_dict`` / ``get_optimizer_state_dict`` return."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    )

    from difftx.model import Transformer
    from difftx.training.distributed import full_state_dicts, load_full_state_dicts
    from difftx.training.optim import build_optimizer

    model = Transformer(MODEL.replace(tie_embeddings=tie))
    opt = build_optimizer(model, _cfg("unused"))
    model(torch.randint(0, VOCAB, (2, 8))).sum().backward()
    opt.step()
    ms, os_ = full_state_dicts(model, opt)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    ref_m, ref_o = get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, opt, options=opts)
    assert ms.keys() == ref_m.keys() and all(torch.equal(ms[k], ref_m[k]) for k in ms)
    assert os_["param_groups"] == ref_o["param_groups"]
    assert os_["state"].keys() == ref_o["state"].keys()
    for name, st in ref_o["state"].items():
        assert st.keys() == os_["state"][name].keys() and all(torch.equal(v, os_["state"][name][k]) for k, v in st.items())
    # and it loads back
    fresh = Transformer(MODEL.replace(tie_embeddings=tie))
    fresh_opt = build_optimizer(fresh, _cfg("unused"))
    load_full_state_dicts(fresh, fresh_opt, ms, os_)
    assert fresh_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
