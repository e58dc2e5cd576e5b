"""Export the LoRA adapter of a training checkpoint as a PEFT adapter directory
(adapter_config.json + adapter_model.safetensors), which peft and `vllm serve --lora-modules`
load.

    python tools/lora_export.py --checkpoint OUT/checkpoints/step_00000100 --out-dir ADAPTER
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="a training checkpoint of a run with lora.rank > 0")
    parser.add_argument("--out-dir", required=True, help="the PEFT adapter directory to write "
                        "(atomically; refused if it exists and is not empty)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of the written tensors")
    args = parser.parse_args(argv)
    from rlep_megatron.checkpoint.convert import run_conversion_cli
    from rlep_megatron.lora.convert import export_adapter

    return run_conversion_cli("lora_export", export_adapter, args.checkpoint, args.out_dir,
                              args.dtype)


if __name__ == "__main__":
    sys.exit(main())
