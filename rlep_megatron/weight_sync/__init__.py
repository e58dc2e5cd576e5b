"""Megatron -> vLLM weight resharding: the actor's shards streamed as HF tensors in buckets."""
from rlep_megatron.weight_sync.streamer import Bucket, WeightStreamer, plan_buckets


def sync_weights(engine, streamer: WeightStreamer) -> dict[str, float]:
    """Stream the actor's current weights into the rollout engine. Collective over the world.
    Returns ``{"tensors", "bytes", "seconds"}``; checks that every planned tensor arrived."""
    result = engine.load_weights(streamer.iter_tensors())
    expected = len(streamer.names)
    if result["tensors"] != expected:
        raise RuntimeError(f"weight sync delivered {result['tensors']} of {expected} tensors")
    return result


__all__ = ["Bucket", "WeightStreamer", "plan_buckets", "sync_weights"]
