"""Convert a jsonl of problems into a DAPO-schema training/eval parquet.

    python tools/prepare_data.py --input train.jsonl --output train.parquet \
        --data-source gsm8k [--repeat K]

Formats: {"question", "answer"} (GSM8K, final answer after '####') or {"problem", "answer"}.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rlep_megatron.data.prepare import convert_jsonl  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="jsonl file")
    parser.add_argument("--output", required=True, help="parquet file to write (atomically)")
    parser.add_argument("--data-source", required=True,
                        help="data_source of every row; selects the reward rule (e.g. gsm8k, "
                             "math_dapo, math_verify)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="write each problem K times (the DAPO file repeats prompts)")
    args = parser.parse_args()
    try:
        count = convert_jsonl(args.input, args.output, args.data_source, args.repeat)
    except (ValueError, FileNotFoundError) as err:
        print(f"prepare_data: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {count} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
