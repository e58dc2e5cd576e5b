import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlep_megatron.reward import (ScoreRequest, ScorerPool, compute_score, overlong_penalty,
                                  register_rule)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("solution, truth", [
    ("Janet has 16 - 3 - 4 = 9 eggs.\n9 * 2 = 18\nAnswer: 18", "18"),
    ("answer: 18", "18"),                              # case-insensitive
    ("Answer:18", "18"),
    ("Answer: $18$", "18"),
    ("Answer: \\boxed{18}", "18"),
    ("Answer: 18 dollars", "18"),
    ("Answer: x = 18", "18"),
    ("Answer: 1,000", "1000"),
    ("Answer: \\frac12", "\\frac{1}{2}"),
    ("Answer: \\text{(B)}", "(B)"),
    ("Answer: 5\nAnswer: 18", "18"),                   # the last Answer: line counts
    ("Answer: 18\nI hope this helps!", "18"),          # text after the answer line
    ("x" * 5000 + "\nAnswer: 18", "18"),               # only the tail is read
])
def test_dapo_rule_accepts_equivalent_forms(solution, truth):
    result = compute_score("math_dapo", solution, truth)
    assert result == {"score": 1.0, "acc": True, "pred": result["pred"]}


@pytest.mark.parametrize("solution, truth", [
    ("Answer: 17", "18"),
    ("The answer is 18.", "18"),                       # no Answer: line
    ("Answer: 18\n" + "y" * 400, "18"),                # the answer is outside the last 300 chars
    ("Answer: 1/2", "\\frac{1}{2}"),                   # the DAPO rule is exact-match, not symbolic
    ("", "18"),
])
def test_dapo_rule_rejects(solution, truth):
    result = compute_score("math_dapo", solution, truth)
    assert result["score"] == -1.0 and result["acc"] is False


def test_missing_answer_line_reports_invalid():
    assert compute_score("math_dapo", "no final answer", "3")["pred"] == "[INVALID]"


def test_aime_sources_use_the_dapo_rule():
    assert compute_score("aime2024", "Answer: 204", "204")["acc"]


@pytest.mark.parametrize("solution, truth, correct", [
    ("so the result is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),
    ("so the result is \\boxed{0.5}", "\\frac{1}{2}", True),
    ("thus $\\boxed{2/4}$", "1/2", True),
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", True),
    ("\\boxed{3}", "4", False),
    ("I give up", "4", False),
    ("\\boxed{\\frac{1}{", "4", False),                # malformed LaTeX
])
def test_math_verify_rule(solution, truth, correct):
    result = compute_score("math_verify", solution, truth)
    assert result["acc"] is correct and result["score"] == (1.0 if correct else -1.0)


def test_huge_inputs_are_fast():
    huge = "1+1=2. " * 200_000 + "Answer: 42"
    start = time.monotonic()
    assert compute_score("math_dapo", huge, "42")["acc"]
    assert time.monotonic() - start < 0.5


def test_unknown_source_lists_known_and_how_to_register():
    with pytest.raises(ValueError) as err:
        compute_score("olympiad_bench", "Answer: 1", "1")
    message = str(err.value)
    assert "olympiad_bench" in message and "math_dapo" in message and "register_rule" in message


def exact_upper(solution, truth):
    return {"score": 1.0 if solution.upper() == truth else -1.0, "acc": solution.upper() == truth,
            "pred": solution.upper()}


def test_register_rule():
    register_rule("shouting", exact_upper)
    assert compute_score("shouting", "abc", "ABC")["acc"]
    register_rule("my_gsm", "dapo")
    assert compute_score("my_gsm", "Answer: 7", "7")["acc"]
    with pytest.raises(ValueError, match="unknown rule"):
        register_rule("x", "nope")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=400), st.text(max_size=20))
def test_dapo_rule_never_raises(solution, truth):
    result = compute_score("math_dapo", solution, truth)
    assert result["score"] in (1.0, -1.0) and isinstance(result["pred"], str)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet="0123456789+-*/^{}()\\boxedfrac $.=Answer:\n", max_size=60),
       st.sampled_from(["1", "\\frac{1}{2}", "x+1", ""]))
def test_math_verify_rule_never_raises(solution, truth):
    result = compute_score("math_verify", solution, truth)
    assert result["score"] in (1.0, -1.0)


def test_overlong_shaping():
    assert overlong_penalty(100, 3072, 512) == 0.0
    assert overlong_penalty(2560, 3072, 512) == 0.0
    assert overlong_penalty(2816, 3072, 512) == pytest.approx(-0.5)
    assert overlong_penalty(3072, 3072, 512) == pytest.approx(-1.0)
    assert overlong_penalty(3072, 3072, 512, penalty_factor=0.5) == pytest.approx(-0.5)
    assert overlong_penalty(3072, 3072, 0) == 0.0


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_pool_times_out_a_hang_without_stalling_the_batch():
    tower = "\\boxed{" + "9^{" * 12 + "9" + "}" * 12 + "}"  # sympy evaluates this for minutes
    requests = [ScoreRequest("math_dapo", f"Answer: {i}", str(i if i % 3 else i + 1))
                for i in range(300)]
    requests.insert(150, ScoreRequest("math_verify", tower, "1"))
    timeout_s = 2.0
    pool = ScorerPool(num_workers=2, timeout_s=timeout_s)
    original_pids = pool.pids
    start = time.monotonic()
    results = pool.score(requests)
    elapsed = time.monotonic() - start
    # the tower alone takes minutes; slack covers worker start-up and a restart on a busy machine
    assert elapsed < timeout_s + 4.0
    assert results[150] == {"score": -1.0, "acc": False, "pred": "", "timed_out": True}
    others = results[:150] + results[151:]
    assert [r["acc"] for r in others] == [bool(i % 3) for i in range(300)]
    assert not any(r["timed_out"] for r in others)
    assert pool.num_timeouts == 1
    killed = set(original_pids) - set(pool.pids)
    assert len(killed) == 1 and not any(alive(pid) for pid in killed)
    # the pool keeps working after a restart, then shuts down every worker
    assert pool.score([ScoreRequest("math_dapo", "Answer: 1", "1")])[0]["acc"]
    current = pool.pids
    pool.close()
    assert not any(alive(pid) for pid in current)


def test_pool_workers_see_rules_registered_in_the_parent():
    register_rule("shouting", exact_upper)
    with ScorerPool(num_workers=1, timeout_s=10) as pool:
        register_rule("shouting_later", exact_upper)
        results = pool.score([ScoreRequest("shouting", "abc", "ABC"),
                              ScoreRequest("shouting_later", "abd", "ABC")])
    assert [r["acc"] for r in results] == [True, False]


def test_pool_rejects_unknown_source_before_work():
    with ScorerPool(num_workers=1, timeout_s=5) as pool:
        with pytest.raises(ValueError, match="no reward rule"):
            pool.score([ScoreRequest("nope", "Answer: 1", "1")])
