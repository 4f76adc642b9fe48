"""lm-evaluation-harness on an exported model, offline, on a task built from the bundled corpus:
the harness's per-choice log-likelihoods equal difftx's own (docs/interop.md recipe)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from difftx.checkpoint import save_model
from difftx.config import ModelConfig
from difftx.interop.lm_eval_task import DATA_NAME, TASK_NAME, next_line_items, task_yaml, write_next_line_task
from difftx.model import Transformer


def test_next_line_task_is_deterministic_and_well_formed(tmp_path):
    items = next_line_items(n_items=30, n_choices=4, seed=3)
    assert items == next_line_items(n_items=30, n_choices=4, seed=3)
    assert items != next_line_items(n_items=30, n_choices=4, seed=4)
    for it in items:
        assert len(it["choices"]) == 4 and len(set(it["choices"])) == 4 and 0 <= it["label"] < 4
        assert it["context"] not in it["choices"]
    assert len({it["label"] for it in items}) > 1  # the answer is not always in the same place
    yaml_path = write_next_line_task(tmp_path, n_items=5)
    rows = [json.loads(line) for line in (tmp_path / DATA_NAME).read_text().splitlines()]
    assert rows == next_line_items(n_items=5)
    text = yaml_path.read_text()
    assert text == task_yaml(tmp_path / DATA_NAME) and f"task: {TASK_NAME}" in text
    with pytest.raises(ValueError, match="split"):
        next_line_items(split="nope")


def _logprob(model: Transformer, context: str, continuation: str) -> float:
    ctx, cont = list(context.encode()), list(continuation.encode())
    x = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(x)[0, :-1].float(), dim=-1)  # (T-1, V): predicts tokens 1..T-1
    targets = x[0, len(ctx):]
    return logp[len(ctx) - 1:].gather(-1, targets[:, None]).sum().item()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("accelerate") is None,
                    reason="needs lm-eval and accelerate (pip install 'difftx[lmeval]' accelerate)")
@pytest.mark.parametrize("attention", ["diff", "converted"])
def test_lm_eval_harness_offline_matches_difftx(tmp_path, attention):
    """``diff`` exports as DiffLlama (no custom code); ``converted`` (a standard model made differential, its lambda
    moved as by fine-tuning) with difftx's own modeling code, which the harness loads with trust_remote_code."""
    pytest.importorskip("transformers")
    from difftx.interop import export_hf
    from difftx.interop.convert import converted_config, converted_state

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=257, dim=64, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=256)
    if attention == "converted":
        source = ModelConfig(vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256,
                             attention="standard")
        model = Transformer(converted_config(source))
        model.load_state_dict(converted_state(source, Transformer(source).state_dict(), "mirror", seed=1))
    else:
        model = Transformer(cfg)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambda" in name:
                p.normal_(0, 0.4)
    save_model(model, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "difftx_tokenizer.json").write_text('{"type": "byte", "vocab_size": 257, "eos_id": 256}')
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    write_next_line_task(tmp_path / "task", n_items=12)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "cache"), "TOKENIZERS_PARALLELISM": "false"}
    remote = ",trust_remote_code=True" if attention == "converted" else ""
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf",
           "--model_args", f"pretrained={tmp_path / 'hf'},dtype=float32{remote}", "--device", "cpu",
           "--batch_size", "8",
           "--include_path", str(tmp_path / "task"), "--tasks", TASK_NAME,
           "--output_path", str(tmp_path / "results"), "--log_samples"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    samples = [json.loads(line) for f in sorted((tmp_path / "results").rglob(f"samples_{TASK_NAME}_*.jsonl"))
               for line in f.read_text().splitlines()]
    results = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())["results"][TASK_NAME]
    assert len(samples) == 12
    correct = 0
    for s in samples:
        doc = s["doc"]
        theirs = [float(r[0][0]) for r in s["resps"]]
        # the harness moves the context's trailing newline into the continuation
        ours = [_logprob(model, doc["context"], "\n" + c) for c in doc["choices"]]
        assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-3)
        correct += int(max(range(len(ours)), key=ours.__getitem__) == doc["label"])
    assert results["acc,none"] == pytest.approx(correct / len(samples))
