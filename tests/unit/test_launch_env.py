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
