"""A differential model leaves difftx (issue 51, item 5): a tiny random transformers Llama or Qwen2 folder (its q/k/v
biases random too) is converted to differential attention (`difftx convert`, methods mirror and dex), fine-tuned a
few steps (`difftx train --init-from`, λ moves), exported (`difftx export`: difftx's own modeling code) and loaded
by transformers in a process where difftx cannot be imported (tests/remote_check.py). Its logits match the
fine-tuned model's in difftx (max |difference| / max |logit| <= 1e-5, float32), and so do greedy continuations with
transformers' KV cache."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from safetensors.torch import save_file  # noqa: E402

from difftx.checkpoint import load_model  # noqa: E402
from difftx.cli import main  # noqa: E402
from difftx.data.tokenizer import byte_tokenizer_json  # noqa: E402
from difftx.generation import generate  # noqa: E402
from difftx.interop.hf import resolve_model_folder  # noqa: E402
from remote_check import run_checker  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")
VOCAB, NEW, REL = 257, 6, 1e-5
TRAIN = ["--preset", "tiny", "--set", "steps=20", "--set", "batch_size=4", "--set", "seq_len=32", "--set", "lr=0.01",
         "--set", "warmup_steps=2", "--set", "eval_interval=10", "--set", "eval_batches=1", "--set", "log_interval=10",
         "--set", "ckpt_interval=10", "--set", "device=cpu", "--set", "tensorboard=false"]
METHODS = {"mirror": [], "dex": ["--dex-heads", "0.5"]}
SOURCES = ("llama", "qwen2")
CASES = [f"{source}-{method}" for source in SOURCES for method in METHODS]
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _source(family: str, folder: Path) -> None:
    """A random transformers model with a byte-level tokenizer.json: Llama (untied), or Qwen2 (tied, as Qwen2
    usually is) with random q/k/v biases."""
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.bias"):
                    p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(byte_tokenizer_json())


@pytest.fixture(scope="module")
def trip(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trip")
    for family in SOURCES:
        _source(family, tmp / family)
    (tmp / "text.txt").write_text("Shall I compare thee to a summer's day? Thou art more lovely and more temperate.\n"
                                  * 200)
    expect, cases, models = {}, {}, {}
    for i, case in enumerate(CASES):
        family, method = case.split("-")
        conv, run, out = tmp / f"conv-{case}", tmp / f"run-{case}", tmp / f"hf-{case}"
        assert main(["convert", str(tmp / family), str(conv), "--method", method, *METHODS[method]]) == 0
        assert main(["train", "--init-from", str(conv), "--data", str(tmp / "text.txt"), "--out", str(run),
                     "--no-progress", *TRAIN]) == 0
        assert main(["export", str(run), str(out)]) == 0
        model = load_model(resolve_model_folder(run)).eval()  # the run's latest checkpoint, as export reads it
        models[case] = (load_model(conv).eval(), model)
        g = torch.Generator().manual_seed(10 + i)
        x = torch.randint(0, VOCAB, (2, 20), generator=g)
        prompt = torch.randint(0, 256, (8,), generator=g).tolist()
        batch = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9)]
        with torch.no_grad():
            expect[case + ".tokens"] = x
            expect[case + ".logits"] = model(x, backend="eager").contiguous()
        cases[case] = {"folder": str(out), "prompt": prompt, "batch": batch, "new": NEW, "tokenizer": True,
                         "difftx_generated": generate(model, [prompt], NEW, temperature=0)[0],
                         "difftx_batch": generate(model, batch, NEW, temperature=0)}
    save_file(expect, str(tmp / "expect.safetensors"))
    results = run_checker(tmp, tmp / "expect.safetensors", cases)
    for case, res in results.items():
        print(f"\n{case}: max rel logits error {res['rel']:.2e}, cached step {res['step_rel']:.2e}")
    return {"results": results, "cases": cases, "models": models}


@pytest.mark.parametrize("name", CASES)
def test_a_converted_and_fine_tuned_model_loads_in_transformers_without_difftx(trip, name):
    res, case = trip["results"][name], trip["cases"][name]
    start, tuned = trip["models"][name]
    pairs = zip(start.named_parameters(), tuned.named_parameters())
    moved = [float((a - b).detach().abs().max()) for (n, a), (_, b) in pairs if "lambda" in n]
    assert moved and max(moved) > 0, "fine-tuning left every lambda parameter where conversion put it"
    assert start.config.qkv_bias == name.startswith("qwen2")  # the biases travelled through each step
    assert json.loads((Path(case["folder"]) / "config.json").read_text())["model_type"] == "difftx"
    assert res["class"] == "DifftxForCausalLM" and "difftx/interop" not in res["module"]
    assert res["missing"] == [] and res["unexpected"] == []
    assert res["rel"] <= REL, f"{name}: max relative logits error {res['rel']:.3g}"
    assert res["step_rel"] <= REL
    assert res["generated"] == case["difftx_generated"] and res["batch"] == case["difftx_batch"]
    assert res["tokens"] == list("h\u00e9llo".encode())  # the source's tokenizer.json travelled with the model
