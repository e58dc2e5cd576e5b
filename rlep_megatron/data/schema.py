"""The DAPO/RLEP parquet schema (docs/ALGORITHM.md section 2): validation, reading, writing.

| column | type |
|---|---|
| data_source | string |
| prompt | list<struct{content: string, role: string}> |
| ability | string (optional here) |
| reward_model | struct{ground_truth: string, style: string, candidates: list<string> (optional)} |
| extra_info | struct{index: string, ...} (optional here) |

Extra columns are accepted and ignored. Any other deviation raises ValueError naming the file,
the column and the expected type.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

MESSAGE_TYPE = pa.struct([("content", pa.string()), ("role", pa.string())])
PROMPT_TYPE = pa.list_(MESSAGE_TYPE)
CANDIDATES_TYPE = pa.list_(pa.string())
# optional, one entry per candidate (null where unknown): the tokens the behaviour policy
# sampled, its log-prob of each, and the policy version (training step) that sampled it
BEHAVIOUR_TYPES = {"candidate_token_ids": pa.list_(pa.list_(pa.int32())),
                   "candidate_logprobs": pa.list_(pa.list_(pa.float32())),
                   "candidate_versions": pa.list_(pa.int64())}

EXPECTED = {
    "data_source": "string",
    "prompt": "list<struct<content: string, role: string>>",
    "ability": "string",
    "reward_model": "struct<ground_truth: string, style: string, candidates: list<string> "
                    "(optional), candidate_token_ids: list<list<int>>, candidate_logprobs: "
                    "list<list<float>>, candidate_versions: list<int> (optional)>",
    "extra_info": "struct<index: string, ...>",
}
REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _wrong(path: str, column: str, actual: pa.DataType) -> ValueError:
    return ValueError(f"{path}: column '{column}' has type {actual}; expected {EXPECTED[column]}")


def validate_schema(schema: pa.Schema, path: str) -> bool:
    """Check a parquet schema; returns whether ``reward_model.candidates`` is present."""
    names = set(schema.names)
    for column in REQUIRED_COLUMNS:
        if column not in names:
            raise ValueError(f"{path}: missing column '{column}' (expected type "
                             f"{EXPECTED[column]}); columns present: {sorted(names)}")
    if not _is_string(schema.field("data_source").type):
        raise _wrong(path, "data_source", schema.field("data_source").type)
    prompt = schema.field("prompt").type
    if not (_is_list(prompt) and pa.types.is_struct(prompt.value_type)):
        raise _wrong(path, "prompt", prompt)
    message = prompt.value_type
    for key in ("content", "role"):
        index = message.get_field_index(key)
        if index < 0 or not _is_string(message.field(index).type):
            raise _wrong(path, "prompt", prompt)
    reward = schema.field("reward_model").type
    if not pa.types.is_struct(reward):
        raise _wrong(path, "reward_model", reward)
    truth = reward.get_field_index("ground_truth")
    if truth < 0 or not _is_string(reward.field(truth).type):
        raise ValueError(f"{path}: column 'reward_model' lacks a string field 'ground_truth' "
                         f"(type {reward}); expected {EXPECTED['reward_model']}")
    candidates = reward.get_field_index("candidates")
    if candidates >= 0:
        ctype = reward.field(candidates).type
        if not (_is_list(ctype) and _is_string(ctype.value_type)):
            raise ValueError(f"{path}: 'reward_model.candidates' has type {ctype}; expected "
                             "list<string>")
    for name in BEHAVIOUR_TYPES:
        index = reward.get_field_index(name)
        if index >= 0:
            value = reward.field(index).type
            depth = 0
            while _is_list(value):
                value, depth = value.value_type, depth + 1
            numeric = pa.types.is_integer(value) or pa.types.is_floating(value)
            if candidates < 0 or not numeric or depth != (1 if name == "candidate_versions"
                                                          else 2):
                raise ValueError(f"{path}: 'reward_model.{name}' has type "
                                 f"{reward.field(index).type}; expected "
                                 f"{BEHAVIOUR_TYPES[name]} next to reward_model.candidates")
    if "ability" in names and not _is_string(schema.field("ability").type):
        raise _wrong(path, "ability", schema.field("ability").type)
    if "extra_info" in names and not pa.types.is_struct(schema.field("extra_info").type):
        raise _wrong(path, "extra_info", schema.field("extra_info").type)
    return candidates >= 0


@dataclass
class PromptRows:
    """Rows of one or more DAPO-schema files, as Python lists (one entry per row)."""

    data_source: list[str] = field(default_factory=list)
    messages: list[list[dict]] = field(default_factory=list)
    ground_truth: list[str] = field(default_factory=list)
    candidates: list[Optional[list[str]]] = field(default_factory=list)
    index: list[str] = field(default_factory=list)
    behaviour: list[Optional[list[Optional[dict]]]] = field(default_factory=list)
    """Per row, per candidate: ``{"token_ids", "logprobs", "version"}`` of the policy that
    sampled it, or ``None`` (a pool without the optional columns: all ``None``)."""
    file: list[str] = field(default_factory=list)
    """The file each row was read from (empty for rows made in memory)."""

    def __len__(self) -> int:
        return len(self.data_source)

    def prompt_key(self, row: int) -> str:
        return prompt_key(self.messages[row])

    def select(self, rows: Sequence[int]) -> "PromptRows":
        behaviour = self.behaviour or [None] * len(self)
        return PromptRows(*([getattr(self, name)[r] for r in rows] for name in
                            ("data_source", "messages", "ground_truth", "candidates", "index")),
                          behaviour=[behaviour[r] for r in rows],
                          file=[self.file[r] for r in rows] if self.file else [])

    def deduplicate(self) -> "PromptRows":
        """First occurrence of every distinct prompt (the public DAPO file repeats each ~100x)."""
        seen, keep = set(), []
        for row in range(len(self)):
            key = self.prompt_key(row)
            if key not in seen:
                seen.add(key)
                keep.append(row)
        return self.select(keep)


def prompt_key(messages: Sequence[dict]) -> str:
    """The identity of a question: its chat messages, role and content."""
    return "\x1e".join(f"{m['role']}\x1f{m['content']}" for m in messages)


def read_prompt_file(path: str, behaviour: bool = False) -> PromptRows:
    """The rows of one DAPO-schema parquet file; with ``behaviour``, a pool's optional
    behaviour columns too (as int32 / float32 arrays; they can be several times the size of
    the texts, so only the runs that use them, ``replay.correction``, read them)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"parquet file not found: {path}")
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:
        raise ValueError(f"{path}: not a readable parquet file ({err})") from None
    has_candidates = validate_schema(parquet.schema_arrow, path)
    columns = [c for c in ("data_source", "prompt", "reward_model", "extra_info")
               if c in parquet.schema_arrow.names]
    try:
        table = parquet.read(columns=columns)
    except Exception as err:
        raise ValueError(f"{path}: cannot read columns {columns} ({err})") from None
    rows = PromptRows()
    rows.data_source = table.column("data_source").to_pylist()
    rows.messages = [[{"role": m["role"], "content": m["content"]} for m in prompt or []]
                     for prompt in table.column("prompt").to_pylist()]
    reward = table.column("reward_model").combine_chunks()
    rows.ground_truth = reward.field("ground_truth").to_pylist()
    rows.candidates = (reward.field("candidates").to_pylist() if has_candidates
                       else [None] * len(rows.data_source))
    rows.behaviour = (_read_behaviour(reward, rows.candidates, path) if behaviour
                      else [None] * len(rows.data_source))
    if "extra_info" in columns:
        info = table.column("extra_info").combine_chunks()
        index = (info.field("index").to_pylist() if info.type.get_field_index("index") >= 0
                 else [None] * len(info))
    else:
        index = [None] * len(rows.data_source)
    rows.index = [str(i) if i is not None else f"{os.path.basename(path)}:{n}"
                  for n, i in enumerate(index)]
    for row, (source, messages, truth) in enumerate(zip(rows.data_source, rows.messages,
                                                        rows.ground_truth)):
        if source is None or truth is None or not messages:
            raise ValueError(f"{path}: row {row} has an empty data_source, prompt or "
                             "reward_model.ground_truth")
    rows.file = [path] * len(rows.data_source)
    return rows


def _read_behaviour(reward, candidates, path: str) -> list:
    """The optional behaviour columns as per-candidate dicts (``None`` where absent)."""
    present = [name for name in BEHAVIOUR_TYPES if reward.type.get_field_index(name) >= 0]
    if not present:
        return [None] * len(candidates)
    columns = {name: reward.field(name).to_pylist() for name in present}
    out = []
    for row, texts in enumerate(candidates):
        if texts is None:
            out.append(None)
            continue
        values = {name: columns[name][row] or [None] * len(texts) for name in present}
        if any(len(v) != len(texts) for v in values.values()):
            raise ValueError(f"{path}: row {row} has {len(texts)} candidates but behaviour "
                             f"columns of other lengths ({ {k: len(v) for k, v in values.items()} })")
        entries = []
        for i in range(len(texts)):
            ids = values.get("candidate_token_ids", [None] * len(texts))[i]
            logprobs = values.get("candidate_logprobs", [None] * len(texts))[i]
            version = values.get("candidate_versions", [None] * len(texts))[i]
            if ids is not None and logprobs is not None and len(ids) != len(logprobs):
                raise ValueError(f"{path}: row {row}, candidate {i}: {len(ids)} token ids but "
                                 f"{len(logprobs)} log-probs")
            entries.append(None if ids is None and logprobs is None and version is None else
                           {"token_ids": None if ids is None else np.asarray(ids, np.int32),
                            "logprobs": (None if logprobs is None
                                         else np.asarray(logprobs, np.float32)),
                            "version": version})
        out.append(entries)
    return out


def read_prompt_files(paths: Sequence[str], deduplicate: bool = False,
                      behaviour: bool = False) -> PromptRows:
    """Read and concatenate files; optionally keep the first occurrence of each prompt (and
    read the pool's behaviour columns, :func:`read_prompt_file`)."""
    if not paths:
        raise ValueError("no parquet files given (set data.train_files / data.val_files)")
    merged = PromptRows()
    for path in paths:
        part = read_prompt_file(path, behaviour=behaviour)
        for name in ("data_source", "messages", "ground_truth", "candidates", "index",
                     "behaviour", "file"):
            getattr(merged, name).extend(getattr(part, name))
    return merged.deduplicate() if deduplicate else merged


def rows_to_table(rows: PromptRows, ability: str = "MATH", style: str = "rule-lang",
                  with_candidates: Optional[bool] = None) -> pa.Table:
    """Build a table in the public schema (``candidates`` only when any row has them, or when
    ``with_candidates`` forces it)."""
    if with_candidates is None:
        with_candidates = any(c is not None for c in rows.candidates)
    reward_fields = [("ground_truth", pa.string()), ("style", pa.string())]
    if with_candidates:
        reward_fields.append(("candidates", CANDIDATES_TYPE))
    behaviour = rows.behaviour or [None] * len(rows)
    with_behaviour = with_candidates and any(
        entry is not None for entries in behaviour for entry in (entries or []))
    if with_behaviour:
        reward_fields += list(BEHAVIOUR_TYPES.items())
    reward_values = []
    for truth, candidates, entries in zip(rows.ground_truth, rows.candidates, behaviour):
        value = {"ground_truth": truth, "style": style}
        if with_candidates:
            value["candidates"] = list(candidates or [])
        if with_behaviour:
            entries = entries or [None] * len(value["candidates"])
            value["candidate_token_ids"] = [_as_list(e and e["token_ids"]) for e in entries]
            value["candidate_logprobs"] = [_as_list(e and e["logprobs"]) for e in entries]
            value["candidate_versions"] = [e and e["version"] for e in entries]
        reward_values.append(value)
    return pa.table({
        "data_source": pa.array(rows.data_source, pa.string()),
        "prompt": pa.array([[{"content": m["content"], "role": m["role"]} for m in messages]
                            for messages in rows.messages], PROMPT_TYPE),
        "ability": pa.array([ability] * len(rows), pa.string()),
        "reward_model": pa.array(reward_values, pa.struct(reward_fields)),
        "extra_info": pa.array([{"index": i} for i in rows.index],
                               pa.struct([("index", pa.string())])),
    })


def _as_list(values) -> Optional[list]:
    return None if values is None else (values.tolist() if hasattr(values, "tolist")
                                        else list(values))


def write_table_atomic(table: pa.Table, path: str) -> None:
    """Write a parquet file via a temporary name in the same directory, then rename."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600: a data file others may read
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
