"""rlep_megatron: a Megatron-core trainer for RL with verifiable rewards, built around RLEP
(Reinforcement Learning with Experience rePlay). See README.md.

Importing the package is cheap: vLLM, TransformerEngine, Ray and megatron-core are imported only
by the modules that use them, when they are used.
"""

__version__ = "0.1.0"
