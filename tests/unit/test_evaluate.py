from itertools import combinations

import pytest

from rlep_megatron.evaluate import (QuestionSamples, best_at_k, evaluate_samples, format_table,
                                    maj_at_k, mean_at_k, pass_at_k)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n, c, k", [(5, 2, 1), (5, 2, 2), (6, 3, 3), (4, 0, 2), (4, 4, 1),
                                     (7, 1, 7)])
def test_pass_at_k_equals_enumeration_over_subsets(n, c, k):
    correct = [True] * c + [False] * (n - c)
    subsets = list(combinations(range(n), k))
    expected = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_mean_and_majority():
    assert mean_at_k([True, False, False, True]) == 0.5
    assert maj_at_k([False, True, True, False], ["3", "4", "4", "5"]) == 1.0
    assert maj_at_k([False, False, True], ["3", "3", "4"]) == 0.0
    assert maj_at_k([True, False], ["4", "5"]) == 1.0  # tie: the earliest answer wins


def test_best_at_k_matches_closed_form():
    # drawing k with replacement from n samples with c correct: P(best = 1) = 1 - (1 - c/n)^k
    correct = [True] * 3 + [False] * 13
    estimate = best_at_k(correct, k=4, num_bootstrap=200_000, seed=1)
    assert estimate == pytest.approx(1 - (13 / 16) ** 4, abs=0.005)
    assert best_at_k([False] * 5, 3) == 0.0 and best_at_k([True] * 5, 3) == 1.0


def test_grouped_report_and_table():
    questions = [
        QuestionSamples("aime2024", [True, False, False, False], ["1", "2", "2", "3"]),
        QuestionSamples("aime2024", [True, True, True, False], ["7", "7", "7", "8"]),
        QuestionSamples("math_dapo", [False] * 4, ["9"] * 4),
    ]
    report = evaluate_samples(questions, k=4, num_bootstrap=2000)
    assert set(report) == {"aime2024", "math_dapo"}
    aime = report["aime2024"]
    assert aime["mean@4"] == pytest.approx((0.25 + 0.75) / 2)
    assert aime["maj@4"] == pytest.approx(0.5)
    assert aime["pass@4"] == pytest.approx(1.0)
    assert aime["num_questions"] == 2
    assert report["math_dapo"]["best@4"] == 0.0
    table = format_table(report)
    assert "aime2024" in table and "mean@4" in table and "50.00" in table
