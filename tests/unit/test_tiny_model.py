"""The tiny checkpoints: deterministic, loadable by transformers from files only, and real."""
import hashlib
import json
import os

import pytest
import torch

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


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
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
    # generation is the model's own distribution: the greedy token is the argmax of the logits
    greedy = model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False,
                            pad_token_id=tokenizer.pad_token_id)
    logits = model(torch.tensor([ids])).logits[0, -1]
    assert greedy[0, -1].item() == logits.argmax().item()


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
