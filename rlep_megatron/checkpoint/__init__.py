"""Checkpoints: HF safetensors I/O (``hf_io``), megatron-core dist checkpoints of the model
(``dist``), HF <-> megatron conversion (``convert``, ``streaming``, ``verify``), training
checkpoints with exact resume (``resume``). The architecture
mappings they apply live in :mod:`rlep_megatron.models`.
"""
