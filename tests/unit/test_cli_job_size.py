"""The job's size is spelled alike in `rlep init` and `rlep plan` (``--nodes`` x
``--gpus-per-node``), the old ``--gpus`` (two meanings) is refused, and a config key that looks
like a GPU count says that torchrun sets it."""
import re

import pytest

from rlep_megatron import config as config_lib
from rlep_megatron.cli import main

pytestmark = pytest.mark.unit


def test_init_and_plan_agree_on_the_world_size(monkeypatch, capsys):
    from rlep_megatron import plan, recipe_init

    seen = {}

    def fake_write_recipe(path, model, train, val, gpus, nodes, **_):
        seen["init"] = gpus * nodes
        print(recipe_init.launcher_lines(path, gpus, nodes)[0])

    def fake_plan(cfg, hf_config, gpus, *args, **kwargs):
        seen["plan"] = gpus
        return {}

    monkeypatch.setattr(recipe_init, "write_recipe", fake_write_recipe)
    monkeypatch.setattr(plan, "load_model_config", lambda cfg, path: {})
    monkeypatch.setattr(plan, "plan", fake_plan)
    monkeypatch.setattr(plan, "format_plan", lambda result: "")
    size = ["--nodes", "4", "--gpus-per-node", "8"]
    assert main(["init", "r.yaml", "--model", "m", "--train", "t.parquet", *size]) == 0
    assert main(["plan", *size]) == 0
    assert seen == {"init": 32, "plan": 32}
    # node 0's launcher line: 8 ranks on each of 4 nodes
    line = capsys.readouterr().out
    assert "NNODES=4 NODE_RANK=0 MASTER_ADDR=$MASTER_ADDR GPUS_PER_NODE=8 " in line
    # both default to one GPU
    assert main(["plan"]) == 0 and seen["plan"] == 1


@pytest.mark.parametrize("command", [["plan"], ["init", "r.yaml", "--model", "m", "--train", "t"]])
def test_the_old_gpus_flag_is_refused_with_the_new_spelling(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--gpus", "8"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--nodes" in err and "--gpus-per-node" in err


def test_launcher_lines_of_one_and_several_nodes():
    from rlep_megatron.recipe_init import launcher_lines

    lines = launcher_lines("r.yaml", 8, 2, job="collect", rollout_nodes=1)
    assert lines == [
        "JOB=collect NNODES=2 NODE_RANK=0 MASTER_ADDR=$MASTER_ADDR GPUS_PER_NODE=8 "
        "NODE_ROLE=train scripts/train_multinode.sh r.yaml",
        "JOB=collect NNODES=2 NODE_RANK=1 MASTER_ADDR=$MASTER_ADDR GPUS_PER_NODE=8 "
        "NODE_ROLE=rollout scripts/train_multinode.sh r.yaml"]
    assert launcher_lines("r.yaml", 8, 1) == ["scripts/train_local.sh 8 r.yaml"]


@pytest.mark.parametrize("key", ["trainer.n_gpus_per_node", "trainer.nnodes", "trainer.n_gpus",
                                 "parallel.world_size", "cluster.gpus_per_node"])
def test_a_gpu_count_key_says_torchrun_sets_it(key):
    with pytest.raises(ValueError) as err:
        config_lib.load_config(None, [f"{key}=8"])
    message = str(err.value)
    assert key in message and "torchrun" in message and "--gpus-per-node" in message
    # not the generic suggestion of a near spelling
    assert "did you mean" not in message


def test_a_gpu_count_key_in_a_recipe_file_and_a_dotted_override(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  nnodes: 2\n")
    with pytest.raises(ValueError, match=re.escape("'trainer.nnodes' looks like a GPU or node")):
        config_lib.load_config(str(recipe))
    with pytest.raises(ValueError, match="torchrun"):
        config_lib.load_config(None, ["actor_rollout_ref.trainer.n_gpus_per_node=8"])
    # an ordinary unknown key keeps its suggestion
    with pytest.raises(ValueError, match="did you mean trainer.seed"):
        config_lib.load_config(None, ["trainer.sed=1"])
