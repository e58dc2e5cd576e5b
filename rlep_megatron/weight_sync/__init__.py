"""Megatron -> vLLM weight resharding: the actor's shards streamed as HF tensors in buckets."""
from rlep_megatron.weight_sync.streamer import Bucket, WeightStreamer, plan_buckets


def sync_weights(engine, streamer: WeightStreamer, version=None) -> dict[str, float]:
    """Stream the actor's current weights into the rollout engine (colocated, or the servers
    of separate placement, whose weight version becomes ``version``). Collective over the
    trainer's ranks. Returns ``{"tensors", "bytes", "seconds"}``; checks that every planned
    tensor arrived."""
    result = engine.load_weights(streamer.iter_tensors(), version=version)
    expected = len(streamer.names)
    if result["tensors"] != expected:
        raise RuntimeError(f"weight sync delivered {result['tensors']} of {expected} tensors")
    return result


__all__ = ["Bucket", "WeightStreamer", "plan_buckets", "sync_weights"]
