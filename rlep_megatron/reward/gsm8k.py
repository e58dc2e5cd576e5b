"""The GSM8K rule of verl's recipes (its ``openai/gsm8k`` data asks for the final answer after
``####``): the number after the response's last ``####``, commas and a trailing period
removed, compared with the ground truth as numbers; +1 correct, -1 otherwise (the project's
convention: verl gives 1 / 0, which group-normalised advantages do not tell apart).
"""
from __future__ import annotations

import re

_FINAL = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
NO_ANSWER = "[INVALID]"


def _number(text: str):
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def extract_answer(solution_str: str) -> str:
    found = _FINAL.findall(solution_str)
    return found[-1].replace(",", "") if found else NO_ANSWER


def score(solution_str: str, ground_truth: str) -> dict:
    pred = extract_answer(solution_str)
    truth = _number(extract_answer(ground_truth) if "####" in ground_truth else ground_truth)
    value = _number(pred) if pred != NO_ANSWER else None
    acc = value is not None and truth is not None and abs(value - truth) < 1e-9
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}
