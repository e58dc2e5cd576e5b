"""The math-verify rule reward: extract the final answer (boxed / LaTeX / plain expression) with
``math_verify`` and check symbolic equivalence with the ground truth; +1 / -1.

math-verify's own timeouts use ``signal.alarm`` and only work in a main thread; hard time limits
come from the scorer pool (``rlep_megatron.reward.pool``), which kills a stuck worker.
"""
from __future__ import annotations

import logging

# math-verify logs a warning on every call made without its signal-based timeout; the pool
# enforces the limit instead.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def prepare() -> None:
    """Import math-verify and sympy and verify one trivial answer: seconds on a busy host, which
    a scorer worker spends before an answer's clock starts (on the clock, a first answer could
    time out and be scored wrong)."""
    from math_verify import parse, verify

    verify(parse("$1$", parsing_timeout=None), parse("$1$", parsing_timeout=None),
           timeout_seconds=None)


def score(solution: str, ground_truth: str) -> dict:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    extraction = [LatexExtractionConfig(), ExprExtractionConfig()]
    try:
        gold = parse(f"${ground_truth}$", extraction_config=extraction, parsing_timeout=None)
        if not gold:
            gold = parse(ground_truth, extraction_config=extraction, parsing_timeout=None)
        pred = parse(solution, extraction_config=extraction, parsing_timeout=None)
        correct = bool(gold and pred and verify(gold, pred, timeout_seconds=None))
    except Exception:  # malformed LaTeX, sympy errors: an unverifiable answer is wrong
        return {"score": -1.0, "acc": False, "pred": ""}
    pred_text = str(pred[-1]) if pred else ""
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred_text}
