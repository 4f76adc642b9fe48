"""Every built-in attention kind says how it is written out (`difftx export`): its class in difftx's modeling file
(`remote_kind`, a key of the file's KINDS table), and its exact fold into a plain Llama (`llama_fold`) or why there
is none (`llama_refusal`). The tests walk the registry, so a new built-in kind fails here until it declares both,
and each declaration is checked on a tiny random model: the modeling file computes difftx's logits, a fold gives
the same logits from a `standard` model, a refusal is one line. A kind of your own built on a built-in one
inherits none of it."""

from __future__ import annotations

import ast
import warnings

import pytest
import torch

import difftx
from difftx.attention import ATTENTIONS, TemperatureAttention
from difftx.attention.registry import BUILTIN_KINDS
from difftx.config import ModelConfig
from difftx.interop import ConversionError, export_hf, fold, remote
from difftx.model import Transformer

BASE = dict(vocab_size=61, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=32)
REL = 1e-5


def modeling_kinds() -> dict[str, str]:
    """The modeling file's KINDS table, read from its source (no transformers needed): name -> class name."""
    tree = ast.parse((remote.HERE / "modeling_difftx.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["KINDS"]:
            return {k.value: v.id for k, v in zip(node.value.keys, node.value.values)}
    raise AssertionError("modeling_difftx.py has no KINDS table")


def tiny(name: str, seed: int, moved: bool) -> Transformer:
    """A tiny model of kind ``name`` as built (``moved`` False: a converted model's lambda exactly 0, dex's W the
    identity), or with every parameter moved off its start."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(attention=name, **BASE)).eval()
    if moved:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_every_built_in_kind_names_its_class_in_the_modeling_file():
    table = modeling_kinds()
    named = {name: cls.remote_kind for name, cls in BUILTIN_KINDS.items()}
    assert None not in named.values(), f"built-in kinds with no class in modeling_difftx.py: {named}"
    assert set(named.values()) == set(table), (named, table)  # and the file has no class that no kind names
    for name in BUILTIN_KINDS:
        assert remote.refusal(ModelConfig(attention=name, **BASE)) is None


@pytest.mark.parametrize("name", sorted(BUILTIN_KINDS))
def test_the_modeling_file_computes_each_built_in_kind(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    warnings.filterwarnings("ignore", module="transformers")
    model = tiny(name, seed=3, moved=True)
    folder = export_hf(model, tmp_path / name, remote_code=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    x = torch.randint(0, BASE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_error(loaded.eval()(x).logits, model(x, backend="eager")) <= REL


def test_every_built_in_kind_folds_into_a_llama_or_says_why_not():
    x = torch.randint(0, BASE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    folded = set()
    for name, cls in BUILTIN_KINDS.items():
        config = ModelConfig(attention=name, **BASE)
        if cls.llama_fold is None:  # no fold: the kind's own reason, in one line
            reason = cls.llama_refusal(config)
            assert isinstance(reason, str) and reason and "\n" not in reason, name
            with pytest.raises(ConversionError, match=f"--as llama: attention='{name}': ") as e:
                fold.to_llama(config, tiny(name, seed=4, moved=True).state_dict())
            assert "\n" not in str(e.value)
            continue
        assert fold.refusal(config) is None, name
        for moved in (False, True):
            model = tiny(name, seed=5, moved=moved)
            try:
                llama_config, state = fold.to_llama(config, model.state_dict())
            except ConversionError as e:  # these weights do not fold (a converted model whose lambda moved)
                assert moved and "\n" not in str(e) and f"attention='{name}'" in str(e)
                continue
            assert llama_config.attention == "standard"
            llama = Transformer(llama_config).eval()
            llama.load_state_dict(state)
            with torch.no_grad():
                assert rel_error(llama(x), model(x)) <= REL, (name, moved)
            folded.add(name)
    assert folded == {n for n, c in BUILTIN_KINDS.items() if c.llama_fold is not None}


class _WarmTemperature(TemperatureAttention):
    """A kind of your own on a built-in one: its forward changes, so neither the built-in's class in the modeling
    file nor its fold computes it."""

    def finish(self, out, extra):
        return 2.0 * out


def test_a_kind_built_on_a_built_in_inherits_no_export():
    before = dict(ATTENTIONS)
    difftx.register_attention("warm", _WarmTemperature)
    try:
        config = ModelConfig(attention="warm", **BASE)
        assert _WarmTemperature.remote_kind is None and _WarmTemperature.llama_fold is None
        assert "_WarmTemperature is a registered kind with no code" in remote.refusal(config)
        assert "_WarmTemperature is a kind of your own with no fold" in fold.refusal(config)
    finally:
        ATTENTIONS.clear()
        ATTENTIONS.update(before)
