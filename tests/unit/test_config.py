import dataclasses
import os

import pytest
import yaml

from rlep_megatron import config as config_lib
from rlep_megatron.config import RunConfig, dump_config, load_config

pytestmark = pytest.mark.unit

CONTRACT_KEYS = [
    "trainer.output_dir", "trainer.total_steps", "trainer.seed",
    "checkpoint.save_interval_steps", "checkpoint.resume",
    "rollout.num_samples_per_prompt", "replay.num_replays_per_prompt",
    "rollout.tensor_model_parallel_size",
]

RECIPE = """
trainer: {output_dir: runs/x, total_steps: 7, seed: 3, mini_batch_unit: sequences}
rollout: {num_samples_per_prompt: 4, temperature: 0.7, top_p: 0.95}
replay: {num_replays_per_prompt: 2, pool_files: [a.parquet, b.parquet]}
parallel: {tensor_model_parallel_size: 2, pipeline_model_parallel_size: 2,
           virtual_pipeline_model_parallel_size: 2}
optim: {lr: 1.0e-6}
algo: {loss_agg_mode: reference_micro_batch_mean}
"""


def write(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_contract_keys_exist():
    keys = config_lib.valid_keys()
    for key in CONTRACT_KEYS:
        assert key in keys


def test_recipe_round_trips(tmp_path):
    cfg = load_config(write(tmp_path, RECIPE))
    assert cfg.trainer.total_steps == 7 and cfg.replay.pool_files == ["a.parquet", "b.parquet"]
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
    path = dump_config(cfg, str(tmp_path / "run"))
    again = load_config(path)
    assert again == cfg
    # The dump is plain YAML with every section, so it is a complete, self-contained recipe.
    dumped = yaml.safe_load(open(path))
    assert set(dumped) == {f.name for f in dataclasses.fields(RunConfig)}


def test_defaults_round_trip(tmp_path):
    cfg = load_config(None)
    assert load_config(dump_config(cfg, str(tmp_path))) == cfg == RunConfig()


def test_overrides_are_coerced(tmp_path):
    cfg = load_config(write(tmp_path, RECIPE), [
        "trainer.total_steps=12", "optim.lr=3e-6", "rollout.top_p=1", "checkpoint.resume=never",
        "data.train_files=[x.parquet]", "data.val_files=y.parquet", "model.hf_dir=models/tiny",
        "parallel.virtual_pipeline_model_parallel_size=null", "trainer.log_all_ranks=true"])
    assert cfg.trainer.total_steps == 12
    assert cfg.optim.lr == pytest.approx(3e-6) and isinstance(cfg.optim.lr, float)
    assert cfg.rollout.top_p == 1.0 and isinstance(cfg.rollout.top_p, float)
    assert cfg.data.train_files == ["x.parquet"] and cfg.data.val_files == ["y.parquet"]
    assert cfg.parallel.virtual_pipeline_model_parallel_size is None
    assert cfg.trainer.log_all_ranks is True
    # a string field keeps numeric-looking values as strings
    assert load_config(None, ["model.hf_dir=123"]).model.hf_dir == "123"


@pytest.mark.parametrize("override, needle", [
    ("trainer.total_stepz=3", "trainer.total_stepz"),
    ("trainr.total_steps=3", "trainr"),
    ("rollout.num_samples_per_prompt=many", "rollout.num_samples_per_prompt"),
    ("trainer.total_steps=1.5", "trainer.total_steps"),
    ("trainer.log_all_ranks=maybe", "trainer.log_all_ranks"),
    ("optim.lr=fast", "optim.lr"),
    ("algo.loss_agg_mode=sum", "algo.loss_agg_mode"),
    ("algo.loss=ppo", "algo.loss"),
    ("algo.advantage=gae", "algo.advantage"),
    ("eval.temperature=0", "eval.num_samples_per_prompt=1"),
    ("trainer.seed", "trainer.seed"),
])
def test_bad_override_names_the_key(override, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        load_config(None, [override])


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(ValueError) as err:
        load_config(write(tmp_path, "rollout: {num_sample_per_prompt: 4}\n"))
    message = str(err.value)
    assert "rollout.num_sample_per_prompt" in message
    assert "rollout.num_samples_per_prompt" in message  # the valid key is offered


def test_bad_type_in_recipe_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"replay\.num_replays_per_prompt"):
        load_config(write(tmp_path, "replay: {num_replays_per_prompt: two}\n"))
    with pytest.raises(ValueError, match=r"data\.train_files\[1\]"):
        load_config(write(tmp_path, "data: {train_files: [a.parquet, {x: 1}]}\n"))


@pytest.mark.parametrize("override, needle", [
    ("rollout.num_samples_per_prompt=0", "rollout.num_samples_per_prompt"),
    ("replay.num_replays_per_prompt=-1", "replay.num_replays_per_prompt"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("parallel.tensor_model_parallel_size=0", "parallel.tensor_model_parallel_size"),
    ("parallel.virtual_pipeline_model_parallel_size=2", "virtual_pipeline"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last"),
    ("rollout.temperature=0", "rollout.temperature must be > 0"),
    ("rollout.temperature=-0.5", "rollout.temperature must be > 0"),
    ("collect.temperature=0", "collect.temperature must be > 0"),
    ("optim.lr_warmup_unit=epochs", "optim.lr_warmup_unit"),
])
def test_cross_field_checks(override, needle):
    with pytest.raises(ValueError, match=needle):
        load_config(None, [override])


def test_missing_recipe_and_malformed_yaml(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(write(tmp_path, "trainer: {output_dir: [\n"))


def test_config_is_frozen():
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trainer.total_steps = 3


def test_cli_config_prints_resolved_recipe(tmp_path, capsys):
    from rlep_megatron.cli import main

    assert main(["config", "--no-files", "--config", write(tmp_path, RECIPE),
                 "trainer.seed=9"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["seed"] == 9 and printed["replay"]["num_replays_per_prompt"] == 2
    assert main(["config", "trainer.sed=9"]) == 2
    assert "trainer.seed" in capsys.readouterr().err


def test_every_key_is_documented_and_the_committed_reference_is_current():
    import os

    reference = config_lib.config_reference()
    for section, cls in config_lib._section_types().items():
        docs = config_lib._field_docs(cls)
        for field in dataclasses.fields(cls):
            assert docs.get(field.name), f"{section}.{field.name} has no docstring"
            assert f"`{section}.{field.name}`" in reference
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "CONFIG.md")
    with open(path) as f:
        assert f.read() == reference + "\n", (
            "docs/CONFIG.md is stale: regenerate it with `rlep config --reference > "
            "docs/CONFIG.md`")


@pytest.fixture
def runnable(tmp_path, tiny_qwen2_dir):
    """Overrides of a recipe whose model and files exist (4 attention heads, 2 KV heads)."""
    from rlep_megatron.tiny_task import make_tiny_task

    task = make_tiny_task(str(tmp_path / "task"), seed=0, num_train=4, num_val=2)
    return [f"model.hf_dir={tiny_qwen2_dir}", f"data.train_files=[{task['train']}]",
            f"data.val_files=[{task['val']}]", "data.max_prompt_tokens=128",
            "rollout.max_response_tokens=256",  # within the model's 2048 positions
            "data.train_batch_size=4"]  # the 4 training rows are one batch


MISTAKES = [  # (override, what the one line must say)
    ("parallel.tensor_model_parallel_size=3", "does not divide the number of attention heads (4)"),
    ("parallel.tensor_model_parallel_size=4", "does not divide the number of query groups"),
    ("parallel.pipeline_model_parallel_size=3", "num_layers=4 is not divisible"),
    ("rollout.tensor_model_parallel_size=3", "does not divide the model's 4 attention heads"),
    ("model.hf_dir=", "model.hf_dir is required"),
    ("model.hf_dir=/nonexistent/model", "has no config.json (is not a directory)"),
    ("rollout.gpu_memory_utilization=1.5", "gpu_memory_utilization is a fraction"),
    ("rollout.weight_sync_bucket_bytes=-1", "weight_sync_bucket_bytes must be >= 1"),
    ("trainer.validation_interval_steps=-3", "validation_interval_steps must be >= 0"),
    ("checkpoint.resume=latest", "checkpoint.resume='latest' is neither auto, never nor"),
    ("data.train_files=a,b", "looks like a comma-separated list; write a YAML list: "
                             "data.train_files=[a,b]"),
    ("data.train_files=[]", "data.train_files is empty"),
    ("data.val_files=[missing.parquet]", "data.val_files: 'missing.parquet' does not exist"),
    ("trainer.lr=1e-6", "unknown config key 'trainer.lr': did you mean lora.lr or optim.lr?"),
    ("actor.optim.lr=1e-6", "did you mean lora.lr or optim.lr?"),
    ("lr=1e-6", "did you mean lora.lr or optim.lr?"),
    ("rollout.n=8", "did you mean rollout.num_samples_per_prompt?"),
    ("trainer.totl_steps=3", "did you mean trainer.total_steps"),
    # verl's names in the configuration key map (docs/configuration.md)
    ("trainer.resume_mode=auto", "did you mean checkpoint.resume?"),
    ("algorithm.filter_groups.enable=true", "did you mean algo.dynamic_sampling?"),
    ("algorithm.filter_groups.max_num_gen_batches=5", "did you mean algo.max_generation_rounds?"),
    ("rollout.max_response_tokens=2000", "max_prompt_tokens + rollout.max_response_tokens = "
                                         "2128 is more than the model's max_position_embeddings "
                                         "(2048)"),
    ("model.hf_dir={other_arch}", "model_type 'gpt2' is not supported; supported: ['llama', "
                                  "'qwen2', 'qwen3', 'qwen3_moe']"),
    ("parallel.expert_model_parallel_size=2", "expert_model_parallel_size=2 needs a "
                                              "mixture-of-experts model; this one is dense"),
    ("algo.routing_replay=actor", "algo.routing_replay=actor needs a mixture-of-experts model"),
    ("algo.routing_replay=rollout", "algo.routing_replay=rollout needs a mixture-of-experts"),
]


@pytest.mark.parametrize("override,message", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_rlep_config_catches_each_mistake_in_one_line(runnable, override, message, capsys,
                                                     tmp_path):
    from rlep_megatron.cli import main

    assert main(["config", *runnable]) == 0  # the same recipe without the mistake is fine
    capsys.readouterr()
    if "{other_arch}" in override:
        other = tmp_path / "gpt2"
        other.mkdir()
        (other / "config.json").write_text('{"model_type": "gpt2", "num_attention_heads": 4, '
                                           '"num_hidden_layers": 2}')
        override = override.format(other_arch=other)
    assert main(["config", *runnable, override]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err  # printed once, on one line
    assert message in lines[0], err
    assert "config.valid_keys" not in err and err.count("trainer.") < 8  # no key dump


def test_engine_routing_replay_is_checked_for_a_gpu_engine(tmp_path, tiny_qwen3_moe_dir,
                                                           monkeypatch, capsys):
    """routing_replay=rollout on a GPU: accepted (the engine is then built on vLLM's V1 runner,
    eagerly), refused in one line when the environment asks for the V2 runner."""
    from rlep_megatron import checks
    from rlep_megatron.cli import main
    from rlep_megatron.tiny_task import make_tiny_task

    task = make_tiny_task(str(tmp_path / "task"), seed=0, num_train=4, num_val=2)
    moe = [f"model.hf_dir={tiny_qwen3_moe_dir}", f"data.train_files=[{task['train']}]",
           f"data.val_files=[{task['val']}]", "data.max_prompt_tokens=128",
           "rollout.max_response_tokens=256", "algo.routing_replay=rollout",
           "data.train_batch_size=4"]
    monkeypatch.setattr(checks, "_gpu_engine", lambda: True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert main(["config", *moe]) == 0
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    capsys.readouterr()
    assert main(["config", *moe]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "VLLM_USE_V2_MODEL_RUNNER=1 asks for V2" in lines[0], lines


def test_rlep_config_lists_every_problem_once(runnable, capsys):
    from rlep_megatron.cli import main

    assert main(["config", *runnable, "parallel.tensor_model_parallel_size=3",
                 "checkpoint.resume=latest", "data.val_files=[missing.parquet]"]) == 2
    err = capsys.readouterr().err
    assert "3 problems in the configuration" in err
    for needle in ("attention heads", "checkpoint.resume='latest'", "missing.parquet"):
        assert err.count(needle) == 1, err


def _preflight_case(case: str, tmp_path) -> tuple[list[str], list[str], str]:
    """(the overrides that break it, those of its clean counterpart, what the error says) for
    each check of the data that ``rlep config`` shares with ``rlep train``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlep_megatron.data.schema import read_prompt_file
    from rlep_megatron.replay.writer import pool_rows, write_pool
    from rlep_megatron.tiny_task import make_tiny_task

    task = make_tiny_task(str(tmp_path / "task"), seed=0, num_train=4, num_val=2)
    if case == "missing column":
        table = pq.read_table(task["train"])
        bad = tmp_path / "no_reward_model.parquet"
        pq.write_table(table.drop(["reward_model"]), bad)
        return ([f"data.train_files=[{bad}]"], [], f"{bad}: missing column 'reward_model'")
    if case == "unknown data_source":
        table = pq.read_table(task["val"])
        bad = tmp_path / "quiz.parquet"
        pq.write_table(table.set_column(table.schema.get_field_index("data_source"),
                                        "data_source", pa.array(["my_quiz"] * table.num_rows)),
                       bad)
        return ([f"data.val_files=[{bad}]"], [],
                "data.val_files: no reward rule for data_source 'my_quiz'")
    if case == "reward function fails on a sample":
        module = tmp_path / "reward.py"
        module.write_text("def bad(data_source, solution_str, ground_truth):\n"
                          "    return solution_str['score']\n"
                          "def good(data_source, solution_str, ground_truth):\n"
                          "    return float(solution_str.strip() == str(ground_truth))\n")
        return ([f"reward.function={module}:bad"], [f"reward.function={module}:good"],
                f"reward.function='{module}:bad' failed on a sample of data.train_files")
    if case == "pool shares no question":
        def pool_of(rows, path):
            write_pool(pool_rows(rows, [[f"Answer: {t}"] for t in rows.ground_truth]), path)
            return path
        other = make_tiny_task(str(tmp_path / "other"), seed=5, num_train=8, num_val=2,
                               max_operand=300)
        foreign = pool_of(read_prompt_file(other["train"]), str(tmp_path / "foreign.parquet"))
        own = pool_of(read_prompt_file(task["train"]), str(tmp_path / "own.parquet"))
        replay = ["replay.num_replays_per_prompt=1"]
        return ([*replay, f"replay.pool_files=[{foreign}]"],
                [*replay, f"replay.pool_files=[{own}]"],
                "none of them is a question of the training files")
    if case == "dataset smaller than one batch":
        return (["data.train_batch_size=8"], ["data.train_batch_size=4"],
                "the dataset has 4 rows, fewer than one batch of data.train_batch_size=8")
    if case == "mixing weight names no source":
        files = [f"data.train_files=[{task['train']}]"]
        return ([*files, "data.train_weights={tiny_arith: 1, tiny_algebra: 2}"],
                [*files, "data.train_weights={tiny_arith: 1}"],
                "data.train_weights: 'tiny_algebra' is neither a file of data.train_files")
    if case == "logger not installed":
        return (["trainer.loggers=[tensorboard,wandb]"], ["trainer.loggers=[tensorboard]"],
                "trainer.loggers includes wandb but the wandb package is not installed")
    raise KeyError(case)


PREFLIGHT = ["missing column", "unknown data_source", "reward function fails on a sample",
             "pool shares no question", "dataset smaller than one batch",
             "mixing weight names no source", "logger not installed"]


@pytest.mark.parametrize("case", PREFLIGHT)
def test_rlep_config_runs_the_jobs_data_checks(case, runnable, capsys, tmp_path, monkeypatch):
    """What docs/quickstart.md promises of the pre-flight: each problem that ``rlep train``
    would meet in its data before building anything is an error of ``rlep config`` too (exit
    2, naming the file and the problem), and its clean counterpart passes."""
    import importlib.util

    from rlep_megatron.cli import main

    if case == "logger not installed":
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "wandb" else real(name, *a))
    bad, clean, message = _preflight_case(case, tmp_path)
    assert main(["config", *runnable, *clean]) == 0
    capsys.readouterr()
    assert main(["config", *runnable, *bad]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_init_fits_the_batch_to_a_small_dataset_and_runs_the_preflight(tmp_path, tiny_qwen2_dir,
                                                                     capsys):
    """``rlep init`` on a file smaller than its template's batch writes a recipe of one batch
    of all its rows (said in a note), which the pre-flight then accepts; a file the pre-flight
    refuses makes init fail naming it, and nothing is written."""
    import yaml
    import pyarrow.parquet as pq

    from rlep_megatron.cli import main
    from rlep_megatron.tiny_task import make_tiny_task

    task = make_tiny_task(str(tmp_path / "task"), seed=0, num_train=4, num_val=2)
    recipe = str(tmp_path / "r.yaml")
    assert main(["init", recipe, "--model", tiny_qwen2_dir, "--train", task["train"]]) == 0
    out = capsys.readouterr().out
    raw = yaml.safe_load(open(recipe))
    assert raw["data"]["train_batch_size"] == 4 and raw["trainer"]["mini_batch_size"] <= 4
    assert "the training files hold 4 rows" in out
    # without --output-dir the run writes under its own name, not the template's directory
    assert raw["trainer"]["output_dir"] == os.path.join("outputs", "r")
    assert main(["config", "--config", recipe]) == 0
    broken = tmp_path / "broken.parquet"
    pq.write_table(pq.read_table(task["train"]).drop(["reward_model"]), broken)
    capsys.readouterr()
    assert main(["init", str(tmp_path / "b.yaml"), "--model", tiny_qwen2_dir, "--train",
                 str(broken)]) == 2
    assert "missing column 'reward_model'" in capsys.readouterr().err
    assert not (tmp_path / "b.yaml").exists()


def test_a_hub_name_resolves_from_the_local_cache_offline(tmp_path, monkeypatch, tiny_qwen2_dir):
    """model.hf_dir (and rlep init --model) as ``org/name``: the snapshot in the local HF cache
    (laid out as huggingface_hub writes it), with no network; a name in no cache is reported by
    the model check with what to do."""
    import shutil

    from huggingface_hub import constants

    from rlep_megatron.checks import check_run_config

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-qwen2"
    shutil.copytree(tiny_qwen2_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local directory of that name
    cfg = config_lib.load_config(None, ["model.hf_dir=tiny-org/tiny-qwen2"])
    assert cfg.model.hf_dir == str(repo / "snapshots" / commit)
    from rlep_megatron.recipe_init import _model_config

    assert _model_config("tiny-org/tiny-qwen2")["model_type"] == "qwen2"  # rlep init --model
    missing = config_lib.load_config(None, ["model.hf_dir=tiny-org/not-cached"])
    assert missing.model.hf_dir == "tiny-org/not-cached"
    with pytest.raises(ValueError, match=r"hf download <name>"):
        check_run_config(missing, "train")


def test_rlep_config_with_a_job_size_gives_the_planners_verdict(runnable, capsys, monkeypatch):
    """`rlep config --nodes N --gpus-per-node G`: the pre-flight and the planner's verdict for
    that size (`rlep plan`'s own figures); exit 2, saying what to run, when it does not fit."""
    from rlep_megatron import plan
    from rlep_megatron.cli import main

    assert main(["config", *runnable, "--gpus-per-node", "1"]) == 0
    err = capsys.readouterr().err
    assert "rlep plan for 1 x 1 GPU(s), an estimate: FITS" in err, err
    real = plan.plan
    seen = {}

    def smaller_gpu(cfg, hf_config, gpus, *args, **kwargs):  # the same plan on a 1 GiB card
        seen["gpus"], seen["per_node"] = gpus, kwargs.get("gpus_per_node")
        return real(cfg, hf_config, gpus, 1.0, gpus_per_node=kwargs.get("gpus_per_node"))
    monkeypatch.setattr(plan, "plan", smaller_gpu)
    assert main(["config", *runnable, "--nodes", "2", "--gpus-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert seen == {"gpus": 4, "per_node": 2}
    assert "DOES NOT FIT" in err and "--nodes 2 --gpus-per-node 2" in err, err
