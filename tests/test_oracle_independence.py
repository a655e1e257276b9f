"""A test oracle never imports the code it judges: checked on the sources, with ``ast``.

Every helper module of ``tests/`` is classified here, so a new one must be: an oracle
module (computes reference values only; nothing in it, nor in the ``tests/`` modules it
imports, may import ``reap_modifier``), a module holding oracle functions beside input
builders (those functions may neither import ``reap_modifier`` nor use a name the module
imports from it), or an input builder (builds models, checkpoints or inputs with the
product, or runs its flow, and computes no expected value).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
#: where the suite's modules live: the tests, the oracles, the input builders
FOLDERS = (TESTS, TESTS / "oracles", TESTS / "helpers")
PRODUCT = "reap_modifier"

#: modules that compute reference values, and nothing else
ORACLE_MODULES = {
    "oracles": "float64 brute-force routing, experts, saliency statistics and pruning",
    "generic_oracle": "masked routing of any family",
    "ridge_oracle": "a block's output projections' ridge least squares, solved by numpy",
    "bias_oracle": "float64 block outputs for any score-correction bias, single-move scans",
    "checkpoint_oracle": "a saved checkpoint's tensors against the in-memory model and the source",
    "family_routing": "the hand-written router / bias table of the masked-routing oracle",
    "memory_probe": "which tensors are alive at once (the memory tests' measure)",
    "gguf_oracle": "safetensors pruned by hand and converted by llama.cpp's converter",
    "llama_cpp_probe": "a GGUF's logits in llama.cpp (run by the Python that has llama-cpp-python)",
    "mxfp4_gguf_oracle": "MXFP4 codes and values by the compressed-tensors and GGML specs",
}
#: reference functions in modules that also build inputs with the product
ORACLE_FUNCTIONS = {
    "eval_helpers": ["mean_nll"],
    "k3_testbed": ["reference_logits"],
    "mxfp4_fixtures": [
        "tree_sha256",
        "tensor_sha256",
        "load_tensors",
        "kept_experts_are_source_bytes",
    ],
    "test_evaluate": ["brute_force", "brute_repeat_run"],
    "test_evaluation": ["brute"],
    "test_input_gated": ["_brute_force"],
    "test_oracles_selfcheck": ["_by_hand_check"],
}
#: helper modules that compute no expected value
INPUT_BUILDERS = {
    "badinput": "corrupts checkpoints and scores files, runs the CLI",
    "paths": "puts tests/helpers and tests/oracles on sys.path",
    "conftest": "fixtures: tokenizer, datasets, saved tiny models",
    "converter_hooks": "patches llama.cpp's converter in its process: tokenizer name, a broken repack",
    "dist_worker": "runs the modifier under torchrun",
    "eval_models": "tiny checkpoints for reap eval, pruned by the rewriter",
    "family_flow": "runs the product's flow; its expected logits come from generic_oracle",
    "family_zoo": "tiny models of every family from transformers' configs",
    "gguf_synth": "synthetic GGUF models and importance matrices (the gguf package's writer)",
    "k3_mxfp4_synth": "synthetic K3-shaped MXFP4 checkpoints",
    "k3_testbed": "the K3-shaped MXFP4 test-bed for llama.cpp, pruned by the modifier",
    "launch": "runs a script alone or as torchrun ranks",
    "scores_synth": "synthetic scores files (the product's container, filled by index_add)",
    "tiny_models": "tiny deterministic models",
}


def product_imports(tree: ast.AST) -> list[str]:
    """Every ``import reap_modifier...`` / ``from reap_modifier... import`` in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == PRODUCT]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == PRODUCT:
                found.append(node.module)
    return found


def local_imports(tree: ast.AST) -> set[str]:
    """The ``tests/`` modules ``tree`` imports."""
    local = set(_modules())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & local


def product_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level from ``reap_modifier``."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if a.name.split(".")[0] == PRODUCT
            }
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == PRODUCT:
                names |= {a.asname or a.name for a in node.names}
    return names


def function_violations(tree: ast.Module, name: str) -> list[str]:
    """What oracle function ``name`` of ``tree`` takes from the product."""
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert funcs, f"no top-level function {name}"
    bound = product_names(tree)
    used = {n.id for n in ast.walk(funcs[0]) if isinstance(n, ast.Name)}
    return product_imports(funcs[0]) + sorted(used & bound)


def _modules() -> dict[str, Path]:
    """Every module of the suite by name (the names are unique: they are imported flat)."""
    return {p.stem: p for folder in FOLDERS for p in folder.glob("*.py")}


def _parse(module: str) -> ast.Module:
    return ast.parse(_modules()[module].read_text())


def test_oracle_modules_live_in_their_folder():
    """``tests/oracles/`` holds the oracle modules and nothing else; no other module sits
    there or shares a name with one."""
    there = {p.stem for p in (TESTS / "oracles").glob("*.py")}
    assert there == set(ORACLE_MODULES)
    names = [p.stem for folder in FOLDERS for p in folder.glob("*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_helper_module_is_classified():
    helpers = {n for n in _modules() if not n.startswith("test_")}
    classified = set(ORACLE_MODULES) | set(INPUT_BUILDERS) | set(ORACLE_FUNCTIONS)
    missing = sorted(helpers - classified)
    assert not missing, f"classify {missing} in tests/test_oracle_independence.py"
    assert not set(ORACLE_MODULES) & set(INPUT_BUILDERS)


@pytest.mark.parametrize("module", sorted(ORACLE_MODULES))
def test_oracle_module_imports_no_product_code(module):
    tree = _parse(module)
    assert product_imports(tree) == [], f"tests/{module}.py imports the code it judges"
    # the tests/ modules it uses must be oracles too (an input builder may import anything)
    assert local_imports(tree) <= set(ORACLE_MODULES), (module, local_imports(tree))


@pytest.mark.parametrize(
    "module, function", [(m, f) for m, fs in sorted(ORACLE_FUNCTIONS.items()) for f in fs]
)
def test_oracle_function_uses_no_product_code(module, function):
    assert function_violations(_parse(module), function) == [], f"tests/{module}.py:{function}"


def test_the_checks_see_product_code():
    """The detectors flag what they must (so the checks above can fail)."""
    tree = ast.parse(
        "import torch\n"
        "from reap_modifier.models import find_moe_architecture as fma\n"
        "import reap_modifier.wholeness\n"
        "from oracles import masked_routing\n"
        "def clean(x):\n    return torch.zeros(x)\n"
        "def uses(m):\n    return fma(m)\n"
        "def local(m):\n    from reap_modifier import wholeness\n    return wholeness\n"
    )
    assert product_imports(tree) == [
        "reap_modifier.models",
        "reap_modifier.wholeness",
        "reap_modifier",
    ]
    assert local_imports(tree) == {"oracles"}
    assert function_violations(tree, "clean") == []
    assert function_violations(tree, "uses") == ["fma"]
    assert function_violations(tree, "local") == ["reap_modifier"]
