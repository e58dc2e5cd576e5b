"""``python -m rlep_megatron.rollout.servers.serve_main ARGS``: vLLM's OpenAI-compatible server,
as ``python -m vllm.entrypoints.openai.api_server ARGS`` starts it, from a main module that
imports nothing itself.

vLLM starts the server's engine core in a process of its own with ``spawn``, which imports the
parent's main module again there. Started from vLLM's ``api_server`` module, the engine core
would import the whole HTTP front end too (FastAPI, the OpenAI protocol, the tool and reasoning
parsers), which it never uses: several seconds of CPU on every server start."""

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
