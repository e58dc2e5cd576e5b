"""An example reward of your own: the last number in the response against the ground truth.

Use it with ``reward.function=examples/reward_last_number.py:score`` (a path relative to where
the job starts, or ``package.module:score`` when it is importable). docs/data-and-rewards.md
explains the convention; in short, a reward function

* is called as ``score(data_source, solution_str, ground_truth)`` for every response, fresh or
  replayed: ``solution_str`` is the decoded response alone (no prompt, no chat markup),
  ``ground_truth`` the row's ``reward_model.ground_truth``;
* returns a dict with ``score`` (a float: +1 right, -1 wrong, as the built-in DAPO rule; the
  group advantages only need right above wrong), and optionally ``acc`` (a bool: counted in
  ``rollout/acc_mean`` and kept by ``rlep collect``) and ``pred`` (the answer read, for
  reports); a bare number also works (``acc`` = score > 0);
* is pure and quick: it runs in the scorer's worker processes, an answer that takes longer than
  ``reward.timeout_s`` scores -1, and an exception scores -1 too. It is tried once on a sample
  before any model is built, so a broken function stops the job at once.
"""
from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _value(text: str):
    """``text`` as a number (``3``, ``-2.5``, ``7/2``), or None."""
    try:
        if "/" in text:
            top, bottom = text.split("/")
            return float(top) / float(bottom)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def score(data_source: str, solution_str: str, ground_truth: str) -> dict:
    """+1 when the last number of the response equals the ground truth's value, -1 otherwise
    (no number at all included). ``data_source`` is not needed here: one function may serve
    several sources and tell them apart by it."""
    found = _NUMBER.findall(solution_str.replace(",", ""))
    pred = found[-1] if found else ""
    truth = _value(str(ground_truth).replace(",", "").strip())
    got = _value(pred) if pred else None
    correct = got is not None and truth is not None and abs(got - truth) < 1e-9
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
