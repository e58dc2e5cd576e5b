"""Mixture-of-experts experts on ``torch.nn.functional.grouped_mm``: every local expert of a
layer in one grouped GEMM per projection, without TransformerEngine or the ``grouped_gemm``
package (``model.moe_experts=grouped``, the local spec's default).

:class:`TorchGroupedMLP` is megatron-core's ``SequentialMLP`` with another forward: the same
submodules (``local_experts.{i}.linear_fc1`` / ``linear_fc2``), so the same parameters, state
dict, dist-checkpoint keys, HF conversion rules and weight sync. ``SequentialMLP`` splits the
tokens on the host (``tokens_per_expert.tolist()``, a device synchronisation per layer) and
runs each expert's MLP in turn; here the token counts become ``grouped_mm`` offsets on the
device and each projection is one call for all local experts.

The experts' weights stay separate parameters (megatron's gradient buffers, distributed
optimizer and checkpoints see ``SequentialMLP``'s). :class:`_GroupedLinear` stacks a
projection's weights for the duration of one GEMM, in the forward and again in the backward,
into one scratch buffer per device and dtype that every layer reuses, and saves the parameters
themselves for the backward, so no stacked copy is kept per layer: the cost is one buffer of a
projection's local expert weights (at the Qwen3-30B-A3B layer, 2 x 768 x 2048 x 2 bytes = 6 MiB
per local expert) and a copy of each projection's weights per GEMM, small next to the GEMM once
an expert gets hundreds of tokens (on a CPU with few tokens per expert it is not: see
``bench/moe_experts.py``).

The local linears are plain matmuls here: megatron's expert linears do no communication of
their own (``explicit_expert_comm``; the token dispatcher moves the tokens, also over the
expert-tensor-parallel group), and with one rank and no expert parallelism the parallel
linears are identities around ``x @ W.T``. Biases, fp8/fp4 and the TE activation are not
supported here (none is used by the architectures of this project): the layer refuses them
when it is built.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_GROUPED_MLP = None  # the class, built on first use (megatron is imported lazily)
_MIN_STRIDE_BYTES = 16  # grouped_mm's alignment rule for its operands' strides


def grouped_mm_available() -> bool:
    return hasattr(F, "grouped_mm")


def _aligned(*sizes: int, dtype: torch.dtype) -> bool:
    width = torch.empty((), dtype=dtype).element_size()
    return all((size * width) % _MIN_STRIDE_BYTES == 0 for size in sizes)


_SCRATCH: dict = {}  # (device, dtype) -> the flat buffer the weights are stacked into


def release_scratch() -> None:
    """Free the stacking buffers (while the optimizer state is offloaded for the rollout)."""
    _SCRATCH.clear()


def _stacked(weights) -> torch.Tensor:
    """``torch.stack(weights)`` in the shared scratch buffer (module doc); valid until the next
    call (the GEMMs that read it are queued on the same stream before that)."""
    first = weights[0]
    shape = (len(weights), *first.shape)
    numel = len(weights) * first.numel()
    key = (first.device, first.dtype)
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < numel:
        _SCRATCH.pop(key, None)
        buffer = _SCRATCH[key] = torch.empty(numel, dtype=first.dtype, device=first.device)
    return torch.stack(weights, out=buffer[:numel].view(shape))


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of group g] = x[rows of group g] @ weights[g].T`` with ``offs`` the groups'
    cumulative row counts (int32, on the device); the weights' gradients land on the
    individual parameters."""

    @staticmethod
    def forward(ctx, x, offs, *weights):
        ctx.save_for_backward(x, offs, *weights)
        return F.grouped_mm(x, _stacked(weights).transpose(1, 2), offs=offs)  # [groups, in, out]

    @staticmethod
    def backward(ctx, grad_y):
        x, offs, *weights = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = F.grouped_mm(grad_y, _stacked(weights), offs=offs)
        if any(ctx.needs_input_grad[2:]):
            # [out, tokens] x [tokens, in], the token dimension cut by offs -> [groups, out, in];
            # a group without tokens gets exactly 0 (some kernels leave it unwritten)
            grad_w = F.grouped_mm(grad_y.t(), x.contiguous(), offs=offs)
            empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
            grad_w.masked_fill_(empty[:, None, None], 0)
        grads = grad_w.unbind(0) if grad_w is not None else (None,) * len(weights)
        return (grad_x, None, *grads)


def grouped_linear(x: torch.Tensor, offs: torch.Tensor, weights: list[torch.Tensor]):
    return _GroupedLinear.apply(x, offs, *weights)


def _run_weight_pre_hooks(experts) -> None:
    """Run the forward pre-hooks of every expert's linears, which the grouped GEMM reads
    without calling them. With the distributed optimizer and ``overlap_param_gather``,
    megatron's DDP gathers each module's updated parameter shards in that module's own
    pre-hook (over ``parameters(recurse=False)``): skipped, the GEMM would read expert weights
    whose other data-parallel ranks' shards still hold the previous optimizer step's values.
    They run in the order ``SequentialMLP`` would call the linears. A pre-hook's return value
    (a replaced input) is ignored: these linears take no input here."""
    for expert in experts:
        for linear in (expert.linear_fc1, expert.linear_fc2):
            with_kwargs = linear._forward_pre_hooks_with_kwargs
            for hook_id, hook in list(linear._forward_pre_hooks.items()):
                if hook_id in with_kwargs:
                    hook(linear, (), {})
                else:
                    hook(linear, ())


def _grouped_mlp_class():
    from megatron.core.transformer.moe.experts import SequentialMLP

    class TorchGroupedMLP(SequentialMLP):
        """``SequentialMLP``'s parameters, every local expert in one grouped GEMM per
        projection (module doc)."""

        def __init__(self, num_local_experts, config, submodules, pg_collection=None):
            super().__init__(num_local_experts, config, submodules, pg_collection)
            unsupported = [name for name, on in (
                ("add_bias_linear", config.add_bias_linear), ("fp8", config.fp8),
                ("fp4", getattr(config, "fp4", None)),
                ("use_te_activation_func", getattr(config, "use_te_activation_func", False)),
                ("bias_activation_fusion", config.bias_activation_fusion)) if on]
            if unsupported:
                raise ValueError("model.moe_experts=grouped (torch grouped GEMM) does not "
                                 f"support {', '.join(unsupported)}; use "
                                 "model.moe_experts=sequential")
            if not grouped_mm_available():  # build_model checks first; a direct build here
                raise RuntimeError("model.moe_experts=grouped needs torch.nn.functional."
                                   f"grouped_mm (torch >= 2.10; this is {torch.__version__}); "
                                   "use model.moe_experts=sequential")

        def forward(self, hidden, tokens_per_expert, probs):
            config = self.config
            if config.moe_apply_probs_on_input:
                dtype = hidden.dtype
                hidden = (probs.unsqueeze(-1) * hidden).to(dtype)
                probs = torch.ones_like(probs)
            _run_weight_pre_hooks(self.local_experts)
            fc1 = [expert.linear_fc1.weight for expert in self.local_experts]
            fc2 = [expert.linear_fc2.weight for expert in self.local_experts]
            if not _aligned(hidden.shape[-1], fc1[0].shape[0], fc2[0].shape[0],
                            fc2[0].shape[1], dtype=hidden.dtype):
                # grouped_mm's kernels need 16-byte strides; such odd sizes take the loop
                return super().forward(hidden, tokens_per_expert, probs)
            offs = tokens_per_expert.to(device=hidden.device, dtype=torch.int32,
                                        non_blocking=True).cumsum(0, dtype=torch.int32)
            intermediate = grouped_linear(hidden, offs, fc1)
            if config.gated_linear_unit:
                gate, linear = torch.chunk(intermediate, 2, dim=-1)
                clamp = config.activation_func_clamp_value
                if clamp is not None:
                    gate = gate.clamp(min=None, max=clamp)
                    linear = linear.clamp(min=-clamp, max=clamp)
                intermediate = config.activation_func(gate) * (linear
                                                              + config.glu_linear_offset)
            else:
                intermediate = config.activation_func(intermediate)
            dtype = intermediate.dtype
            intermediate = (intermediate * probs.unsqueeze(-1)).to(dtype)
            return grouped_linear(intermediate, offs, fc2), None

    return TorchGroupedMLP


def torch_grouped_mlp():
    """:class:`TorchGroupedMLP` (module doc)."""
    global _GROUPED_MLP
    if _GROUPED_MLP is None:
        _GROUPED_MLP = _grouped_mlp_class()
    return _GROUPED_MLP


def use_grouped_experts(block_spec) -> None:
    """Put :class:`TorchGroupedMLP` in every mixture-of-experts layer of a local block spec
    (in place of ``SequentialMLP``)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    for layer_spec in block_spec.layer_specs:
        experts = getattr(getattr(layer_spec.submodules.mlp, "submodules", None), "experts",
                          None)
        if experts is not None and experts.module is SequentialMLP:
            experts.module = torch_grouped_mlp()
