"""House limits on the package's shape: no function over 100 lines, no class over 300, and the
loop (``trainer.py``) never branches on where the rollout runs: placement is chosen when the
engine is built (``rollout/factory.py``)."""
import ast
import os

import pytest

import rlep_megatron
from tests.unit.test_imports import package_trees

pytestmark = pytest.mark.unit

MAX_FUNCTION_LINES = 100
MAX_CLASS_LINES = 300


def oversized(root: str) -> list[str]:
    """``path:line name (n lines)`` of every function and class over the limits under ``root``."""
    found = []
    for rel, tree in package_trees(root):
        for node in ast.walk(tree):
            limit = (MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef,
                                                              ast.AsyncFunctionDef))
                     else MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else None)
            if limit is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_or_class_over_the_limits():
    assert oversized(os.path.dirname(rlep_megatron.__file__)) == []


def test_the_size_check_finds_an_oversized_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert oversized(str(tmp_path)) == [f"long.py:1 long ({MAX_FUNCTION_LINES + 1} lines)"]


def placement_mentions(path: str) -> list[str]:
    """Lines of ``path`` whose code (not comments or docstrings) names the placement."""
    tree = ast.parse(open(path).read())
    return sorted({f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
                   if (isinstance(node, ast.Attribute) and node.attr == "placement")
                   or (isinstance(node, ast.Constant) and node.value in ("separate",
                                                                         "colocated"))})


def test_the_loop_has_no_placement_branch(tmp_path):
    trainer = os.path.join(os.path.dirname(rlep_megatron.__file__), "trainer.py")
    assert placement_mentions(trainer) == []
    made = tmp_path / "loop.py"
    made.write_text("def step(cfg):\n    if cfg.rollout.placement == 'separate':\n"
                    "        return 1\n")
    assert len(placement_mentions(str(made))) == 2  # the check sees such a branch
