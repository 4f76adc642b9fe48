"""Bad input said as such (issue R6): a Hub-style folder where a difftx checkpoint is expected."""

import json

import pytest

from difftx.checkpoint import CheckpointError, load_config
from difftx.cli import main

LLAMA = {"hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 4, "num_hidden_layers": 2,
         "num_key_value_heads": 2, "vocab_size": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "max_position_embeddings": 128, "tie_word_embeddings": False, "torch_dtype": "float32"}


@pytest.mark.parametrize("extra", [{}, {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}])
def test_a_transformers_folder_where_a_checkpoint_is_expected_says_what_reads_it(extra, tmp_path, capsys):
    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, **extra}))
    with pytest.raises(CheckpointError, match=r"looks like a Hugging Face transformers folder .*`difftx import "
                                              r".*hub OUT`.*`difftx convert .*hub OUT`"):
        load_config(folder)
    assert main(["generate", str(folder), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "looks like a Hugging Face transformers folder" in err and "unknown field" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_difftx_config_with_a_bad_field_is_still_named_as_such(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dim": 64, "n_layers": 2, "bogus": 1}))
    with pytest.raises(CheckpointError, match=r"invalid model config: ModelConfig: unknown field\(s\) \['bogus'\]"):
        load_config(tmp_path)
