"""The Megatron actor: HF config -> GPTModel, vocab-parallel log-probs, the train step.

Touches megatron-core and torch.distributed; build it after ``distributed.init_model_parallel``.
"""
