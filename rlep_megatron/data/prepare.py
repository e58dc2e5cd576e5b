"""jsonl -> DAPO-schema parquet (``tools/prepare_data.py``).

Input formats, one JSON object per line:
* ``{"question", "answer"}`` with the GSM8K convention: the final answer follows ``#### `` on
  the last line of ``answer``;
* ``{"problem", "answer"}``: ``answer`` is the bare final answer.

The prompt is one user turn with the DAPO instruction text, so the DAPO rule reward applies;
``reward_model.ground_truth`` is the bare final answer.
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


def dapo_prompt(problem: str) -> str:
    return f"{DAPO_PREFIX}{problem}{DAPO_SUFFIX}"


def gsm8k_final_answer(answer: str) -> str:
    """The text after ``####`` with thousands separators removed (``1,600`` -> ``1600``)."""
    if "####" not in answer:
        raise ValueError("no '#### <final answer>' line")
    final = answer.rsplit("####", 1)[1].strip()
    return final.replace(",", "") if final.replace(",", "").lstrip("-").isdigit() else final


def _records(path: str) -> Iterator[tuple[int, dict]]:
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
            yield number, record


def convert_jsonl(input_path: str, output_path: str, data_source: str, repeat: int = 1) -> int:
    """Convert; returns the number of rows written (unique problems x ``repeat``)."""
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"input file not found: {input_path}")
    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    rows = PromptRows()
    for number, record in _records(input_path):
        if "question" in record and "answer" in record:
            problem = record["question"]
            try:
                truth = gsm8k_final_answer(str(record["answer"]))
            except ValueError as err:
                raise ValueError(f"{input_path}:{number}: {err}") from None
        elif "problem" in record and "answer" in record:
            problem, truth = record["problem"], str(record["answer"]).strip()
        else:
            raise ValueError(f"{input_path}:{number}: expected keys question+answer (GSM8K) or "
                             f"problem+answer; got {sorted(record)}")
        for _ in range(repeat):
            rows.data_source.append(data_source)
            rows.messages.append([{"role": "user", "content": dapo_prompt(str(problem))}])
            rows.ground_truth.append(truth)
            rows.candidates.append(None)
            rows.index.append(str(number - 1))
    if not len(rows):
        raise ValueError(f"{input_path}: no records")
    write_table_atomic(rows_to_table(rows), output_path)
    return len(rows)
