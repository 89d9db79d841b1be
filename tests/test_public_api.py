"""The public API did not move when the package was regrouped: every name of `tensorpar`,
`tensorpar.nn` and `tensorpar.testing`, and the modules that used to live there."""

import importlib

import pytest

FORMER_MODULES = {
    "tensorpar": ["functional", "reducer", "regions", "topology"],
    "tensorpar.nn": ["checkpoint", "clip", "conv1d", "convert", "data_parallel", "embedding",
                     "hf_checks", "hf_experts", "hf_mla", "hf_plan", "hf_sequence",
                     "inplace_styles", "linear", "loss", "modules", "optim_checkpoint",
                     "partial_grad", "plan", "random", "sequence_plan"],
}


@pytest.mark.parametrize("module", ["tensorpar", "tensorpar.nn", "tensorpar.testing"])
def test_every_public_name_imports(module):
    m = importlib.import_module(module)
    assert m.__all__ and [n for n in m.__all__ if not hasattr(m, n)] == []


@pytest.mark.parametrize("module", sorted(FORMER_MODULES))
def test_the_former_module_paths_are_still_attributes(module):
    m = importlib.import_module(module)
    for name in FORMER_MODULES[module]:
        assert importlib.import_module(getattr(m, name).__name__) is getattr(m, name)
    assert m.functional.scatter is m.scatter if module == "tensorpar" else True
