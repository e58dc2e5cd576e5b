"""Subprocess program: one-step-off rollout's request-level engine across two weight updates,
``carry_over_program.py MODEL_A MODEL_B OUT.json``.

On one rank (gloo), the rollout engine starts with MODEL_A's weights (version 0); six fresh
responses run a few engine steps, leave the engine (``resume``), the weights become MODEL_B's
(version 1) and the responses finish. Then six more run a few steps under B, leave the engine
(``restart``), the weights become A's again (version 2) and they start over. Every response's
prompt, tokens, recorded log-probs, version spans and finish reason go to OUT.json."""
import json
import os
import sys


def main(model_a: str, model_b: str, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", "29561")
    import torch
    from safetensors.torch import load_file

    torch.distributed.init_process_group("gloo")
    from rlep_megatron.config import RolloutConfig
    from rlep_megatron.rollout.colocated.engine import RolloutEngine
    from rlep_megatron.weight_sync import deliver

    cfg = RolloutConfig(num_samples_per_prompt=2, max_response_tokens=24)
    engine = RolloutEngine(model_a, cfg, dtype="float32", max_model_len=128, seed=0)
    weights = {name: load_file(os.path.join(path, "model.safetensors"))
               for name, path in (("a", model_a), ("b", model_b))}
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14]]
    requests = engine.requests(cfg)
    out = {}
    for phase, (carry_over, before, after, version) in enumerate(
            [("resume", "a", "b", 1), ("restart", "b", "a", 2)]):
        for index, prompt in enumerate(prompts):
            for sample in range(2):
                requests.submit((phase, index, sample), prompt, 1000 * phase + 10 * index + sample)
        for _ in range(6):
            requests.step()
        requests.pause(carry_over)
        deliver(engine, iter(weights[after].items()))
        requests.resume(version)
        requests.run_until(lambda: requests.finished(phase))
        out[carry_over] = [
            {"prompt": prompts[r.prompt_index], "token_ids": r.token_ids,
             "logprobs": r.logprobs, "versions": r.versions, "finish_reason": r.finish_reason}
            for group in requests.take(phase, engine.llm.get_tokenizer()) for r in group]
    with open(out_path, "w") as f:
        json.dump(out, f)
    engine.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
