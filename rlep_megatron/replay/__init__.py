"""The experience pool: reading it from parquet, drawing replays, writing and summarising it.

Pure Python; no torch.distributed.
"""
from rlep_megatron.replay.pool import (FRESH, REPLAY, ExperiencePool, OnlinePool,
                                       ReplayResponse, ReplaySampler, tokenize_replays)
from rlep_megatron.replay.writer import pool_rows, pool_stats, write_pool

__all__ = ["ExperiencePool", "OnlinePool", "ReplaySampler", "ReplayResponse", "tokenize_replays", "pool_rows",
           "pool_stats", "write_pool", "REPLAY", "FRESH"]
