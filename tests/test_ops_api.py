"""The CUDA ops module offers every function of the reference ops (the engine calls either)."""
from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def public_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    for node in tree.body:  # re-exports count too
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kernels."):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def test_cuda_ops_cover_every_reference_op():
    reference = public_functions(KERNELS / "reference.py")
    assert reference - public_functions(KERNELS / "ops.py") == set()
