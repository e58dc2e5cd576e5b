"""Convert a jsonl / json / parquet file of problems into a DAPO-schema training/eval parquet.

    python tools/prepare_data.py --input train.jsonl --output train.parquet \
        --data-source math_dapo [--repeat K]
    python tools/prepare_data.py --input hf_export.parquet --output train.parquet \
        --data-source math_dapo --question-key problem_text --answer-key final [--answer-format plain]

    python tools/prepare_data.py --input math.jsonl --output train.parquet \
        --data-source math_verify --prompt-template boxed

Default columns: {"question", "answer"} (GSM8K, final answer after '####') or
{"problem", "answer"} (bare answer); name others with --question-key / --answer-key.
The prompt wraps each problem in a template: dapo (default; the DAPO rule reads the last
"Answer:" line), boxed (a final answer in \\boxed{}, for math_verify), plain (the problem as
it is), or your own text with a {question} field. docs/data-and-rewards.md has the details.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rlep_megatron.data.prepare import ANSWER_FORMATS, PROMPT_TEMPLATES, convert_jsonl  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True,
                        help=".jsonl (one object per line), .json (a list) or .parquet file")
    parser.add_argument("--output", required=True, help="parquet file to write (atomically)")
    parser.add_argument("--data-source", required=True,
                        help="data_source of every row; selects the reward rule (e.g. gsm8k, "
                             "math_dapo, math_verify)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="write each problem K times (the DAPO file repeats prompts)")
    parser.add_argument("--question-key", default="",
                        help="the input's question column (default: question or problem)")
    parser.add_argument("--answer-key", default="", help="the input's answer column "
                        "(default: answer)")
    parser.add_argument("--answer-format", default="auto", choices=ANSWER_FORMATS,
                        help="with named columns: gsm8k = the text after '####', plain = the "
                             "whole answer, auto = gsm8k when '####' is present")
    parser.add_argument("--prompt-template", default="dapo", metavar="NAME|TEXT",
                        help=f"{', '.join(PROMPT_TEMPLATES)} (default dapo), or a text with a "
                             "{question} field (write a literal brace as {{ or }})")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    try:
        count = convert_jsonl(args.input, args.output, args.data_source, args.repeat,
                              question_key=args.question_key, answer_key=args.answer_key,
                              answer_format=args.answer_format,
                              prompt_template=args.prompt_template)
    except (ValueError, FileNotFoundError) as err:
        print(f"prepare_data: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {count} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
