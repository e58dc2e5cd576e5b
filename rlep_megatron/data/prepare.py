"""jsonl / json / parquet -> DAPO-schema parquet (``tools/prepare_data.py``).

Input: one JSON object per line (``.jsonl``), a JSON list of objects (``.json``) or a parquet
file with flat columns (what ``datasets.Dataset.to_parquet`` writes). Each record gives a
problem and its answer:

* ``{"question", "answer"}`` with the GSM8K convention: the final answer follows ``#### `` on
  the last line of ``answer``;
* ``{"problem", "answer"}``: ``answer`` is the bare final answer;
* any other names through ``question_key`` / ``answer_key``, with ``answer_format`` ``gsm8k``
  (the text after ``####``) or ``plain`` (the whole answer) or ``auto`` (``####`` when present).

The prompt is one user turn: by default the DAPO instruction text around the problem, so the
DAPO rule reward (the last ``Answer:`` line) applies; ``prompt_template`` picks another
(:data:`PROMPT_TEMPLATES`, or any text with a ``{question}`` field). ``reward_model.ground_truth``
is the bare final answer.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

from rlep_megatron.data.schema import PromptRows, rows_to_table, write_table_atomic

DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response "
               "should be of the form Answer: $Answer (without quotes) where $Answer is the "
               "answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


PROMPT_TEMPLATES = {
    # the DAPO rule reads the last "Answer:" line: the data sources math_dapo, aime*, amc*...
    "dapo": DAPO_PREFIX + "{question}" + DAPO_SUFFIX,
    # a final answer in \\boxed{}, as Qwen2.5-Math's own prompt asks: for math_verify data
    "boxed": "{question}\nPlease reason step by step, and put your final answer within "
             "\\boxed{{}}.",
    # the question as it is (the data carries its own instruction)
    "plain": "{question}",
}


def render_template(template: str, question: str) -> str:
    """``template`` (a name of :data:`PROMPT_TEMPLATES` or a text with one ``{question}``
    field; other braces doubled) filled with ``question``."""
    text = PROMPT_TEMPLATES.get(template, template)
    if "{question}" not in text:
        raise ValueError(f"prompt template {template!r}: one of {', '.join(PROMPT_TEMPLATES)}, "
                         "or a text with a {question} field")
    try:
        return text.format(question=question)
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"prompt template {template!r}: {err!r}; write a literal brace as "
                         "{{ or }}") from None


def gsm8k_final_answer(answer: str) -> str:
    """The text after ``####`` with thousands separators removed (``1,600`` -> ``1600``)."""
    if "####" not in answer:
        raise ValueError("no '#### <final answer>' line")
    final = answer.rsplit("####", 1)[1].strip()
    return final.replace(",", "") if final.replace(",", "").lstrip("-").isdigit() else final


ANSWER_FORMATS = ("auto", "gsm8k", "plain")


def _jsonl_records(path: str) -> Iterator[tuple[str, dict]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object")
            yield f"{path}:{number}", record


def _records(path: str) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` per input record, ``where`` naming the file and line (or row)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as err:
            raise ValueError(f"{path}: not a readable parquet file ({err})") from None
        for number, record in enumerate(table.to_pylist()):
            yield f"{path}: row {number}", record
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            try:
                records = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: not valid JSON ({err.msg}); one object per line "
                                 "needs the .jsonl suffix") from None
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise ValueError(f"{path}: expected a JSON list of objects")
        for number, record in enumerate(records):
            yield f"{path}: item {number}", record
    else:
        yield from _jsonl_records(path)


def _keys(record: dict, question_key: str, answer_key: str) -> tuple[str, str, str]:
    """The question key, the answer key and the answer format the record uses."""
    if question_key or answer_key:
        return question_key or "question", answer_key or "answer", "auto"
    if "question" in record and "answer" in record:
        return "question", "answer", "gsm8k"
    if "problem" in record and "answer" in record:
        return "problem", "answer", "plain"
    raise KeyError


def convert_jsonl(input_path: str, output_path: str, data_source: str, repeat: int = 1,
                  question_key: str = "", answer_key: str = "",
                  answer_format: str = "auto", prompt_template: str = "dapo") -> int:
    """Convert; returns the number of rows written (unique problems x ``repeat``).
    ``question_key`` / ``answer_key`` name the input's columns (default: question+answer in
    the GSM8K convention, or problem+answer); ``answer_format`` applies to named columns;
    ``prompt_template`` wraps each problem (:func:`render_template`)."""
    render_template(prompt_template, "")  # a bad template fails before any input is read
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"input file not found: {input_path}")
    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer format {answer_format!r}: one of {', '.join(ANSWER_FORMATS)}")
    rows = PromptRows()
    for number, (where, record) in enumerate(_records(input_path)):
        try:
            q_key, a_key, fmt = _keys(record, question_key, answer_key)
        except KeyError:
            raise ValueError(f"{where}: expected keys question+answer (GSM8K) or problem+answer, "
                             f"or name yours with --question-key/--answer-key; got "
                             f"{sorted(record)}") from None
        if q_key not in record or a_key not in record:
            missing = [k for k in (q_key, a_key) if k not in record]
            raise ValueError(f"{where}: no {' or '.join(map(repr, missing))} (keys: "
                             f"{sorted(record)})")
        if question_key or answer_key:
            fmt = answer_format
        problem, answer = record[q_key], str(record[a_key])
        if fmt == "gsm8k" or (fmt == "auto" and "####" in answer):
            try:
                truth = gsm8k_final_answer(answer)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
        else:
            truth = answer.strip()
        if not str(problem).strip() or not truth:
            raise ValueError(f"{where}: empty question or answer")
        for _ in range(repeat):
            rows.data_source.append(data_source)
            rows.messages.append([{"role": "user",
                                   "content": render_template(prompt_template, str(problem))}])
            rows.ground_truth.append(truth)
            rows.candidates.append(None)
            rows.index.append(str(number))
    if not len(rows):
        raise ValueError(f"{input_path}: no records")
    write_table_atomic(rows_to_table(rows), output_path)
    return len(rows)
