"""docs/data-and-rewards.md: the prompt templates of tools/prepare_data.py, and the example
reward file examples/reward_last_number.py as ``reward.function`` loads it."""
import os
import subprocess
import sys

import pytest

from rlep_megatron.data.prepare import DAPO_PREFIX, PROMPT_TEMPLATES, convert_jsonl, render_template
from rlep_megatron.data.schema import read_prompt_file
from tests.torchrun import REPO_ROOT

pytestmark = pytest.mark.unit


def test_prompt_templates(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text('{"problem": "What is {x} if x = 2?", "answer": "2"}\n')
    expected = {
        "dapo": DAPO_PREFIX + "What is {x} if x = 2?",
        "boxed": "What is {x} if x = 2?\nPlease reason step by step, and put your final answer "
                 "within \\boxed{}.",
        "plain": "What is {x} if x = 2?",
        "Q: {question} (one {{word}})": "Q: What is {x} if x = 2? (one {word})",
    }
    for template, start in expected.items():
        out = str(tmp_path / "out.parquet")
        convert_jsonl(str(source), out, "math_verify", prompt_template=template)
        content = read_prompt_file(out).messages[0][0]["content"]
        assert content.startswith(start), (template, content)
    assert set(PROMPT_TEMPLATES) == {"dapo", "boxed", "plain"}
    # the default stays the DAPO prompt the DAPO rule reads
    convert_jsonl(str(source), str(tmp_path / "d.parquet"), "math_dapo")
    assert "Answer:" in read_prompt_file(str(tmp_path / "d.parquet")).messages[0][0]["content"]
    with pytest.raises(ValueError, match=r"\{question\}"):
        render_template("no field here", "q")
    with pytest.raises(ValueError, match="literal brace"):
        render_template("{question} {other}", "q")


def test_prepare_data_refuses_a_bad_template_before_reading(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "prepare_data.py"),
                           "--input", str(tmp_path / "missing.jsonl"), "--output",
                           str(tmp_path / "o.parquet"), "--data-source", "x",
                           "--prompt-template", "boxd"], capture_output=True, text=True)
    assert proc.returncode == 2 and "prompt template 'boxd'" in proc.stderr


def test_the_example_reward_file_as_reward_function_loads_it(monkeypatch):
    from rlep_megatron.reward.rules import load_reward_function

    monkeypatch.chdir(REPO_ROOT)  # the spec is a path from where the job starts, as documented
    score = load_reward_function("examples/reward_last_number.py:score")
    assert score("my_numbers", "so the total is 1,600 apples.", "1600") == {
        "score": 1.0, "acc": True, "pred": "1600"}
    assert score("my_numbers", "Answer: 7/2", "3.5")["acc"]
    assert score("my_numbers", "2 + 2 = 5", "4") == {"score": -1.0, "acc": False, "pred": "5"}
    assert score("my_numbers", "no number", "4") == {"score": -1.0, "acc": False, "pred": ""}
