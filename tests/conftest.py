import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# The tests' models are tiny: one thread is faster for them than two (thread start-up and
# synchronisation dominate), and leaves the other core to the OS and multi-process tests.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def saved_once(root, specs: dict, make) -> dict:
    """Each transformers model of ``specs`` (name -> what ``make(spec, seed)`` builds from) saved once under
    ``root`` with save_pretrained, its seed its index: ``{name: (folder, model)}`` (the interop tests' fixtures)."""
    out = {}
    for i, (name, spec) in enumerate(specs.items()):
        model = make(spec, i)
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    return out
