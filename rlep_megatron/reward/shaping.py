"""Overlong reward shaping (DAPO; docs/ALGORITHM.md section 5), applied to replays too."""
from __future__ import annotations


def overlong_penalty(response_tokens: int, max_response_tokens: int, buffer_tokens: int,
                     penalty_factor: float = 1.0) -> float:
    """Extra reward ``min(0, -(L - (max - buffer)) / buffer * factor)``; 0 when shaping is off.

    With max 3072 and buffer 512: 0 up to 2560 tokens, falling linearly to -factor at 3072.
    """
    if buffer_tokens <= 0:
        return 0.0
    expected = max_response_tokens - buffer_tokens
    return min(0.0, -(response_tokens - expected) / buffer_tokens * penalty_factor)
