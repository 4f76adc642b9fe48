"""`difftx export` of the kinds no transformers class computes: difftx's own modeling file (trust_remote_code).

Every case is a tiny random difftx model (GQA: 4 heads over 2 kv groups) exported into its own folder; one
subprocess then loads them all where `import difftx` fails (python -I -S, only the site-packages folders on its
path, so difftx's editable-install hook never runs) and compares with what difftx computed here: the logits
(max |difference| / max |logit| <= 1e-5, float32), greedy `generate()` with transformers' KV cache (8 tokens, one
prompt and a left-padded batch of two) against difftx's own `generate`, and one cached decoding step against the
full forward."""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

import difftx  # noqa: E402
from difftx.attention import ATTENTIONS  # noqa: E402
from difftx.checkpoint import save_model  # noqa: E402
from difftx.cli import main as cli_main  # noqa: E402
from difftx.config import ModelConfig  # noqa: E402
from difftx.generation import generate  # noqa: E402
from difftx.interop import ConversionError, export_hf  # noqa: E402
from difftx.interop.convert import converted_config, converted_state, dex_config, dex_state  # noqa: E402
from difftx.model import Transformer  # noqa: E402
from remote_check import run_checker  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")
VOCAB, NEW, REL = 257, 8, 1e-5
BASE = dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def randomize(model: Transformer, seed: int) -> Transformer:
    """Non-trivial values everywhere: lambdas that matter (both pairs apart), gains far from one, a dex map far
    from the identity, temperatures away from 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lambda_" in name:
                p.copy_(0.4 * torch.randn(p.shape, generator=g))
            elif name.endswith("dex_map"):
                p.copy_(torch.eye(p.shape[0]) + 0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # norm gains, subln and log-temperatures
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g) if "temperature" not in name else
                        0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model.eval()


def from_standard(method: str, lambda_init: float = 0.0, heads=None) -> Transformer:
    """A ``converted`` (method mirror / random) or ``dex`` model made by difftx's conversion from a random standard
    model; then its lambdas (and dex map) moved off their start, as fine-tuning moves them."""
    cfg = ModelConfig(attention="standard", **BASE)
    source = randomize(Transformer(cfg), seed=7)
    state = source.state_dict()
    if method == "dex":
        conv_cfg, conv_state = dex_config(cfg, heads, lambda_init), dex_state(cfg, state, seed=1)
    else:
        conv_cfg, conv_state = converted_config(cfg, lambda_init), converted_state(cfg, state, method, seed=1)
    model = Transformer(conv_cfg)
    model.load_state_dict(conv_state)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lambda_" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("dex_map"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def tiny(**kw) -> Transformer:
    return randomize(Transformer(ModelConfig(**{**BASE, **kw})), seed=len(kw) + len(str(kw)))


CASES = {
    "diff_v2": lambda: tiny(attention="diff_v2"),
    "gated_elementwise": lambda: tiny(attention="gated", gate="elementwise"),
    "gated_headwise": lambda: tiny(attention="gated", gate="headwise", tie_embeddings=True),
    "converted_mirror": lambda: from_standard("mirror"),
    "converted_random": lambda: from_standard("random", lambda_init=0.3),
    "dex": lambda: from_standard("dex", heads=[[0, 2], [1, 2, 3]]),
    "temperature": lambda: tiny(attention="temperature"),
    "diff_nope": lambda: tiny(attention="diff", rope=False),
    "standard_nope": lambda: tiny(attention="standard", n_heads=8, n_kv_heads=2, rope=False),
    "diff_no_subtraction": lambda: tiny(attention="diff", subtract=False),
    "diff_no_head_norm_lambda_0.5": lambda: tiny(attention="diff", head_norm=False, lambda_init=0.5),
    "diff_lambda_0.8_out_0.2": lambda: tiny(attention="diff", lambda_init=0.8, out_scale=0.2, tie_embeddings=True),
    "standard_head_norm_out_schedule": lambda: tiny(attention="standard", head_norm=True, out_scale="schedule"),
    "standard_out_0.2": lambda: tiny(attention="standard", out_scale=0.2),
    "diff_forced": lambda: tiny(attention="diff"),  # exported with remote_code=True: the modeling file's V1
}
FORCED = {"diff_forced"}
CLI_CASE = "converted_mirror"  # also exported by `difftx export` from a checkpoint with a byte tokenizer

@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """Export every case, compute difftx's answers, run the checker once; its results by case."""
    tmp = tmp_path_factory.mktemp("remote")
    t0 = time.time()
    expect, cases, exported = {}, {}, {}
    for i, (name, make) in enumerate(CASES.items()):
        torch.manual_seed(i)
        model = make()
        folder = tmp / name
        if name == CLI_CASE:  # through the command line, from a checkpoint folder with difftx's byte tokenizer
            ckpt = tmp / "ckpt"
            save_model(model, ckpt)
            (ckpt / "tokenizer").mkdir()
            (ckpt / "tokenizer" / "difftx_tokenizer.json").write_text(
                '{"type": "byte", "vocab_size": 257, "eos_id": 256}')
            assert cli_main(["export", str(ckpt), str(folder)]) == 0
        else:
            export_hf(model, folder, remote_code=True if name in FORCED else None)
        exported[name] = model
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randint(0, VOCAB, (2, 24), generator=g)
        prompt = torch.randint(0, VOCAB, (10,), generator=g).tolist()
        batch = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 11)]
        with torch.no_grad():
            expect[name + ".tokens"] = x
            expect[name + ".logits"] = model(x, backend="eager").contiguous()
        cases[name] = {"folder": str(folder), "prompt": prompt, "batch": batch, "new": NEW,
                       "tokenizer": name == CLI_CASE,
                       "difftx_generated": generate(model, [prompt], NEW, temperature=0)[0],
                       "difftx_batch": generate(model, batch, NEW, temperature=0)}
    save_file(expect, str(tmp / "expect.safetensors"))
    t1 = time.time()
    results = run_checker(tmp, tmp / "expect.safetensors", cases)
    print(f"\nexport + difftx side {t1 - t0:.1f} s, checker subprocess {time.time() - t1:.1f} s")
    for name, res in results.items():
        print(f"{name:34s} max rel logits error {res['rel']:.2e}, cached step {res['step_rel']:.2e}, "
              f"{res['seconds']:.2f} s")
    return {"tmp": tmp, "results": results, "cases": cases, "models": exported}


@pytest.mark.parametrize("name", list(CASES))
def test_exported_kind_loads_without_difftx_and_matches(name, checked):
    res, case, model = checked["results"][name], checked["cases"][name], checked["models"][name]
    folder = Path(case["folder"])
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "difftx" and cfg["auto_map"] == {
        "AutoConfig": "configuration_difftx.DifftxConfig", "AutoModelForCausalLM": "modeling_difftx.DifftxForCausalLM"}
    assert ModelConfig.from_dict({("tie_embeddings" if k == "tie_word_embeddings" else k): cfg[k]
                                  for k in [*model.config.to_dict(), "tie_word_embeddings"]
                                  if k != "tie_embeddings"}) == model.config  # it carries the ModelConfig
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "modeling_difftx.py",
                                                   "configuration_difftx.py"}
    stored = load_file(str(folder / "model.safetensors"))
    ours = {k: v for k, v in model.state_dict().items() if not (model.config.tie_embeddings and k == "lm_head.weight")}
    assert sorted(stored) == sorted(k if k == "lm_head.weight" else "model." + k for k in ours)
    assert res["class"] == "DifftxForCausalLM" and "difftx/interop" not in res["module"]
    assert res["missing"] == [] and res["unexpected"] == []
    assert res["rel"] <= REL, f"{name}: max relative logits error {res['rel']:.3g}"
    assert res["cached_len"] == 23 and res["step_rel"] <= REL
    assert res["generated"] == case["difftx_generated"]
    assert res["batch"] == case["difftx_batch"]
    if case["tokenizer"]:
        assert res["tokens"] == list("h\u00e9llo".encode()) and res["eos"] == 256 and cfg["eos_token_id"] == 256


def test_the_modeling_files_import_only_torch_transformers_and_the_standard_library():
    import ast

    from difftx.interop import remote

    allowed = set(sys.stdlib_module_names) | {"torch", "transformers"}
    for name in remote.FILES:
        tree = ast.parse((remote.HERE / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                tops = set() if node.level else {node.module.split(".")[0]}  # relative: the other file
            else:
                continue
            assert tops <= allowed, f"{name}: imports {tops - allowed}"


def test_exact_classes_stay_the_default_and_remote_code_false_refuses(tmp_path):
    for kind, model_type in (("diff", "diffllama"), ("standard", "llama")):
        out = export_hf(Transformer(ModelConfig(attention=kind, **BASE)), tmp_path / kind)
        assert json.loads((out / "config.json").read_text())["model_type"] == model_type
        assert not (out / "modeling_difftx.py").exists()
    with pytest.raises(ConversionError, match="attention='gated' \\(gate='elementwise'\\) cannot be exported"):
        export_hf(Transformer(ModelConfig(attention="gated", **BASE)), tmp_path / "gated", remote_code=False)
    assert not (tmp_path / "gated").exists()


class _OwnKind(difftx.StandardAttention):
    def finish(self, out, extra):
        return out * 0.5


def test_a_registered_kind_is_refused_in_one_line_naming_it(tmp_path, capsys):
    before = dict(ATTENTIONS)
    difftx.register_attention("halfstd", _OwnKind)
    try:
        model = Transformer(ModelConfig(attention="halfstd", **BASE))
        for remote_code in (None, True):
            with pytest.raises(ConversionError, match="attention='halfstd' cannot be exported: _OwnKind is a "
                                                      "registered kind") as e:
                export_hf(model, tmp_path / "hf", remote_code=remote_code)
            assert "\n" not in str(e.value)
        save_model(model, tmp_path / "own")
        capsys.readouterr()
        assert cli_main(["export", str(tmp_path / "own"), str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err.strip()
        assert "attention='halfstd'" in err and len(err.splitlines()) == 1
        assert not (tmp_path / "hf").exists()  # nothing written
    finally:
        ATTENTIONS.clear()
        ATTENTIONS.update(before)


def test_export_keeps_its_folder_rules_for_remote_code(tmp_path, checked):
    """The remote-code export is written like the others: a non-empty folder only with --overwrite, never over
    its input."""
    src = checked["tmp"] / "ckpt"
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert cli_main(["export", str(src), str(out)]) == 2  # not empty
    assert (out / "mine.txt").read_text() == "keep"
    assert cli_main(["export", str(src), str(out), "--overwrite"]) == 0
    assert (out / "modeling_difftx.py").is_file() and not (out / "mine.txt").exists()
    before = sorted(p.name for p in src.iterdir())
    for target in (src, src.parent):  # the input itself, a folder holding it
        assert cli_main(["export", str(src), str(target), "--overwrite"]) == 2
    assert sorted(p.name for p in src.iterdir()) == before


def test_remote_lambda_is_kept_while_decoding_until_a_vector_changes(checked):
    """The exported code keeps lambda while generating (no gradients, a decoding step) and recomputes it after an
    in-place update of a lambda vector; a forward that is not a decoding step computes it; with gradients it is
    computed afresh and differentiable. A write through ``.data`` (no version counter moves) is read by the next
    forward and the next generation: before, a value kept from an earlier call outlived it."""
    import transformers

    folder = checked["cases"]["diff_forced"]["folder"]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    attn = model.model.layers[0].attn
    with torch.no_grad():
        first = attn.lambda_value()
        assert attn.lambda_value(reuse=True) is first  # kept
        assert attn.lambda_value() is not first  # not a decoding step: computed
        attn.lambda_q1.add_(0.25)
        second = attn.lambda_value(reuse=True)
    fresh = attn.lambda_value()
    assert fresh.requires_grad and torch.equal(second, fresh.detach()) and not torch.equal(first, second)

    prompt = torch.tensor([checked["cases"]["diff_forced"]["prompt"]])
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    model.generate(prompt, **settings)  # lambda kept by the last decoding step
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                getattr(layer.attn, name).data.mul_(1.7).add_(0.3)
    again = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    again.load_state_dict(model.state_dict())
    assert model.generate(prompt, **settings).tolist() == again.generate(prompt, **settings).tolist()
    with torch.no_grad():
        no_grad = model(prompt).logits
    torch.testing.assert_close(no_grad, model(prompt).logits.detach(), rtol=0, atol=1e-5)


def test_remote_code_returns_hidden_states_and_refuses_attentions(checked):
    """output_hidden_states was swallowed (None came back); output_attentions is refused in one line."""
    import transformers

    case, model = checked["cases"]["diff_forced"], checked["models"]["diff_forced"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(case["folder"], trust_remote_code=True,
                                                           dtype=torch.float32)
    x = torch.tensor([case["prompt"]])
    with torch.no_grad():
        out = hf(x, output_hidden_states=True)
        assert len(out.hidden_states) == model.config.n_layers + 1 and hf(x).hidden_states is None
        torch.testing.assert_close(out.hidden_states[0], model.tok_embeddings(x))
        torch.testing.assert_close(out.hidden_states[-1], model.hidden(x), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="output_attentions: not returned by this model's code"):
            hf(x, output_attentions=True)


def test_export_decode_benchmark_runs(capsys):
    """benchmarks/export_decode.py end to end at a tiny size: every arm loads in transformers and gets a row."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "export_decode.py"
    spec = importlib.util.spec_from_file_location("export_decode", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--dim", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--prompt", "8",
                           "--tokens", "2", "--rounds", "6"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for arm in ("llama", "mirror (remote code)", "baseline (Llama)", "diff (DiffLlama)", "diff (remote code)"):
        assert f"| {arm} | " in out
    assert "| llama | " in out and "1.000 [1.000, 1.000] (vs llama)" in out  # 6 rounds: an interval exists
