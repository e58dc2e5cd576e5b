"""Builds the tiny HF checkpoints used by the tests and the tiny CPU default, fully offline.

A checkpoint is a directory with ``config.json``, ``generation_config.json``,
``model.safetensors`` and a tokenizer made here with the ``tokenizers`` library: one token per
byte (so every digit, operator, letter and newline is its own token and any text round-trips),
plus ChatML special tokens and a chat template. It loads with ``transformers``
``AutoModelForCausalLM``/``AutoTokenizer`` and with vLLM. The same seed gives identical files.

Run: ``python tools/make_tiny_model.py --out-dir D [--seed S] [--arch qwen2|qwen3|qwen3_moe|llama]``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from rlep_megatron.staging import staged_output

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SUPPORTED_ARCHS = ("qwen2", "qwen3", "qwen3_moe", "llama")
# Qwen3's head_dim need not be hidden / heads (Qwen3-0.6B: 1024 / 16 = 64, head_dim 128): the
# tiny Qwen3 keeps that property
QWEN3_HEAD_DIM = 64
# the tiny Qwen3-MoE: 8 experts, top-2, renormalised gates (Qwen3-30B-A3B: 128 experts, top-8),
# every layer sparse except the first (mlp_only_layers) so that both layer kinds are exercised
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
                 router_aux_loss_coef=0.001, output_router_logits=False)


@dataclass(frozen=True)
class TinyModelShape:
    hidden_size: int = 128
    num_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 352
    vocab_size: int = 320
    max_position_embeddings: int = 2048

    def __post_init__(self):
        if self.head_dim < 32:
            # vLLM's CPU attention backend rejects head_dim 16.
            raise ValueError(f"head_dim must be >= 32 for vLLM on CPU, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads}")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size={self.vocab_size} cannot hold 256 byte tokens and "
                             f"{len(SPECIAL_TOKENS)} special tokens")


def byte_to_unicode() -> dict[int, str]:
    """Printable stand-in character for every byte (the byte-level BPE convention), so that the
    byte-level pre-tokenizer and decoder of ``tokenizers`` map bytes to our vocabulary."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer():
    """A byte-level tokenizer: ids 0..255 are the bytes, then the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        model_max_length=TinyModelShape().max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_hf_config(arch: str, shape: TinyModelShape, eos_id: int, pad_id: int):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        dtype="float32",
    )
    if arch == "qwen2":
        # Tied embeddings like the small Qwen2.5 models; QKV bias is part of the architecture.
        return Qwen2Config(tie_word_embeddings=True, rope_theta=1_000_000.0,
                           use_sliding_window=False, **common)
    if arch == "qwen3":
        # untied head and q/k norms; head_dim 64 with hidden 128 and 4 heads (q_proj 128 -> 256)
        return Qwen3Config(tie_word_embeddings=False, rope_theta=1_000_000.0,
                           use_sliding_window=False, attention_bias=False,
                           **{**common, "head_dim": QWEN3_HEAD_DIM})
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(tie_word_embeddings=False, rope_theta=1_000_000.0,
                              use_sliding_window=False, attention_bias=False,
                              **{**common, "head_dim": QWEN3_HEAD_DIM}, **QWEN3_MOE)
    if arch == "llama":
        return LlamaConfig(tie_word_embeddings=False, rope_theta=500_000.0,
                           attention_bias=False, mlp_bias=False, **common)
    raise ValueError(f"unsupported --arch {arch!r}; choose one of {list(SUPPORTED_ARCHS)}")


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic init independent of the transformers version: N(0, 0.02) for matrices and
    biases (non-zero biases exercise the QKV-bias mapping), ones for norms."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))


def make_tiny_model(out_dir: str, seed: int = 0, arch: str = "qwen2",
                    shape: TinyModelShape = TinyModelShape()) -> str:
    """Write a tiny HF checkpoint to ``out_dir`` (created atomically); returns ``out_dir``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported --arch {arch!r}; choose one of {list(SUPPORTED_ARCHS)}")
    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = build_hf_config(arch, shape, eos_id, pad_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed)

    with staged_output(out_dir, replace_existing=True) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id,
                         do_sample=True, temperature=1.0, top_p=1.0).save_pretrained(staging)
        _normalise_json_files(staging)
    return out_dir


def _normalise_json_files(directory: str) -> None:
    """Rewrite JSON files with sorted keys so identical content gives identical bytes."""
    for name in os.listdir(directory):
        if name.endswith(".json"):
            path = os.path.join(directory, name)
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2, sort_keys=True, ensure_ascii=False)
                f.write("\n")
