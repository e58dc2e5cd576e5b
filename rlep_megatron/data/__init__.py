"""Training/eval data: the DAPO parquet schema, prompt rendering, the resumable sampler.

Pure Python (pyarrow, numpy); no torch.distributed.
"""
from rlep_megatron.data.prompts import RenderedPrompt, render_prompt_text, tokenize_prompt
from rlep_megatron.data.sampler import PromptSampler
from rlep_megatron.data.schema import (PromptRows, prompt_key, read_prompt_file,
                                       read_prompt_files, rows_to_table, validate_schema,
                                       write_table_atomic)

__all__ = ["PromptRows", "PromptSampler", "RenderedPrompt", "prompt_key", "read_prompt_file",
           "read_prompt_files", "render_prompt_text", "rows_to_table", "tokenize_prompt",
           "validate_schema", "write_table_atomic"]
