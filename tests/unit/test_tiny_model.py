"""The tiny checkpoints: deterministic, loadable by transformers from files only, and real."""
import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from rlep_megatron.tiny_model import TinyModelShape, make_tiny_model

pytestmark = pytest.mark.unit


def digests(directory):
    return {name: hashlib.sha256(open(os.path.join(directory, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(directory))}


def test_same_seed_gives_identical_files(tmp_path, tiny_qwen2_dir):
    again = make_tiny_model(str(tmp_path / "again"), seed=0, arch="qwen2")
    assert digests(again) == digests(tiny_qwen2_dir)
    other = make_tiny_model(str(tmp_path / "other"), seed=1, arch="qwen2")
    assert digests(other)["model.safetensors"] != digests(tiny_qwen2_dir)["model.safetensors"]
    assert digests(other)["tokenizer.json"] == digests(tiny_qwen2_dir)["tokenizer.json"]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_loads_in_transformers_and_generates(arch, request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = request.getfixturevalue(f"tiny_{arch}_dir")
    files = set(os.listdir(directory))
    assert {"config.json", "generation_config.json", "model.safetensors",
            "tokenizer.json", "tokenizer_config.json"} <= files
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    config = json.load(open(os.path.join(directory, "config.json")))
    assert config["model_type"] == arch and config["head_dim"] >= 32
    # the architecture really has what the config says (tied Qwen2 with QKV bias, untied Llama)
    names = dict(model.named_parameters())
    if arch == "qwen2":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert "model.layers.0.self_attn.q_proj.bias" in names
    elif arch == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in names
        assert config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]
    else:
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
        assert "model.layers.0.self_attn.q_proj.bias" not in names

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12+7?"}],
                                           tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 12+7?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    torch.manual_seed(0)
    out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=True,
                         pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > len(ids)
    # the logits are those of the architecture the config describes, computed independently
    # from the safetensors in float64. transformers keeps RMSNorm and the rotary angles in
    # float32 even in a float64 model, so the two agree to float32 precision (differences of
    # about 1e-7 here; a wrong rotary layout, bias or tie shows up at 1e-2 and above)
    weights = {k: v.double() for k, v in load_file(os.path.join(directory,
                                                                 "model.safetensors")).items()}
    expected = reference_logits(weights, config, ids)
    got = model.double()(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert expected.std() > 1e-3  # not a degenerate (all-equal) distribution


def reference_logits(w, config, ids):
    """Llama-family forward (Qwen2 adds QKV biases and ties the head; Qwen3 normalises each
    query/key head), one sequence, float64: RMSNorm, rotary embedding on halves, grouped-query
    causal attention, SwiGLU MLP."""
    heads, kv_heads, dim = (config["num_attention_heads"], config["num_key_value_heads"],
                            config["head_dim"])
    eps = config["rms_norm_eps"]
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    n = len(ids)

    def rms(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    def linear(x, name):
        y = x @ w[f"{name}.weight"].T
        return y + w[f"{name}.bias"] if f"{name}.bias" in w else y

    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(angles).repeat(1, 2), torch.sin(angles).repeat(1, 2)

    def rotate(x):  # [heads, n, dim]
        first, second = x[..., :dim // 2], x[..., dim // 2:]
        return x * cos + torch.cat([-second, first], -1) * sin

    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    causal = torch.triu(torch.full((n, n), float("-inf"), dtype=torch.float64), 1)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        h = rms(x, w[f"{p}.input_layernorm.weight"])
        q = linear(h, f"{p}.self_attn.q_proj").view(n, heads, dim).transpose(0, 1)
        k = linear(h, f"{p}.self_attn.k_proj").view(n, kv_heads, dim).transpose(0, 1)
        v = linear(h, f"{p}.self_attn.v_proj").view(n, kv_heads, dim).transpose(0, 1)
        if f"{p}.self_attn.q_norm.weight" in w:  # Qwen3: RMSNorm over each head, before rotary
            q = rms(q, w[f"{p}.self_attn.q_norm.weight"])
            k = rms(k, w[f"{p}.self_attn.k_norm.weight"])
        q, k = rotate(q), rotate(k)
        k = k.repeat_interleave(heads // kv_heads, 0)
        v = v.repeat_interleave(heads // kv_heads, 0)
        attention = torch.softmax(q @ k.transpose(1, 2) / dim ** 0.5 + causal, -1) @ v
        x = x + linear(attention.transpose(0, 1).reshape(n, heads * dim), f"{p}.self_attn.o_proj")
        h = rms(x, w[f"{p}.post_attention_layernorm.weight"])
        gate = linear(h, f"{p}.mlp.gate_proj")
        x = x + linear(gate * torch.sigmoid(gate) * linear(h, f"{p}.mlp.up_proj"),
                       f"{p}.mlp.down_proj")
    x = rms(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def test_tokenizer_is_byte_level_with_chat_tokens(tiny_qwen2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir, local_files_only=True)
    text = "x = 3*(4+5) - 7/2\nAnswer: 20.5 Ünïcode $\\frac{1}{2}$"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # one token per byte, id = byte value
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") >= 256
    generation = json.load(open(os.path.join(tiny_qwen2_dir, "generation_config.json")))
    assert tokenizer.eos_token_id in generation["eos_token_id"]


def test_shape_validation():
    with pytest.raises(ValueError, match="head_dim"):
        TinyModelShape(head_dim=16)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        TinyModelShape(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model("unused", arch="gpt2")
