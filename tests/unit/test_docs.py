"""The repository speaks for itself: every document the code, the docs and the recipes cite
exists in it."""
import os
import re

import pytest

from tests.torchrun import REPO_ROOT

pytestmark = pytest.mark.unit

CITED = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.md)\b")


def test_every_cited_document_is_in_the_repository():
    missing = []
    for top in ("rlep_megatron", "docs", "examples", "tools", "bench", "scripts", "tests"):
        for root, _, files in os.walk(os.path.join(REPO_ROOT, top)):
            for name in files:
                if not name.endswith((".py", ".md", ".yaml", ".sh")):
                    continue
                path = os.path.join(root, name)
                for cited in CITED.findall(open(path, encoding="utf-8").read()):
                    if not any(os.path.isfile(os.path.join(base, cited))
                               for base in (REPO_ROOT, os.path.join(REPO_ROOT, "docs"), root)):
                        missing.append(f"{os.path.relpath(path, REPO_ROOT)}: {cited}")
    readme = open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8").read()
    missing += [f"README.md: {c}" for c in CITED.findall(readme)
                if not os.path.isfile(os.path.join(REPO_ROOT, c))]
    assert not missing, missing
    assert os.path.isfile(os.path.join(REPO_ROOT, "LICENSE"))


def test_make_tiny_task_names_the_demos_task():
    """tools/make_tiny_task.py's help gives the flags of the demo's task: they must be demo.TASK."""
    from rlep_megatron.demo import TASK

    with open(os.path.join(REPO_ROOT, "tools", "make_tiny_task.py")) as f:
        doc = f.read().split('"""')[1]
    demo_part = doc.split("The demo's task", 1)[1]
    flags = dict(re.findall(r"--([a-z-]+) (\S+?)(?=[\s`])", demo_part))
    assert {k.replace("-", "_") for k in flags} == set(TASK)
    for key, text in flags.items():
        value = TASK[key.replace("-", "_")]
        assert text == str(value), (key, text, value)
