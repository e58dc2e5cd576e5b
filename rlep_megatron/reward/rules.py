"""Dispatch from a row's ``data_source`` to a reward rule, and the registry of rules.

Built-in: the DAPO rule (``math_dapo``, ``gsm8k``, any source starting with ``aime`` or ``amc``,
as in the reference, and the tiny tasks' ``tiny_*``) and the math-verify rule (``math_verify``,
``math``).
Register another with :func:`register_rule`.
"""
from __future__ import annotations

from typing import Callable

from rlep_megatron.reward import dapo, math_verify_rule

RuleFn = Callable[[str, str], dict]

RULES: dict[str, RuleFn] = {"dapo": dapo.score, "math_verify": math_verify_rule.score}

_SOURCES: dict[str, str] = {
    "math_dapo": "dapo", "gsm8k": "dapo",
    "math_verify": "math_verify", "math": "math_verify",
}
_PREFIXES: dict[str, str] = {"aime": "dapo", "amc": "dapo", "tiny_": "dapo"}


def register_rule(data_source: str, rule: "str | RuleFn") -> None:
    """Score rows of ``data_source`` with a built-in rule name or a function
    ``fn(solution_str, ground_truth) -> {"score", "acc", "pred"}`` (must be importable by worker
    processes, i.e. a module-level function)."""
    if isinstance(rule, str):
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}; built-in rules: {sorted(RULES)}")
        _SOURCES[data_source] = rule
    else:
        name = f"custom:{data_source}"
        RULES[name] = rule
        _SOURCES[data_source] = name


def registry_snapshot() -> tuple[dict, dict]:
    """The current source -> rule mapping and custom rules, to hand to worker processes."""
    custom = {name: fn for name, fn in RULES.items() if name.startswith("custom:")}
    return dict(_SOURCES), custom


def load_registry(snapshot: tuple[dict, dict]) -> None:
    sources, custom = snapshot
    RULES.update(custom)
    _SOURCES.update(sources)


def known_data_sources() -> list[str]:
    return sorted(_SOURCES) + [f"{prefix}*" for prefix in sorted(_PREFIXES)]


def rule_for(data_source: str) -> RuleFn:
    name = _SOURCES.get(data_source)
    if name is None:
        name = next((rule for prefix, rule in _PREFIXES.items()
                     if data_source.startswith(prefix)), None)
    if name is None:
        raise ValueError(
            f"no reward rule for data_source {data_source!r}. Known sources: "
            f"{', '.join(known_data_sources())}. Register one with "
            f"rlep_megatron.reward.register_rule({data_source!r}, 'dapo' | 'math_verify' | fn)")
    return RULES[name]


def compute_score(data_source: str, solution_str: str, ground_truth: str) -> dict:
    """verl-compatible reward: ``{"score": float, "acc": bool, "pred": str}``.

    Raises ValueError for an unknown ``data_source``; never raises for any response text.
    """
    rule = rule_for(data_source)
    try:
        result = rule(str(solution_str), str(ground_truth))
    except Exception:
        return {"score": -1.0, "acc": False, "pred": ""}
    return {"score": float(result["score"]), "acc": bool(result["acc"]),
            "pred": str(result.get("pred", ""))}
