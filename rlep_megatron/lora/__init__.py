"""Low-rank adapters (LoRA) on the actor's megatron-core parallel linears (``lora.*``).

- :mod:`.targets`: the HF projection names and where each sits in megatron's fused linears;
  the checks of a ``lora`` section against a model, run before anything is built.
- :mod:`.adapters`: the adapters themselves, attached to built chunks, tensor-parallel aware,
  with the merged weights that weight sync streams and the sharded checkpoint entries.
- :mod:`.peft_io`: PEFT's adapter format in and out.
- :mod:`.preflight`: the checks of a ``lora`` section and its ``init_from`` adapter.
- :mod:`.convert`: a checkpoint's adapter exported to PEFT, an adapter merged into HF weights.
"""
