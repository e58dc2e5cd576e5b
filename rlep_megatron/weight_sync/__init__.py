"""Megatron -> vLLM weight resharding (the actor's shards streamed as HF tensors in buckets) and
the delivery lifecycle every rollout engine implements (:mod:`.lifecycle`)."""
from rlep_megatron.weight_sync.lifecycle import (WeightTarget, count_tensors, deliver,
                                                 sync_weights)
from rlep_megatron.weight_sync.streamer import Bucket, WeightStreamer, plan_buckets

__all__ = ["Bucket", "WeightStreamer", "WeightTarget", "count_tensors", "deliver",
           "plan_buckets", "sync_weights"]
