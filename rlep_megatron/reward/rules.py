"""Dispatch from a row's ``data_source`` to a reward rule, and the registry of rules.

Built-in: the DAPO rule (``math_dapo``, ``gsm8k`` as prepared by ``tools/prepare_data.py``,
any source starting with ``aime`` or ``amc``, as in the reference, and the tiny tasks'
``tiny_*``), the math-verify rule (``math_verify``, ``math`` and the MATH sets' hub names verl's
recipes use) and the GSM8K ``####`` rule of verl's ``openai/gsm8k`` data.
Register another with :func:`register_rule`, or score every row with one function of your own
(``reward.function``: :func:`use_reward_function`).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable

from rlep_megatron.reward import dapo, gsm8k, math_verify_rule

RuleFn = Callable[[str, str], dict]

RULES: dict[str, RuleFn] = {"dapo": dapo.score, "math_verify": math_verify_rule.score,
                            "gsm8k_hash": gsm8k.score}

_SOURCES: dict[str, str] = {
    "math_dapo": "dapo", "gsm8k": "dapo",
    "math_verify": "math_verify", "math": "math_verify",
    # the data_source names of verl's example recipes
    "openai/gsm8k": "gsm8k_hash", "lighteval/MATH": "math_verify",
    "DigitalLearningGmbH/MATH-lighteval": "math_verify", "HuggingFaceH4/MATH-500": "math_verify",
}

# reward.function: one function scores every row (spec "module:callable" or "file.py:callable")
_FUNCTION: dict[str, object] = {"spec": "", "fn": None}


def load_reward_function(spec: str) -> Callable:
    """The callable named by ``spec``: ``package.module:function`` (importable) or
    ``path/to/file.py:function``. Raises ValueError saying what is wrong."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward.function={spec!r} must look like package.module:function or "
                         "path/to/file.py:function")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            if not os.path.isfile(module_name):
                raise ValueError(f"reward.function={spec!r}: {module_name!r} does not exist")
            loader = importlib.util.spec_from_file_location(
                f"rlep_reward_{abs(hash(os.path.abspath(module_name)))}", module_name)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ValueError:
        raise
    except Exception as err:
        raise ValueError(f"reward.function={spec!r}: importing {module_name!r} failed: "
                         f"{type(err).__name__}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.function={spec!r}: {module_name!r} has no callable {attr!r}")
    return fn


def use_reward_function(spec: str) -> None:
    """Score every row with the function ``spec`` names (``""``: the rules by data_source).
    The function takes ``(data_source, solution_str, ground_truth)``, like
    :func:`compute_score`, and returns a dict with ``score`` (and optionally ``acc``,
    ``pred``) or a number; worker processes load it from the same spec."""
    _FUNCTION["fn"] = load_reward_function(spec) if spec else None
    _FUNCTION["spec"] = spec
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


def registry_snapshot() -> tuple[dict, dict, str]:
    """The current source -> rule mapping, custom rules and reward function spec, to hand to
    worker processes."""
    custom = {name: fn for name, fn in RULES.items() if name.startswith("custom:")}
    return dict(_SOURCES), custom, str(_FUNCTION["spec"])


def load_registry(snapshot: tuple[dict, dict, str]) -> None:
    sources, custom, spec = snapshot
    RULES.update(custom)
    _SOURCES.update(sources)
    if spec != _FUNCTION["spec"]:
        use_reward_function(spec)


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


# what a rule needs done once per process before it scores (imports), off an answer's clock
_PREPARE: dict[RuleFn, Callable[[], None]] = {math_verify_rule.score: math_verify_rule.prepare}
_PREPARED: set = set()


def prepare(data_sources) -> None:
    """Run, once per process, the set-up of the rules that score ``data_sources`` (unknown
    sources are left to :func:`compute_score`'s error; none with ``reward.function``, which
    scores every row)."""
    if _FUNCTION["fn"] is not None:
        return
    for source in set(data_sources):
        try:
            rule = rule_for(source)
        except ValueError:
            continue
        if rule in _PREPARE and rule not in _PREPARED:
            _PREPARED.add(rule)
            _PREPARE[rule]()


def _as_result(result) -> dict:
    if isinstance(result, dict):
        value = float(result["score"])
        return {"score": value, "acc": bool(result.get("acc", value > 0)),
                "pred": str(result.get("pred", ""))}
    value = float(result)
    return {"score": value, "acc": value > 0, "pred": ""}


def compute_score(data_source: str, solution_str: str, ground_truth: str) -> dict:
    """verl-compatible reward: ``{"score": float, "acc": bool, "pred": str}``.

    Raises ValueError for an unknown ``data_source``; never raises for any response text (a
    rule or reward function that raises scores -1)."""
    fn = _FUNCTION["fn"]
    try:
        if fn is not None:
            return _as_result(fn(data_source, str(solution_str), str(ground_truth)))
    except Exception:
        return {"score": -1.0, "acc": False, "pred": ""}
    rule = rule_for(data_source)
    try:
        return _as_result(rule(str(solution_str), str(ground_truth)))
    except Exception:
        return {"score": -1.0, "acc": False, "pred": ""}


def scorable(data_sources) -> None:
    """Raise ValueError (listing the known sources) for a data_source no rule scores, unless
    ``reward.function`` scores every row."""
    if _FUNCTION["fn"] is None:
        for source in data_sources:
            rule_for(source)


def check_rewards(rows_by_file: dict[str, "object"], function: str = "") -> None:
    """Before any model work: take ``reward.function`` (``function``; empty: the rules) into
    use, then check that every ``data_source`` of the files has a rule (or that the function
    runs on one row and returns a score). ``rows_by_file`` maps a description to
    ``PromptRows`` (``data_source``, ``ground_truth``)."""
    use_reward_function(function)
    fn = _FUNCTION["fn"]
    if fn is None:
        for where, rows in rows_by_file.items():
            for source in sorted(set(rows.data_source)):
                try:
                    scorable([source])
                except ValueError as err:
                    raise ValueError(f"{where}: {err}; or score every row with your own "
                                     "function: reward.function=module:callable") from None
        return
    where, rows = next(iter(rows_by_file.items()))
    source, truth = rows.data_source[0], str(rows.ground_truth[0])
    try:
        result = _as_result(fn(source, f"Answer: {truth}", truth))
    except Exception as err:
        raise ValueError(f"reward.function={_FUNCTION['spec']!r} failed on a sample of {where} "
                         f"(data_source={source!r}, solution 'Answer: {truth}'): "
                         f"{type(err).__name__}: {err}") from None
    if result["score"] != result["score"]:  # NaN
        raise ValueError(f"reward.function={_FUNCTION['spec']!r} returned a NaN score on a "
                         f"sample of {where}")
