"""The ``lora`` section refuses every bad value before anything is built: unknown target modules
(listing the valid ones), a rank above a targeted projection's width, experts of a
mixture-of-experts model, TransformerEngine's fused layers, and an adapter to start from that
belongs to another base model or another ``lora`` section. The rollout copy of an adapter is
laid out as megatron's fused linears are (checked against the conversion tables' own
re-layout)."""
import json

import pytest
import torch

from rlep_megatron.config import LoraConfig, RunConfig
from rlep_megatron.lora import peft_io
from rlep_megatron.lora.preflight import check
from rlep_megatron.lora.targets import check_model

pytestmark = pytest.mark.unit

QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
         "vocab_size": 100}
MOE = {**QWEN2, "model_type": "qwen3_moe", "num_experts": 8}


@pytest.mark.parametrize("kwargs, message", [
    ({"target_modules": ["q_proj", "qkv"]},
     "unknown module(s) ['qkv']; valid: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
     "down_proj or all-linear"),
    ({"target_modules": []}, "lora.target_modules is empty"),
    ({"target_modules": ["all-linear", "q_proj"]}, "give it alone"),
    ({"target_modules": ["q_proj", "q_proj"]}, "names a module twice"),
    ({"alpha": 0}, "lora.alpha must be > 0"),
    ({"dropout": 1.0}, "lora.dropout must be in [0, 1)"),
    ({"lr": -1.0}, "lora.lr must be > 0"),
])
def test_bad_values_are_refused_with_what_to_do(kwargs, message):
    with pytest.raises(ValueError) as err:
        LoraConfig(rank=8, **kwargs)
    assert message in str(err.value)


def test_rank_zero_is_full_fine_tuning_and_checks_nothing_else():
    lora = LoraConfig(rank=0, target_modules=["nonsense"])
    assert not lora.enabled
    assert check(lora, QWEN2) is None


def test_a_rank_above_a_projections_width_is_refused():
    check_model(LoraConfig(rank=32, target_modules=["k_proj"]), QWEN2)  # k_proj: 32 x 64
    with pytest.raises(ValueError, match=r"lora.rank=33 is above the width of k_proj "
                                         r"\(32 x 64\).*rank <= 32"):
        check_model(LoraConfig(rank=33, target_modules=["k_proj"]), QWEN2)
    check_model(LoraConfig(rank=33, target_modules=["q_proj"]), QWEN2)  # 64 x 64


def test_experts_are_refused_and_all_linear_leaves_them_out():
    with pytest.raises(ValueError, match="adapters on the experts are not supported"):
        check_model(LoraConfig(rank=4, target_modules=["q_proj", "down_proj"]), MOE)
    check_model(LoraConfig(rank=4), MOE)  # all-linear: attention and dense MLP layers


@pytest.mark.parametrize("model, lora, rollout, message", [
    ({"transformer_engine": "required"}, {}, {}, "model.transformer_engine=required"),
    ({"recompute_activations": True}, {"dropout": 0.1}, {},
     "lora.dropout > 0 with model.recompute_activations"),
    ({"mcore_dir": "converted"}, {}, {"lora_sync": "adapter"},
     "rollout.lora_sync=adapter with model.mcore_dir"),
    ({}, {}, {"lora_sync": "adapter", "placement": "separate", "num_ranks": 1,
              "carry_over": "keep"}, "rollout.lora_sync=adapter with rollout.carry_over=keep"),
    ({}, {"rank": 1024}, {"lora_sync": "adapter"}, "vLLM's largest LoRA rank is 512"),
    ({}, {"rank": 0, "lr": 1e-4}, {}, "lora.init_from / lora.lr without lora.rank"),
])
def test_lora_settings_that_clash_with_the_run_are_refused(model, lora, rollout, message):
    from rlep_megatron.config import ModelConfig, RolloutConfig

    with pytest.raises(ValueError, match=message):
        RunConfig(model=ModelConfig(**model), lora=LoraConfig(**{"rank": 4, **lora}),
                  rollout=RolloutConfig(**rollout))
    RunConfig(lora=LoraConfig(rank=4), rollout=RolloutConfig(  # the servers take adapters
        lora_sync="adapter", placement="separate", num_ranks=1))
    assert RunConfig(lora=LoraConfig(rank=4)).actor_transformer_engine == "off"
    assert RunConfig().actor_transformer_engine == "auto"


def write_adapter(directory, config, shapes):
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file({name: torch.zeros(shape) for name, shape in shapes.items()},
              str(directory / "adapter_model.safetensors"))
    return str(directory)


def test_an_adapter_of_another_base_or_section_is_refused(tmp_path):
    lora = LoraConfig(rank=4, alpha=8, target_modules=["q_proj"])
    good = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    name = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    shapes = {name.format(layer, "A"): (4, 64) for layer in (0, 1)}
    shapes.update({name.format(layer, "B"): (64, 4) for layer in (0, 1)})
    ok = write_adapter(tmp_path / "ok", good, shapes)
    assert set(check(LoraConfig(**{**lora.__dict__, "init_from": ok}), QWEN2)) == set(shapes)
    # a layer's tensors missing
    partial = write_adapter(tmp_path / "partial", good, {k: v for k, v in shapes.items()
                                                         if ".layers.1." not in k})
    with pytest.raises(ValueError, match=r"lacks 2 of the tensors .* e\.g\. "
                                         r"base_model.model.model.layers.1.self_attn.q_proj"):
        check(LoraConfig(**{**lora.__dict__, "init_from": partial}), QWEN2)
    # per-layer ranks, and a tensor of no supported projection
    pattern = write_adapter(tmp_path / "pattern", {**good, "rank_pattern": {"q_proj": 8}},
                            shapes)
    with pytest.raises(ValueError, match="rank_pattern"):
        check(LoraConfig(**{**lora.__dict__, "init_from": pattern}), QWEN2)
    stray = write_adapter(tmp_path / "stray", good, {
        **shapes, "base_model.model.lm_head.lora_A.weight": (4, 64)})
    with pytest.raises(ValueError, match="lm_head.lora_A.weight is no LoRA factor"):
        check(LoraConfig(**{**lora.__dict__, "init_from": stray}), QWEN2)
    # trained on a base with hidden size 128
    other = write_adapter(tmp_path / "other", good, {name.format(0, "A"): (4, 128),
                                                     name.format(0, "B"): (128, 4)})
    with pytest.raises(ValueError, match=r"has shape \(4, 128\), this model's q_proj needs "
                                         r"\(4, 64\): the adapter was trained on another base"):
        check(LoraConfig(**{**lora.__dict__, "init_from": other}), QWEN2)
    rank8 = write_adapter(tmp_path / "rank8", {**good, "r": 8}, {})
    with pytest.raises(ValueError, match="r: adapter 8, run 4"):
        check(LoraConfig(**{**lora.__dict__, "init_from": rank8}), QWEN2)
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        check(LoraConfig(**{**lora.__dict__, "init_from": str(tmp_path)}), QWEN2)


def test_rlep_config_reports_a_lora_problem_before_anything_is_built(tmp_path, capsys):
    from rlep_megatron.cli import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN2))
    train = tmp_path / "train.parquet"
    train.write_bytes(b"")
    assert main(["config", f"model.hf_dir={model}", f"data.train_files=[{train}]",
                 "lora.rank=40", "lora.target_modules=[v_proj]"]) == 2
    assert "lora.rank=40 is above the width of v_proj" in capsys.readouterr().err


def test_the_fused_layout_of_the_adapters_is_the_conversion_tables():
    """``arrange`` puts per-projection rows where megatron's fused ``linear_qkv`` and
    ``linear_fc1`` hold them: the same as the HF -> megatron re-layout of the conversion
    tools (``layout.fuse_qkv``, ``[gate; up]``), shard by shard."""
    from rlep_megatron.lora.adapters import arrange
    from rlep_megatron.models import layout
    from rlep_megatron.models.llama_family import dims_from_config

    dims = dims_from_config(QWEN2)
    q, k, v = (torch.randn(n, 3) for n in (64, 32, 32))
    gate, up = torch.randn(96, 3), torch.randn(96, 3)
    for tp in (1, 2):
        full = layout.fuse_qkv(q, k, v, dims)
        for rank in range(tp):
            pieces = {"q": q.chunk(tp)[rank], "k": k.chunk(tp)[rank], "v": v.chunk(tp)[rank]}
            torch.testing.assert_close(arrange(pieces, "self_attention.linear_qkv", dims, tp, 0),
                                       full.chunk(tp)[rank], rtol=0, atol=0)
            pieces = {"gate": gate.chunk(tp)[rank], "up": up.chunk(tp)[rank]}
            torch.testing.assert_close(arrange(pieces, "mlp.linear_fc1", dims, tp, 0),
                                       torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]),
                                       rtol=0, atol=0)
    # a projection without adapter: its rows stay zero
    only_v = arrange({"v": v}, "self_attention.linear_qkv", dims, 1, 0)
    torch.testing.assert_close(only_v, layout.fuse_qkv(torch.zeros_like(q), torch.zeros_like(k),
                                                       v, dims), rtol=0, atol=0)


def test_peft_config_round_trips_the_section():
    lora = LoraConfig(rank=4, alpha=16, target_modules=["v_proj", "q_proj"])
    config = peft_io.peft_config(lora, "base")
    assert config["r"] == 4 and config["lora_alpha"] == 16
    assert config["target_modules"] == ["q_proj", "v_proj"]
