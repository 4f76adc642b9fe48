"""The mechanism of recall per layer (issue 47 item 4): where each head looks from a query, by the role a
position plays for the binding asked for, against a uniform map; the size of each attention layer's output
against the residual stream; both along training (the trainer probes the initial model too), the same in a
stack of seeds as one by one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from difftx.config import ModelConfig
from difftx.eval.recall import (
    IGNORE,
    ROLES,
    RecallExamples,
    RecallSpec,
    attention_by_role,
    best_heads,
    generate,
    role_masks,
)
from difftx.eval.residual import attention_residual_ratio
from difftx.model import Transformer


def _model(kind: str, seed: int = 0, layers: int = 2) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=2, max_seq_len=32,
                                   attention=kind)).eval()


def _roles_by_hand(q: int, k: int, end: int) -> dict:
    """The roles of the positions 0..q, written out one position at a time."""
    out = {r: set() for r in ROLES}
    for p in range(q + 1):
        if p == k:
            out["key"].add(p)
        elif p == k + 1:
            out["value"].add(p)
        elif p in (k + 2, k + 3) and p < end:
            out["next_pair"].add(p)
        elif p in (q, q - 1):
            out["recent"].add(p)
        else:
            out["elsewhere"].add(p)
    return out


@pytest.mark.parametrize("q, k, end", [(10, 4, 8), (8, 6, 8), (12, 4, 8), (8, 4, 8), (9, 0, 8)])
def test_role_masks_split_the_positions_read(q, k, end):
    """A middle pair, the last pair (no next pair; the query right after it: the position before is the value),
    a query at the second gap, the pair before the last with the query right after the pairs."""
    masks = role_masks(torch.tensor([q]), torch.tensor([k]), torch.tensor([end]), 14)[0]  # (R, S)
    want = _roles_by_hand(q, k, end)
    assert {r: set(torch.nonzero(masks[i]).flatten().tolist()) for i, r in enumerate(ROLES)} == want
    assert masks.sum(0)[:q + 1].tolist() == [1] * (q + 1) and not masks[:, q + 1:].any()


@pytest.mark.parametrize("kind", ["diff", "standard"])
def test_role_masses_sum_to_the_row_and_uniform_is_right(kind):
    """Per head, the L1-normalised shares of the roles sum to 1 and the signed masses to the row's own total
    (read independently from the captured maps); the uniform reference is the roles' positions over the
    positions read, by hand."""
    from difftx.eval.capture import capture_attention

    ex = generate(RecallSpec(vocab_size=64, seq_len=32, n_pairs=4, variant="reassigned"), 5, seed=3)
    model = _model(kind)
    res = attention_by_role(model, ex, batch_size=2)
    b, q = torch.nonzero(ex.key_pos >= 0, as_tuple=True)
    assert res["queries"] == int(b.numel()) == 20
    with torch.no_grad(), capture_attention(model) as cap:
        model(ex.inputs)
    uniform = {r: 0.0 for r in ROLES}
    for i, j in zip(b.tolist(), q.tolist()):
        hand = _roles_by_hand(j, int(ex.key_pos[i, j]), 2 * (4 + 2))  # the pairs and the 2 keys bound again
        for r in ROLES:
            uniform[r] += len(hand[r]) / (j + 1) / len(b)
    assert res["uniform"] == pytest.approx(uniform, abs=1e-12)
    for layer in res["layers"]:
        rows = cap.maps[layer["layer"]][-1].effective[b, :, q, :].double()  # (N, H, S)
        totals = rows.sum(-1).mean(0)  # each head's mean signed row total
        for h in range(layer["heads"]):
            assert sum(layer["share"][r][h] for r in ROLES) == pytest.approx(1.0, abs=1e-9)
            assert sum(layer["signed"][r][h] for r in ROLES) == pytest.approx(float(totals[h]), abs=1e-6)
            assert all(v >= 0 for r in ROLES for v in [layer["share"][r][h]])
        assert layer["share_mean"]["key"] == pytest.approx(sum(layer["share"]["key"]) / layer["heads"])
    with pytest.raises(ValueError, match="attention_by_role: needs generated examples"):
        attention_by_role(model, RecallExamples(ex.inputs, ex.labels))


def test_roles_of_maps_we_write_ourselves(monkeypatch):
    """Maps put in place of the captured ones: head 0 uniform over the causal row scores exactly the uniform
    reference; head 1 on the value alone (an induction-style read) scores 1 on the value; head 2, the query
    itself with a negative weight on the key (a signed map), scores its share and signed mass there."""
    ex = generate(RecallSpec(vocab_size=64, seq_len=24, n_pairs=3), 4, seed=1)
    N, S = ex.inputs.shape
    eff = torch.zeros(N, 3, S, S)
    for i in range(N):
        for q in range(S):
            eff[i, 0, q, :q + 1] = 1.0 / (q + 1)
            k = int(ex.key_pos[i, q])
            if k >= 0:
                eff[i, 1, q, k + 1] = 1.0
                eff[i, 2, q, q], eff[i, 2, q, k] = 0.75, -0.25

    class Fake:
        maps = [[None]]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def last(self, layer):
            return SimpleNamespace(effective=eff)

    monkeypatch.setattr("difftx.eval.capture.capture_attention", lambda model: Fake())
    res = attention_by_role(_model("standard", layers=1), ex, batch_size=N)
    layer = res["layers"][0]
    for r in ROLES:
        assert layer["share"][r][0] == pytest.approx(res["uniform"][r], abs=1e-6)
        assert layer["share"][r][1] == pytest.approx(1.0 if r == "value" else 0.0, abs=1e-9)
    assert layer["share"]["recent"][2] == pytest.approx(0.75) and layer["share"]["key"][2] == pytest.approx(0.25)
    assert layer["signed"]["recent"][2] == pytest.approx(0.75) and layer["signed"]["key"][2] == pytest.approx(-0.25)
    best = best_heads(layer)
    assert best["value"] == (1, pytest.approx(1.0)) and best["recent"][0] == 2


@pytest.mark.parametrize("kind", ["diff", "standard"])
def test_output_ratio_matches_a_direct_reading(kind):
    """The ratio equals one read another way: each block's input and output and its MLP's output from forward
    hooks, the attention output being what is left (output - input - MLP), at the scored positions."""
    ex = generate(RecallSpec(vocab_size=64, seq_len=32, n_pairs=4), 5, seed=2)
    at = ex.labels != IGNORE
    model = _model(kind)
    got = attention_residual_ratio(model, ex.inputs, at, batch_size=2)
    seen: dict = {}
    hooks = []
    for i, block in enumerate(model.layers):
        hooks.append(block.register_forward_hook(lambda m, args, out, i=i: seen.update({("in", i): args[0],
                                                                                       ("out", i): out})))
        hooks.append(block.mlp.register_forward_hook(lambda m, args, out, i=i: seen.update({("mlp", i): out})))
    with torch.no_grad():
        model(ex.inputs)
    for h in hooks:
        h.remove()
    assert got["positions"] == int(at.sum()) == 20
    for i in range(len(model.layers)):
        x, mlp, out = seen[("in", i)], seen[("mlp", i)], seen[("out", i)]
        attn = (out - x - mlp)[at].double()
        resid = x[at].double()
        rms = (lambda v: v.pow(2).mean(-1).sqrt())  # noqa: E731
        assert got["ratio"][i] == pytest.approx(float((rms(attn) / rms(resid)).mean()), rel=1e-4)
        assert got["residual_rms"][i] == pytest.approx(float(rms(resid).mean()), rel=1e-6)
        assert got["attention_rms"][i] == pytest.approx(float(rms(attn).mean()), rel=1e-4)
    whole = attention_residual_ratio(model, ex.inputs)  # every position
    assert whole["positions"] == ex.inputs.numel()
    with pytest.raises(ValueError, match="at must be a bool tensor of shape"):
        attention_residual_ratio(model, ex.inputs, at[:, :3])
    with pytest.raises(ValueError, match="at selects no position"):
        attention_residual_ratio(model, ex.inputs, torch.zeros_like(at))
    with pytest.raises(ValueError, match="needs a difftx Transformer"):
        attention_residual_ratio(torch.nn.Linear(2, 2), ex.inputs)


def test_the_trainer_probes_the_initial_model_alike_in_a_stack(tmp_path):
    """Probe steps {0, 3, 6}: the initial model is probed before the first step (its ratio is the untrained
    model's), then the later steps; two seeds as one stack give the values of the two trained one by one
    (step 0 exactly, later to float32 rounding). A resumed run does not probe step 0 again; a plain ``every``
    probes no step 0; and a model trained without probes ends bit-identical."""
    from difftx.checkpoint import load_model
    from difftx.eval.recall import RecallSource
    from difftx.training import TrainConfig, train, train_stacked
    from difftx.training.metrics import lambda_per_layer, read_metrics
    from difftx.training.summary import METRICS_NAME

    spec = RecallSpec(vocab_size=32, seq_len=16, n_pairs=2)
    mc = ModelConfig(vocab_size=32, dim=32, n_layers=2, n_heads=2, max_seq_len=16)
    ex = generate(spec, 4, seed=5)

    def probe(model):
        return {"ratio": attention_residual_ratio(model, ex.inputs, ex.labels != IGNORE)["ratio"],
                "lambda": lambda_per_layer(model)}

    def config(out, seed):
        return TrainConfig(model=mc.to_dict(), seq_len=16, batch_size=8, steps=6, lr=3e-3, warmup_steps=1,
                           eval_interval=0, log_interval=3, ckpt_interval=6, out_dir=str(out), progress=False,
                           seed=seed)

    alone = [train(config(tmp_path / f"one{s}", s), data=RecallSource([spec], seed=s), model_config=mc,
                   probes=({0, 3, 6}, probe)) for s in (0, 1)]
    stack = train_stacked([config(tmp_path / f"stack{s}", s) for s in (0, 1)],
                          data=[RecallSource([spec], seed=s) for s in (0, 1)], model_config=mc,
                          probes=[({0, 3, 6}, probe)] * 2)
    for s, (one, many) in enumerate(zip(alone, stack)):
        assert sorted(one.probes) == sorted(many.probes) == [0, 3, 6]
        torch.manual_seed(s)
        assert one.probes[0]["ratio"] == attention_residual_ratio(
            Transformer(mc), ex.inputs, ex.labels != IGNORE)["ratio"]  # the initial model's
        assert many.probes[0] == one.probes[0]
        for step in (3, 6):
            assert many.probes[step]["ratio"] == pytest.approx(one.probes[step]["ratio"], rel=1e-4)
            assert many.probes[step]["lambda"] == pytest.approx(one.probes[step]["lambda"], rel=1e-4)
        assert one.probes[6]["ratio"] != one.probes[0]["ratio"]
    plain = train(config(tmp_path / "plain", 0), data=RecallSource([spec], seed=0), model_config=mc,
                  probes=(3, probe))
    assert sorted(plain.probes) == [3, 6]
    cut = config(tmp_path / "cut", 0)  # stopped after step 3 and resumed: the initial model is probed once
    train(cut, data=RecallSource([spec], seed=0), model_config=mc, probes=({0, 3, 6}, probe), stop_at=3)
    again = train(cut, data=RecallSource([spec], seed=0), model_config=mc, probes=({0, 3, 6}, probe), resume=True)
    logged = [r for r in read_metrics(tmp_path / "cut" / METRICS_NAME) if "probe" in r]
    assert sorted(again.probes) == [6] and [r["step"] for r in logged] == [0, 3, 6]
    for r in logged:  # the same values as the uninterrupted run's
        assert r["probe"]["ratio"] == pytest.approx(alone[0].probes[r["step"]]["ratio"], rel=1e-6)
    bare = train(config(tmp_path / "bare", 0), data=RecallSource([spec], seed=0), model_config=mc)
    probed, unprobed = (load_model(r.last_checkpoint).state_dict() for r in (alone[0], bare))
    assert all(torch.equal(probed[k], unprobed[k]) for k in probed)  # probing changes no weight, no random state
