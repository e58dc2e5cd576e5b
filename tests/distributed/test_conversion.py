"""HF <-> megatron conversion: bit-exact round trips (single and sharded safetensors), loading
at another TP/PP checked against transformers, and bad input that leaves no partial output."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests import forkserver
from tests.torchrun import REPO_ROOT, run_tool_in_process, run_ranks

pytestmark = pytest.mark.distributed


def tool(script, *args):
    """A converter, run in this process (the bad-input test runs them as programs)."""
    return run_tool_in_process(script, [*args, "--no-progress"])


def program(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, *forkserver.command([*args, "--no-progress"])],
                          cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# the verify tool's own verdict line (a crash of the launch also says "FAILED")
VERIFY_FAILED = r"max \|delta logprob\| = \S+ \(tolerance \S+\): FAIL"


def hf_tensors(directory):
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(directory, name)))
    return tensors


def assert_bit_exact(reference_dir, candidate_dir):
    reference, candidate = hf_tensors(reference_dir), hf_tensors(candidate_dir)
    assert sorted(reference) == sorted(candidate)
    for name, tensor in reference.items():
        other = candidate[name]
        assert other.dtype == tensor.dtype and other.shape == tensor.shape, name
        assert torch.equal(tensor.view(torch.uint8), other.view(torch.uint8)), name


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe", "llama"])
def test_round_trip_is_bit_exact_single_and_sharded(arch, request, tmp_path):
    """HF -> megatron -> HF gives every tensor bit for bit, the config and the tokenizer; for
    the MoE (the most tensors) also through sharded safetensors both ways (the shard writer
    and reader know nothing of the architecture)."""
    hf_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    mcore, back, sharded = tmp_path / "mcore", tmp_path / "back", tmp_path / "sharded"
    proc = tool("tools/convert_hf_to_mcore.py", "--hf-dir", hf_dir, "--out-dir", str(mcore))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tensors" in proc.stdout and "GB/s" in proc.stdout
    proc = tool("tools/convert_mcore_to_hf.py", "--mcore-dir", str(mcore), "--out-dir", str(back))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_bit_exact(hf_dir, back)
    assert json.load(open(back / "config.json")) == json.load(open(os.path.join(hf_dir,
                                                                                "config.json")))
    assert os.path.exists(back / "tokenizer.json")
    if arch != "qwen3_moe":
        return
    # sharded output (tiny shards), then sharded input back through the whole cycle
    proc = tool("tools/convert_mcore_to_hf.py", "--mcore-dir", str(mcore), "--out-dir",
                str(sharded), "--max-shard-gb", "0.0005")
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = json.load(open(sharded / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 2
    assert_bit_exact(hf_dir, sharded)
    proc = tool("tools/convert_hf_to_mcore.py", "--hf-dir", str(sharded), "--out-dir",
                str(tmp_path / "mcore2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = tool("tools/convert_mcore_to_hf.py", "--mcore-dir", str(tmp_path / "mcore2"),
                "--out-dir", str(tmp_path / "back2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_bit_exact(hf_dir, tmp_path / "back2")


def transformers_made(arch: str, out_dir, seed: int = 7) -> str:
    """A checkpoint as transformers itself writes one: its own config class with its defaults,
    its own random initialisation, bfloat16 weights and ``save_pretrained``'s files as they
    are, except that the norm weights (transformers starts them at 1, as megatron does) are
    moved off 1 so that a misplaced norm shows. Shapes unlike the project's tiny maker: a tied Qwen3 head, ``head_dim`` 24 with hidden
    96 and 6 heads; a MoE whose middle layer is dense (``mlp_only_layers``) with gates that
    are not renormalised (``norm_topk_prob=false``)."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    from rlep_megatron.tiny_model import build_tokenizer

    common = dict(vocab_size=320, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=24,
                  max_position_embeddings=256)
    if arch == "qwen3":
        config = Qwen3Config(tie_word_embeddings=True, **common)
    else:
        config = Qwen3MoeConfig(tie_word_embeddings=False, num_experts=6, num_experts_per_tok=2,
                                moe_intermediate_size=48, mlp_only_layers=[1],
                                norm_topk_prob=False, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # its norms start at exactly 1: make each one tell where it went
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return str(out_dir)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_a_checkpoint_made_by_transformers_round_trips_and_verifies(arch, tmp_path):
    """HF -> megatron -> HF bit for bit on a transformers-made checkpoint (not the project's
    maker), then the converted checkpoint checked against transformers with the model split
    (Qwen3 over TP2, the MoE's experts over EP2); another checkpoint's weights fail."""
    hf_dir = transformers_made(arch, tmp_path / "hf")
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    proc = tool("tools/convert_hf_to_mcore.py", "--hf-dir", hf_dir, "--out-dir", str(mcore))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = tool("tools/convert_mcore_to_hf.py", "--mcore-dir", str(mcore), "--out-dir", str(back))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_bit_exact(hf_dir, back)
    assert hf_tensors(back)["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert json.load(open(back / "config.json")) == json.load(open(os.path.join(hf_dir,
                                                                                "config.json")))
    split = ["--tp", "2"] if arch == "qwen3" else ["--ep", "2"]
    proc = run_ranks("tools/verify_conversion.py", 2,
                     ["--hf-dir", hf_dir, "--mcore-dir", str(mcore), *split])
    assert "OK" in proc.stdout, proc.stdout
    other = transformers_made(arch, tmp_path / "other", seed=8)
    with pytest.raises(AssertionError, match=VERIFY_FAILED):
        run_ranks("tools/verify_conversion.py", 2,
                  ["--hf-dir", other, "--mcore-dir", str(mcore), *split])


def test_converted_checkpoint_verifies_at_another_layout(tiny_qwen2_dir, tmp_path):
    mcore = str(tmp_path / "mcore")
    assert tool("tools/convert_hf_to_mcore.py", "--hf-dir", tiny_qwen2_dir,
                "--out-dir", mcore).returncode == 0
    proc = run_ranks("tools/verify_conversion.py", 4, ["--hf-dir", tiny_qwen2_dir,
                                                       "--mcore-dir", mcore, "--tp", "2",
                                                       "--pp", "2"])
    assert "TP=2 PP=2" in proc.stdout and "OK" in proc.stdout
    # (that the check fails on another checkpoint's weights, split over TP2 and over EP2, is
    # test_a_checkpoint_made_by_transformers_round_trips_and_verifies's)


def test_converted_moe_checkpoint_verifies_with_experts_split(tiny_qwen3_moe_dir, tmp_path):
    """The tiny Qwen3-MoE converted once, loaded with its experts split over 2 EP ranks and
    over TP2 (sequence parallel), checked against transformers."""
    mcore = str(tmp_path / "mcore")
    assert tool("tools/convert_hf_to_mcore.py", "--hf-dir", tiny_qwen3_moe_dir,
                "--out-dir", mcore).returncode == 0
    for args in (["--ep", "2"], ["--tp", "2"]):
        proc = run_ranks("tools/verify_conversion.py", 2,
                         ["--hf-dir", tiny_qwen3_moe_dir, "--mcore-dir", mcore, *args])
        assert "OK" in proc.stdout, proc.stdout


def test_tp_that_does_not_divide_heads_is_refused(tiny_qwen2_dir):
    with pytest.raises(AssertionError) as err:
        run_ranks("tools/verify_conversion.py", 3, ["--hf-dir", tiny_qwen2_dir, "--tp", "3"])
    assert "tensor_model_parallel_size=3 does not divide the number of attention heads (4)" \
        in str(err.value)


def leftovers(parent):
    return [n for n in os.listdir(parent) if "partial" in n]


def test_bad_inputs_give_clear_errors_and_no_partial_output(tiny_qwen2_dir, tmp_path):
    """Each converter run as a program once (its exit code), the rest in this process."""
    out = tmp_path / "out"
    proc = program("tools/convert_hf_to_mcore.py", "--hf-dir", str(tmp_path / "nope"),
                "--out-dir", str(out))
    assert proc.returncode == 2 and "not found" in proc.stderr and not out.exists()

    unsupported = tmp_path / "gpt2"
    shutil.copytree(tiny_qwen2_dir, unsupported)
    config = json.load(open(unsupported / "config.json"))
    config["model_type"] = "gpt2"
    json.dump(config, open(unsupported / "config.json", "w"))
    proc = tool("tools/convert_hf_to_mcore.py", "--hf-dir", str(unsupported), "--out-dir",
                str(out))
    assert proc.returncode == 2 and "'gpt2' is not supported" in proc.stderr
    assert not out.exists()

    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_qwen2_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = tool("tools/convert_hf_to_mcore.py", "--hf-dir", str(truncated), "--out-dir",
                str(out))
    assert proc.returncode == 2 and "model.safetensors" in proc.stderr
    assert not out.exists() and leftovers(tmp_path) == []

    out.mkdir()
    (out / "keep.txt").write_text("existing")
    proc = tool("tools/convert_hf_to_mcore.py", "--hf-dir", tiny_qwen2_dir, "--out-dir", str(out))
    assert proc.returncode == 2 and "not empty" in proc.stderr
    assert os.listdir(out) == ["keep.txt"]

    proc = program("tools/convert_mcore_to_hf.py", "--mcore-dir", tiny_qwen2_dir, "--out-dir",
                str(tmp_path / "hf"))
    assert proc.returncode == 2 and "metadata.json" in proc.stderr
