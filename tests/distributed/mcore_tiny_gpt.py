"""Torchrun program: a tiny Qwen2-like megatron-core GPTModel, forward + backward through
megatron-core's pipeline schedule on CPU ranks.

``--mode save``: build at the given layout from a seed, save with dist_checkpointing, report.
``--mode load``: build at the given layout, load the saved weights, report.
Rank 0 writes ``{"loss": ..., "grad_sq_sum": ...}`` to ``--out``; the test compares layouts.
"""
import argparse
import json
import os

import torch

from rlep_megatron import distributed
from rlep_megatron.config import ParallelConfig

SEQ_LEN, MICRO_BATCH, NUM_MICRO_BATCHES, VOCAB = 24, 2, 2, 320


def build_model(pre_process, post_process):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    config = TransformerConfig(
        num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2,
        kv_channels=32, ffn_hidden_size=352, normalization="RMSNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=True, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, attention_backend=AttnBackend.local,
        tensor_model_parallel_size=distributed.current_context().tensor_model_parallel_size,
        pipeline_model_parallel_size=distributed.current_context().pipeline_model_parallel_size,
    )
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
        normalization="RMSNorm"), vocab_size=VOCAB, max_sequence_length=SEQ_LEN,
        pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=False, position_embedding_type="rope",
        rotary_base=1_000_000)


def make_batches():
    generator = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(NUM_MICRO_BATCHES):
        tokens = torch.randint(0, 259, (MICRO_BATCH, SEQ_LEN), generator=generator)
        labels = torch.roll(tokens, -1, dims=1)
        loss_mask = torch.ones(MICRO_BATCH, SEQ_LEN)
        loss_mask[0, -5:] = 0.0  # padded tail of one sequence
        batches.append(dict(tokens=tokens, labels=labels, loss_mask=loss_mask,
                            position_ids=torch.arange(SEQ_LEN).expand(MICRO_BATCH, -1)))
    return batches


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], attention_mask=None,
                   labels=batch["labels"])

    def loss_func(per_token_loss):
        loss = (per_token_loss.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        # The schedule divides the returned loss in place by the number of micro-batches.
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def grad_sq_sum(model):
    """Sum of squared gradients over the whole (unsharded) model, reduced over TP and PP."""
    from megatron.core import parallel_state as ps

    total = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        if param.grad is None:
            continue
        sharded = getattr(param, "tensor_model_parallel", False)
        if sharded or ps.get_tensor_model_parallel_rank() == 0:
            total += param.grad.double().pow(2).sum()
    torch.distributed.all_reduce(total, group=ps.get_model_parallel_group())
    return total.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--mode", choices=["save", "load"], required=True)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    distributed.init_model_parallel(
        ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp),
        seed=7, num_attention_heads=4, num_query_groups=2, num_layers=4)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = build_model(ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    if args.mode == "save":
        os.makedirs(args.ckpt_dir, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), args.ckpt_dir)
    else:
        state = dist_checkpointing.load(model.sharded_state_dict(), args.ckpt_dir)
        model.load_state_dict(state)

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(make_batches()), model=[model],
        num_microbatches=NUM_MICRO_BATCHES, seq_length=SEQ_LEN, micro_batch_size=MICRO_BATCH,
        forward_only=False)
    loss = torch.zeros((), dtype=torch.float64)
    if ps.is_pipeline_last_stage():
        loss += torch.stack([entry["loss"] for entry in losses]).double().mean()
    # The last stage holds the loss; share it with every rank of the pipeline.
    torch.distributed.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
    sq = grad_sq_sum(model)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"loss": loss.item(), "grad_sq_sum": sq}, f)
    distributed.destroy()


if __name__ == "__main__":
    main()
