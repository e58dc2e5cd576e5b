"""scripts/_launch_env.sh, which the launch scripts source: where TransformerEngine is
installed it points NVTE_CUDA_INCLUDE_DIR at the CUDA headers of torch's CUDA wheels."""
import os
import subprocess
import sys

from tests.torchrun import REPO_ROOT


def launch_env(site, **env) -> str:
    """NVTE_CUDA_INCLUDE_DIR after sourcing the script with ``site`` importable."""
    script = os.path.join(REPO_ROOT, "scripts", "_launch_env.sh")
    variables = {k: v for k, v in os.environ.items() if k != "NVTE_CUDA_INCLUDE_DIR"}
    variables.update(PYTHON=sys.executable, PYTHONPATH=str(site), **env)
    out = subprocess.run(["bash", "-c", f'source "{script}"; echo "[$NVTE_CUDA_INCLUDE_DIR]"'],
                         env=variables, capture_output=True, text=True, check=True)
    return out.stdout.strip()[1:-1]


def fake_site(tmp_path, with_te: bool):
    site = tmp_path / ("te" if with_te else "plain")
    include = site / "nvidia" / "cu13" / "include"
    include.mkdir(parents=True)
    (include / "cuda_runtime.h").write_text("")
    if with_te:
        (site / "transformer_engine").mkdir()
        (site / "transformer_engine" / "__init__.py").write_text("")
    return site, str(include)


def test_te_gets_the_cuda_headers_of_the_cu13_wheels(tmp_path):
    site, include = fake_site(tmp_path, with_te=True)
    assert launch_env(site) == include
    # a value the user set is kept
    assert launch_env(site, NVTE_CUDA_INCLUDE_DIR="/opt/cuda/include") == "/opt/cuda/include"
    # without TE nothing is set
    plain, _ = fake_site(tmp_path, with_te=False)
    assert launch_env(plain) == ""


def multinode(tmp_path, **env) -> subprocess.CompletedProcess:
    """scripts/train_multinode.sh with a stand-in interpreter that prints what it was given."""
    python = tmp_path / "python"
    python.write_text('#!/usr/bin/env bash\necho "ARGS $*"\n')
    python.chmod(0o755)
    script = os.path.join(REPO_ROOT, "scripts", "train_multinode.sh")
    variables = dict(os.environ, PYTHON=str(python), NNODES="2", NODE_RANK="1",
                     MASTER_ADDR="127.0.0.1", NODE_ADDR="10.0.0.2", **env)
    return subprocess.run(["bash", script, "r.yaml", "collect.checkpoint=c"], env=variables,
                          capture_output=True, text=True)


def test_the_multinode_launcher_runs_every_job(tmp_path):
    """JOB picks the rlep job (train by default); anything else is refused before torchrun."""
    for job, expected in ((None, "train"), ("collect", "collect"), ("eval", "eval")):
        proc = multinode(tmp_path, **({"JOB": job} if job else {}))
        assert proc.returncode == 0, proc.stderr
        launched = [line for line in proc.stdout.splitlines() if line.startswith("ARGS ")][-1]
        assert launched.endswith(f"-m rlep_megatron.cli {expected} --config r.yaml "
                                 "collect.checkpoint=c"), launched
        assert "--nnodes 2 --node-rank 1" in launched and "--local-addr 10.0.0.2" in launched
    proc = multinode(tmp_path, JOB="serve")
    assert proc.returncode == 2 and "JOB=serve: the job is train, collect or eval" in proc.stderr


def test_one_node_is_torchrun_standalone_and_train_local_is_the_same_launcher(tmp_path):
    """NNODES=1 (the default): no address needed, torchrun --standalone;
    scripts/train_local.sh NPROC runs the launcher with one node of NPROC ranks, any JOB."""
    python = tmp_path / "python"
    python.write_text('#!/usr/bin/env bash\necho "ARGS $*"\n')
    python.chmod(0o755)
    variables = {k: v for k, v in os.environ.items()
                 if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "JOB")}
    variables["PYTHON"] = str(python)
    expected = ("ARGS -m torch.distributed.run --standalone --nproc-per-node 2 "
                "-m rlep_megatron.cli {job} --config r.yaml a.b=1")
    for script, args, extra in (("train_multinode.sh", [], {"GPUS_PER_NODE": "2"}),
                                ("train_local.sh", ["2"], {})):
        for job in ("train", "eval"):
            proc = subprocess.run(["bash", os.path.join(REPO_ROOT, "scripts", script), *args,
                                   "r.yaml", "a.b=1"], env={**variables, **extra, "JOB": job},
                                  capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout.splitlines()[-1] == expected.format(job=job), proc.stdout
