"""``rollout.backend: megatron``: generation with the actor's own megatron-core model
(megatron-core's static inference context for the KV cache), no vLLM and no weight sync."""
