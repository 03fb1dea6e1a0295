"""Triton kernels launch on their tensors' GPU, not the current one (kernels/launch_device.py):
what a tensor-parallel rank >= 1 relies on. Every launch in kernels/ sits inside
`launch_device(...)` (read from the source, so a new launch cannot forget it); on a machine
with two GPUs, every kernel case runs on the second while the first is current."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests.kernels.kernel_cases import CASES

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"


def _jit_functions(tree: ast.Module) -> set[str]:
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and any(ast.unparse(d) == "triton.jit" for d in node.decorator_list)}


def _unguarded_launches(path: Path) -> list[str]:
    """`kernel[grid](...)` calls of this module's @triton.jit functions outside a
    `with launch_device(...)` block."""
    tree = ast.parse(path.read_text())
    kernels = _jit_functions(tree)
    unguarded: list[str] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.With):
            guarded = guarded or any(isinstance(item.context_expr, ast.Call)
                                     and ast.unparse(item.context_expr.func) == "launch_device"
                                     for item in node.items)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in kernels
                and not guarded):
            unguarded.append(f"{path.name}:{node.lineno} {node.func.value.id}")
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return unguarded


def test_every_launch_is_on_its_tensors_device() -> None:
    launching = [p for p in sorted(KERNELS_DIR.glob("triton_*.py"))
                 if _jit_functions(ast.parse(p.read_text()))]
    assert len(launching) >= 7   # cache, decode, prefill, fused MoE, layer ops, LoRA, W4A16
    assert [u for p in launching for u in _unguarded_launches(p)] == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kernel_cases_on_the_second_gpu() -> None:
    torch.cuda.set_device(0)
    for case in CASES.values():
        case.run("cuda:1")   # raises with the case's mismatch
        assert torch.cuda.current_device() == 0   # the launch put the current device back
