"""A new attention kind is one class and one registration (docs/attention-kinds.md).

Three kinds registered the public way, each a natural first try of a user: QK-norm (overrides ``_qkv``;
the docs' worked example, run from the page itself), a per-head gain written the ordinary way in ``finish``,
and a learned per-head query scale with its own initialisation and options (the docs' second example).
Each trains alone and stacked with the same losses, keeps its initialisation through construction, trains
its own parameters, runs as a ``difftx compare`` arm, and is refused by the exporter."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import difftx
from difftx import ModelConfig, Transformer
from difftx.attention import ATTENTIONS
from difftx.config import arm_config, arm_names, attention_parameter_delta, baseline_config
from difftx.training import train, train_stacked
from difftx.training.stacked import StackedTransformer

sys.path.insert(0, str(Path(__file__).parent))
from test_stacked import Source, _train_config  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "attention-kinds.md"
STEPS, SEEDS = 20, (11, 12, 13)


class HeadGainAttention(difftx.StandardAttention):
    """A learned gain per head, written as one would for one model."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.full((self.n_heads,), 0.5))

    def finish(self, out, extra):
        return out * self.gain[:, None]


class ItemAttention(difftx.StandardAttention):
    """Reads a value inside its forward: torch.vmap cannot map it."""

    def finish(self, out, extra):
        return out * float(out.abs().max().item() > -1)


@pytest.fixture(scope="module")
def kinds():
    """The docs' examples (run from the page) and the two kinds above, registered; removed afterwards."""
    before = dict(ATTENTIONS)
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S):
        if "register_attention" in block:
            exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - the documentation's own code
    difftx.register_attention("headgain", HeadGainAttention)
    difftx.register_attention("item", ItemAttention)
    yield namespace
    ATTENTIONS.clear()
    ATTENTIONS.update(before)


def _config(kind: str, **extra) -> ModelConfig:
    return ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=2, max_seq_len=24, attention=kind, **extra)


OWN = {"qknorm": ("q_norm.weight", 1.0), "headgain": ("gain", 0.5), "qscale": ("scale", 1.0)}


@pytest.mark.parametrize("kind", ["qknorm", "headgain", "qscale"])
def test_a_kind_trains_alone_and_stacked_alike_keeps_its_init_and_trains_its_own_parameters(kind, kinds, tmp_path):
    cfg = _config(kind)
    name, value = OWN[kind]
    torch.manual_seed(0)
    model = Transformer(cfg)
    for block in model.layers:  # the kind's own initialisation survives the model's
        assert torch.equal(dict(block.attn.named_parameters())[name], torch.full_like(
            dict(block.attn.named_parameters())[name], value))
    tcs = [_train_config(cfg, seed, tmp_path / f"stack{seed}").replace(steps=STEPS, ckpt_interval=STEPS)
           for seed in SEEDS]
    stacked = train_stacked(tcs, data=[Source() for _ in SEEDS], model_config=cfg)
    for seed, result in zip(SEEDS, stacked):
        alone = train(_train_config(cfg, seed, tmp_path / f"alone{seed}").replace(steps=STEPS, ckpt_interval=STEPS),
                      data=Source(), model_config=cfg)
        worst = max(abs(result.losses[s] - alone.losses[s]) / alone.losses[s] for s in range(1, STEPS + 1))
        assert worst < 1e-5, f"{kind}, seed {seed}: stacked and alone differ by {worst:.1e} (relative)"
        trained = difftx.checkpoint.load_model(result.last_checkpoint)
        for block in trained.layers:  # the kind's own parameters moved
            p = dict(block.attn.named_parameters())[name]
            assert not torch.allclose(p, torch.full_like(p, value)), f"{kind}: {name} did not train"


def test_the_stack_maps_a_kind_that_overrides_a_hook_and_runs_the_built_in_ones_natively(kinds):
    for kind in ("diff", "diff_v2", "standard", "gated", "temperature", "converted", "dex"):
        assert ATTENTIONS[kind].stacks_natively()
    for kind in ("qknorm", "headgain", "qscale", "item"):
        assert not ATTENTIONS[kind].stacks_natively()
    torch.manual_seed(0)
    stack = StackedTransformer.from_models([Transformer(_config("headgain")) for _ in range(2)])
    assert not stack.native


def test_a_kind_the_stack_cannot_map_is_refused_in_one_line_when_the_stack_is_built(kinds):
    torch.manual_seed(0)
    models = [Transformer(_config("item")) for _ in range(2)]
    x = torch.randint(0, 96, (2, 9))
    models[0](x)  # alone it runs
    with pytest.raises(ValueError, match=r"attention kind 'item' \(ItemAttention\) cannot be trained stacked: "
                                         r"torch.vmap over its forward failed .*--set stack=1"):
        StackedTransformer.from_models(models)


def test_a_kind_that_fails_alone_too_is_not_told_to_train_alone(kinds):
    """A kind whose own forward raises is named as failing, without the advice (stack=1) that cannot help."""
    class Failing(difftx.StandardAttention):
        def finish(self, out, extra):
            raise RuntimeError("the kind's own bug")

    difftx.register_attention("failing_test", Failing)
    try:
        cfg = ModelConfig(vocab_size=96, dim=32, n_layers=1, n_heads=2, max_seq_len=16, attention="failing_test")
        models = [Transformer(cfg) for _ in range(2)]
        with pytest.raises(ValueError, match=r"attention kind 'failing_test' \(Failing\) fails in its forward or "
                                             r"backward, alone as stacked \(.*RuntimeError: the kind's own bug\)") as e:
            StackedTransformer.from_models(models)
        assert "stack=1" not in str(e.value)
    finally:
        ATTENTIONS.pop("failing_test", None)


def test_each_kind_is_an_arm_of_compare(kinds, tmp_path):
    from difftx.cli import main
    from test_compare import FAST, as_sets

    assert "qknorm" in arm_names() and "standard" not in arm_names()
    base = _config("diff")
    arm = arm_config(base, "qknorm")  # DIFF's query/key width: the baseline's heads
    assert (arm.attention, arm.n_heads, arm.head_dim) == ("qknorm", 4, base.head_dim)
    out = tmp_path / "arms"
    assert main(["compare", "--preset", "smoke", "--seeds", "2", "--out", str(out), "--workers", "1",
                 "--no-progress", "--arms", "qknorm,headgain,qscale", *as_sets(FAST)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert list(res["arms"]) == ["baseline", "diff", "qknorm", "headgain", "qscale"]
    for kind in ("qknorm", "headgain", "qscale"):
        assert res["arms"][kind]["config"]["attention"] == kind
        assert f"{kind} vs baseline" in res["comparisons"]


def test_what_a_kind_implies_is_asked_of_its_class(kinds):
    from difftx.interop.hf import ConversionError, check_exportable

    qk = _config("qknorm")
    assert baseline_config(qk) == _config("standard")
    rows = attention_parameter_delta(qk)
    assert [n for n, _, _ in rows] == ["k_norm.weight (QKNormAttention only, shape (16,))",
                                       "q_norm.weight (QKNormAttention only, shape (16,))"]
    assert sum(c for _, c, _ in rows) * qk.n_layers == Transformer(qk).num_parameters() - \
        Transformer(baseline_config(qk)).num_parameters()
    with pytest.raises(ConversionError, match="'qknorm' cannot be exported"):
        check_exportable(qk)
    check_exportable(_config("standard"))  # the built-ins keep their own rules
    # options: built by the kind's Options, validated there, passed to its __init__
    assert Transformer(_config("qscale", options={"init": 0.25})).layers[0].attn.scale[0] == 0.25
    with pytest.raises(ValueError, match="init must be positive"):
        _config("qscale", options={"init": -1.0})
    with pytest.raises(ValueError, match="ModelConfig.options: .*unexpected keyword argument 'gain'"):
        _config("qscale", options={"gain": 2.0})
    with pytest.raises(ValueError, match="takes no options"):
        _config("qknorm", options={"x": 1})
    assert ModelConfig.from_dict(_config("qscale", options={"init": 2.0}).to_dict()).options == {"init": 2.0}
    assert "options" not in _config("diff").to_dict()  # old configs serialise as before


def test_a_kind_built_on_a_built_in_does_not_inherit_what_the_built_in_asserts_about_itself():
    """Issue 50: parameter_delta, hf_refusal and hf_model_type are a kind's own (AttentionKind.OWN_RULES): a subclass
    of a built-in that does not define them gets AttentionKind's, declared once, with no guard per method; what it
    computes (its forward, its lambda warm-up) it inherits."""
    from difftx.attention.modules import AttentionKind, DiffAttention, GatedAttention, StandardAttention

    for parent in (StandardAttention, GatedAttention, DiffAttention):
        child = type(f"On{parent.__name__}", (parent,), {})
        for name in AttentionKind.OWN_RULES:
            assert child.__dict__[name] is AttentionKind.__dict__[name], (parent, name)
        assert child.hf_model_type is None and "cannot be exported" in child.hf_refusal(_config("standard"))
        assert child.forward is parent.forward and child.set_lambda_scale is parent.set_lambda_scale
    assert StandardAttention.hf_model_type == "llama" and DiffAttention.hf_model_type == "diffllama"
    assert StandardAttention.hf_refusal(_config("standard")) is None  # the built-ins keep their own
    model = Transformer(_config("diff"))
    from difftx.training.optim import set_lambda_scale

    set_lambda_scale(model, 0.25)  # the kind's own method: DIFF scales its lambda, a one-map kind has none
    assert all(b.attn.lambda_scale == 0.25 for b in model.layers)
    set_lambda_scale(Transformer(_config("standard")), 0.25)


def test_register_attention_refuses_what_it_cannot_take(kinds):
    with pytest.raises(TypeError, match="subclass of difftx.AttentionKind"):
        difftx.register_attention("bad", nn.Linear)
    with pytest.raises(ValueError, match="'qknorm' is already QKNormAttention"):
        difftx.register_attention("qknorm", HeadGainAttention)
    with pytest.raises(ValueError, match="identifier"):
        difftx.register_attention("not a name", HeadGainAttention)
    with pytest.raises(ValueError, match="'standard' is a built-in kind \\(StandardAttention\\)"):
        difftx.register_attention("standard", HeadGainAttention, replace=True)
    with pytest.raises(ValueError, match="register it with difftx.register_attention.*--kinds"):
        _config("unregistered")


def test_kinds_from_a_file_on_the_command_line(kinds, tmp_path, capsys, monkeypatch):
    from difftx.cli import main

    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0].replace('"qknorm"', '"qknorm_file"')
    (tmp_path / "mykinds.py").write_text(code)
    monkeypatch.setenv("DIFFTX_KINDS", "")  # restored afterwards: --kinds keeps its files there for workers
    assert main(["--kinds", str(tmp_path / "mykinds.py"), "info", "--attention", "qknorm_file"]) == 0
    assert "q_norm.weight (QKNormAttention only" in capsys.readouterr().out
    assert main(["--kinds", str(tmp_path / "missing.py"), "info"]) == 2
    assert f"no such file: {tmp_path / 'missing.py'}" in capsys.readouterr().err
    ATTENTIONS.pop("qknorm_file", None)


@pytest.mark.parametrize("body, line, what", [
    ("import torch\n\ndef broken(:\n    pass\n", 3, "SyntaxError"),
    ("import difftx\nx = 1\nundefined_name + 1\n", 3, "NameError: name 'undefined_name' is not defined"),
    ("import difftx\n\n\nclass Mine(difftx.StandardAttention):\n    pass\n\n\n"
     "difftx.register_attention('diff', Mine, replace=True)\n", 8, "'diff' is a built-in kind (DiffAttention)"),
    ("import no_such_package_here\n", 1, "ModuleNotFoundError"),
    ("import sys\n\nsys.exit(0)\n", 3, "SystemExit: it exits the program while being imported (exit code 0)"),
    ("import argparse\nargparse.ArgumentParser().parse_args(['--help'])\n", 2, "SystemExit"),
])
def test_a_bad_kinds_file_is_bad_input_named_by_file_and_line(body, line, what, tmp_path, capsys, monkeypatch):
    """A kinds file that does not import, or shadows a built-in kind, exits 2 with one line: the file, the line, why;
    the built-in kind is left as it was."""
    from difftx.attention.modules import DiffAttention
    from difftx.cli import main

    (tmp_path / "bad.py").write_text(body)
    monkeypatch.setenv("DIFFTX_KINDS", "")
    assert main(["--kinds", str(tmp_path / "bad.py"), "info", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"cannot import {tmp_path / 'bad.py'}:{line}: " in err and what in err, err
    assert ATTENTIONS["diff"] is DiffAttention
    assert main(["--kinds", "no_such_module_either", "info", "tiny"]) == 2
    assert "cannot import 'no_such_module_either': no such module" in capsys.readouterr().err


def test_two_kinds_files_of_one_name_both_load(kinds, tmp_path, monkeypatch):
    """a/k.py and b/k.py are two files: each registers its own kind (the second is not taken for the first)."""
    from difftx.attention.registry import load_kinds

    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "k.py").write_text(f"import difftx\n\n\nclass Mine(difftx.StandardAttention):\n    pass\n\n\n"
                                             f"difftx.register_attention('same_name_{sub}', Mine)\n")
    monkeypatch.setenv("DIFFTX_KINDS", "")
    try:
        load_kinds(f"{tmp_path / 'a' / 'k.py'},{tmp_path / 'b' / 'k.py'}")
        assert {"same_name_a", "same_name_b"} <= set(ATTENTIONS)
    finally:
        for sub in ("a", "b"):
            ATTENTIONS.pop(f"same_name_{sub}", None)


def test_a_kinds_module_named_by_import_name_is_an_input(kinds, tmp_path, capsys, monkeypatch):
    """``--kinds MODULE``: the module's file is protected as an input like a file given by path."""
    from difftx.cli import main

    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0].replace('"qknorm"', '"qknorm_module"')
    (tmp_path / "qk_module_kinds.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DIFFTX_KINDS", "")
    before = (tmp_path / "qk_module_kinds.py").read_bytes()
    try:
        code = main(["--kinds", "qk_module_kinds", "bench", "--seq-lens", "8", "--dim", "32", "--heads", "2",
                     "--repeats", "1", "--modes", "fwd", "--backends", "eager", "--json",
                     str(tmp_path / "qk_module_kinds.py")])
    finally:
        ATTENTIONS.pop("qknorm_module", None)
        sys.modules.pop("qk_module_kinds", None)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "is the kinds file" in err, err
    assert (tmp_path / "qk_module_kinds.py").read_bytes() == before


def test_low_bit_attention_says_not_measured_for_a_kind_with_its_own_forward(kinds):
    """A kind whose own forward computes attention without the kernel it is handed is never given the
    full-precision NLL as its low-bit NLL (an 'NLL change 0.000'): the task says it did not measure it."""
    import torch.nn.functional as F
    from types import SimpleNamespace

    from difftx.attention.modules import StandardAttention
    from difftx.eval.quant import kernel_bypass
    from difftx.tasks import TASKS
    from difftx.tasks.runner import run_task

    class OwnForward(StandardAttention):
        def forward(self, x, *, positions=None, mask=None, cache=None, backend=None, return_maps=False):
            q, k, v = self._qkv(x, positions, None, 0)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True)
            return self.out_proj(out.transpose(1, 2).flatten(-2))

    difftx.register_attention("own_forward_test", OwnForward)
    try:
        cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16)
        assert kernel_bypass(Transformer(cfg)) is None
        assert kernel_bypass(Transformer(cfg.replace(attention="diff"))) is None
        own = Transformer(cfg.replace(attention="own_forward_test"))
        why = kernel_bypass(own)
        assert why.startswith("not measured: the kind's own forward (OwnForward)") and "0 kernel calls" in why
        subject = SimpleNamespace(model=own, has_text=True, needle=None)
        res = run_task(TASKS["quant"], subject, TASKS["quant"].Settings())
        assert res["skipped"] == why and "nll" not in res
    finally:
        ATTENTIONS.pop("own_forward_test", None)


def test_a_kind_that_fails_in_its_forward_is_named_before_any_arm_trains(kinds, tmp_path):
    """compare tries one training step of every arm of a kind of your own first: the error names the arm, the file
    and the line, and nothing has been trained (it used to come after the other arms, advising stack=1)."""
    from difftx.compare import run_compare

    (tmp_path / "broken_kinds.py").write_text(
        "import difftx\n\n\nclass Broken(difftx.StandardAttention):\n    def finish(self, out, extra):\n"
        "        return out @ self.not_there\n\n\ndifftx.register_attention('broken_test', Broken)\n")
    from difftx.attention.registry import load_kinds

    load_kinds(str(tmp_path / "broken_kinds.py"))
    try:
        with pytest.raises(ValueError, match=rf"arm 'broken_test': .*\({tmp_path / 'broken_kinds.py'}:6: "
                                             r"AttributeError: 'Broken' object has no attribute 'not_there'\)"):
            run_compare("smoke", 1, tmp_path / "out", progress=False, arms=("baseline", "diff", "broken_test"))
        assert not (tmp_path / "out" / "seed0").exists()
    finally:
        ATTENTIONS.pop("broken_test", None)
