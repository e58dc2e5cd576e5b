"""Subprocess program: load checkpoint directories in vLLM (files only), one after another in
this process, sample with log-probs and write each one's JSON lines ``{"prompt_ids",
"token_ids", "logprobs", "text", "finish_reason"}``:
``vllm_generate.py MODEL_DIR OUT [MODEL_DIR OUT ...]``."""
import json
import os
import sys


def main(pairs: list[str]) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    # the engine in this process (no engine-core and worker processes that would each import
    # vLLM again): vLLM's own LLM, sampler and log-probs all the same
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    for model_dir, out_path in zip(pairs[0::2], pairs[1::2]):
        generate(model_dir, out_path)
        cleanup_dist_env_and_memory()


def generate(model_dir: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", seed=0, enforce_eager=True, max_model_len=256,
              gpu_memory_utilization=0.2, distributed_executor_backend="uni")
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
               for q in ("What is 12+7?", "Compute 3*(4+5).")]
    params = SamplingParams(n=3, max_tokens=24, temperature=1.0, logprobs=0, seed=5)
    with open(out_path, "w") as f:
        for request in llm.generate(prompts, params):
            for completion in request.outputs:
                logprobs = [entry[token].logprob
                            for entry, token in zip(completion.logprobs, completion.token_ids)]
                f.write(json.dumps({"prompt_ids": list(request.prompt_token_ids),
                                    "token_ids": list(completion.token_ids),
                                    "logprobs": logprobs, "text": completion.text,
                                    "finish_reason": completion.finish_reason}) + "\n")
    del llm


if __name__ == "__main__":
    main(sys.argv[1:])
