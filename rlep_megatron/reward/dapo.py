"""The DAPO rule reward (docs/ALGORITHM.md section 5): the last ``Answer:`` line of the response's last
300 characters, Minerva-style normalisation, exact match; +1 correct, -1 otherwise.
"""
from __future__ import annotations

import re

TAIL_CHARS = 300
NO_ANSWER = "[INVALID]"

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Literal rewrites applied before unit removal (spacing, articles, dollar escapes, \mbox).
_REWRITES = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
# Units, words and TeX spacing that do not change the value of a final answer.
_DROPPED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
)
_INLINE_MATH = re.compile(r"(.*?)(\$)(.*?)(\$)(.*)")
_UNWRAP = [re.compile(r"(\\text\{)(.*?)(\})"), re.compile(r"(\\textbf\{)(.*?)(\})"),
           re.compile(r"(\\overline\{)(.*?)(\})")]
_BOXED = re.compile(r"(\\boxed\{)(.*)(\})")
_SHORT_FRAC = re.compile(r"(frac)([^{])(.)")
_SHORT_SQRT = re.compile(r"(sqrt)([^{])")


def normalize_answer(answer: str) -> str:
    """Minerva-style normalisation of a final answer string."""
    answer = answer.split("=")[-1]
    for before, after in _REWRITES:
        answer = answer.replace(before, after)
    for text in _DROPPED:
        answer = answer.replace(text, "")
    answer = _INLINE_MATH.sub("$\\3$", answer)
    for pattern in _UNWRAP:
        answer = pattern.sub("\\2", answer)
    answer = _BOXED.sub("\\2", answer)
    answer = _SHORT_FRAC.sub("frac{\\2}{\\3}", answer)  # \frac12 -> \frac{1}{2}
    answer = _SHORT_SQRT.sub("sqrt{\\2}", answer)         # \sqrt2 -> \sqrt{2}
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")  # 1,000 -> 1000
    return answer.strip()


def extract_answer(solution: str) -> str:
    """Text after the last ``Answer:`` in the last 300 characters, or ``[INVALID]``."""
    matches = _ANSWER_LINE.findall(solution[-TAIL_CHARS:])
    return matches[-1] if matches else NO_ANSWER


def score(solution: str, ground_truth: str) -> dict:
    pred = normalize_answer(extract_answer(solution))
    correct = pred == normalize_answer(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
