"""The repository speaks for itself: every document the code, the docs and the recipes cite
exists in it; every `rlep ...` and `tools/...` command line of README.md and docs/ parses with
the real parsers and names only known config keys; every relative link resolves; the Slurm
template of docs/multinode.md runs the torchrun lines `rlep init` prints; the README stays a
front page (its length, its line width, its two commands)."""
import argparse
import os
import re
import runpy
import shlex
import subprocess
import sys

import pytest

from tests.torchrun import REPO_ROOT

pytestmark = pytest.mark.unit

CITED = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.md)\b")


def test_every_cited_document_is_in_the_repository():
    missing = []
    for top in ("rlep_megatron", "docs", "examples", "tools", "bench", "scripts", "tests"):
        for root, _, files in os.walk(os.path.join(REPO_ROOT, top)):
            for name in files:
                if not name.endswith((".py", ".md", ".yaml", ".sh")):
                    continue
                path = os.path.join(root, name)
                for cited in CITED.findall(open(path, encoding="utf-8").read()):
                    if not any(os.path.isfile(os.path.join(base, cited))
                               for base in (REPO_ROOT, os.path.join(REPO_ROOT, "docs"), root)):
                        missing.append(f"{os.path.relpath(path, REPO_ROOT)}: {cited}")
    readme = open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8").read()
    missing += [f"README.md: {c}" for c in CITED.findall(readme)
                if not os.path.isfile(os.path.join(REPO_ROOT, c))]
    assert not missing, missing
    assert os.path.isfile(os.path.join(REPO_ROOT, "LICENSE"))


def test_make_tiny_task_names_the_demos_task():
    """tools/make_tiny_task.py's help gives the flags of the demo's task: they must be demo.TASK."""
    from rlep_megatron.demo import TASK

    with open(os.path.join(REPO_ROOT, "tools", "make_tiny_task.py")) as f:
        doc = f.read().split('"""')[1]
    demo_part = doc.split("The demo's task", 1)[1]
    flags = dict(re.findall(r"--([a-z-]+) (\S+?)(?=[\s`])", demo_part))
    assert {k.replace("-", "_") for k in flags} == set(TASK)
    for key, text in flags.items():
        value = TASK[key.replace("-", "_")]
        assert text == str(value), (key, text, value)


# --------------------------------------------------------------------------------------------
# the user docs: README.md, docs/*.md and the results page they link to
# --------------------------------------------------------------------------------------------

def doc_files() -> list[str]:
    docs = os.path.join(REPO_ROOT, "docs")
    return ([os.path.join(REPO_ROOT, "README.md"), os.path.join(REPO_ROOT, "bench/RESULTS.md")]
            + sorted(os.path.join(docs, n) for n in os.listdir(docs) if n.endswith(".md")))


def read(path: str) -> str:
    return open(path, encoding="utf-8").read()


def code_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)


def command_lines(text: str) -> list[list[str]]:
    """Each shell command of the bash blocks (continuations joined, comments and leading
    ``VAR=value`` assignments dropped), split like the shell does; ``a && b`` gives two."""
    commands = []
    for language, body in code_blocks(text):
        if language not in ("bash", "sh"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # an unbalanced quote: a multi-line shell construct
                continue
            command: list[str] = []
            for word in words + ["&&"]:
                if word in ("&&", "||", ";", "|"):
                    while command and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", command[0]):
                        command.pop(0)
                    if command:
                        commands.append(command)
                    command = []
                else:
                    command.append(word)
    return commands


def rlep_args(command: list[str]) -> list[str] | None:
    """The arguments of an `rlep` command line (``rlep``, ``.venv/bin/rlep``, ``python -m
    rlep_megatron.cli``, torchrun ``-m rlep_megatron.cli``), else None."""
    if os.path.basename(command[0]) == "rlep":
        return command[1:]
    if "-m" in command and "rlep_megatron.cli" in command:
        return command[command.index("rlep_megatron.cli") + 1:]
    return None


def tool_args(command: list[str]) -> tuple[str, list[str]] | None:
    """``(tool path, arguments)`` of a ``[python|torchrun ...] tools/X.py ...`` line."""
    for i, word in enumerate(command):
        if word.startswith("tools/") and word.endswith(".py"):
            return word, command[i + 1:]
    return None


def all_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in doc_files():
        found += [(os.path.relpath(path, REPO_ROOT), c) for c in command_lines(read(path))]
    return found


def overrides_of(args: list[str]) -> list[str]:
    return [a for a in args if re.fullmatch(r"[a-z_]+\.[a-z_0-9]+=.*", a)]


def test_every_rlep_command_in_the_docs_parses_and_names_known_keys():
    from rlep_megatron.cli import build_parser
    from rlep_megatron.config import valid_keys

    keys = set(valid_keys())
    checked, problems = 0, []
    for where, command in all_commands():
        args = rlep_args(command)
        if args is None:
            continue
        checked += 1
        try:
            build_parser().parse_args(args)
        except SystemExit:
            problems.append(f"{where}: does not parse: {shlex.join(command)}")
        for override in overrides_of(args):
            if override.split("=", 1)[0] not in keys:
                problems.append(f"{where}: unknown key in {override}")
    assert not problems, "\n".join(problems)
    assert checked >= 25, checked


def test_every_inline_rlep_command_and_override_in_the_docs_is_known():
    """Inline code in the prose: `rlep <sub> --flag ...` names a subcommand and its flags (values
    may be placeholders there), and every `section.key=value` names a known key."""
    from rlep_megatron.cli import build_parser
    from rlep_megatron.config import valid_keys

    keys = set(valid_keys())
    parser = build_parser()
    subcommands = next(a for a in parser._actions
                       if isinstance(a, argparse._SubParsersAction)).choices
    problems = []
    for path in doc_files():
        text = re.sub(r"^```.*?^```", "", read(path), flags=re.M | re.S)
        where = os.path.relpath(path, REPO_ROOT)
        for span in re.findall(r"`([^`\n]+)`", text):
            for key in re.findall(r"(?<![\w.])([a-z_]+\.[a-z_0-9]+)=", span):
                if key not in keys and key != "section.key":
                    problems.append(f"{where}: unknown key {key} in `{span}`")
            words = span.split()
            if (len(words) < 2 or words[0] not in ("rlep", ".venv/bin/rlep")
                    or words[1].startswith("-")):
                continue
            if words[1] not in subcommands:
                problems.append(f"{where}: no subcommand in `{span}`")
                continue
            known = set(subcommands[words[1]]._option_string_actions)
            problems += [f"{where}: unknown flag {w} in `{span}`" for w in words[2:]
                         if w.startswith("--") and w.split("=")[0] not in known]
    assert not problems, "\n".join(problems)


class _Parsed(Exception):
    pass


def test_every_tools_command_in_the_docs_parses(monkeypatch):
    """Each tool's own argparse parser, stopped right after it parsed the documented line."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        original(parser, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    checked, problems = 0, []
    for where, command in all_commands():
        tool = tool_args(command)
        if tool is None:
            continue
        path, args = tool
        checked += 1
        monkeypatch.setattr(sys, "argv", [path, *args])
        try:
            runpy.run_path(os.path.join(REPO_ROOT, path), run_name="__main__")
        except _Parsed:
            pass
        except SystemExit:
            problems.append(f"{where}: does not parse: {shlex.join(command)}")
    assert not problems, "\n".join(problems)
    assert checked >= 6, checked


def test_every_hf_download_line_in_the_docs_parses_as_a_dry_run(tmp_path):
    """The download lines of docs/recipes.md, run as written with ``--dry-run`` and the hub
    offline (these machines have no internet): the ``hf`` command accepts every argument and
    gets as far as asking the hub (exit 1, "offline mode"), where a wrong argument would stop
    at its usage error (exit 2)."""
    import shutil
    import sys

    hf = shutil.which("hf", path=os.path.dirname(sys.executable)) or shutil.which("hf")
    assert hf, "huggingface_hub's hf command is not installed"
    lines = [(path, c) for path, c in all_commands() if c[:2] == ["hf", "download"]]
    assert len(lines) >= 3, lines
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    for path, command in lines:
        proc = subprocess.run([hf, *command[1:], "--dry-run"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 1 and "offline mode" in output, (path, command, output[-2000:])


def test_every_checkpoint_a_docs_command_reads_is_one_its_recipe_keeps():
    """A `collect.checkpoint=` / `eval.checkpoint=` of a recipe's own run in the docs (the
    paper's pool from the baseline's step 400, its evaluation of RLEP at step 320) names a
    step that the recipe saves (every checkpoint.save_interval_steps, and the last) and keeps
    (the newest checkpoint.keep_last)."""
    from rlep_megatron.config import load_config

    checked = 0
    for path, command in all_commands():
        args = rlep_args(command) or (command[command.index("scripts/train_multinode.sh") + 1:]
                                      if "scripts/train_multinode.sh" in command else None)
        if not args:
            continue
        recipe = next((a for a in args if a.startswith("examples/") and a.endswith(".yaml")),
                      None)
        for arg in args:
            found = re.fullmatch(r"(collect|eval)\.checkpoint=(\S+)/checkpoints/step_(\d+)", arg)
            if not found or recipe is None:
                continue
            cfg = load_config(os.path.join(REPO_ROOT, recipe))
            if found.group(2) != cfg.trainer.output_dir:  # another recipe's run
                others = [n for n in os.listdir(os.path.join(REPO_ROOT, "examples"))
                          if n.endswith(".yaml") and load_config(os.path.join(
                              REPO_ROOT, "examples", n)).trainer.output_dir == found.group(2)]
                assert len(others) == 1, (path, arg, others)
                cfg = load_config(os.path.join(REPO_ROOT, "examples", others[0]))
            every, total = cfg.checkpoint.save_interval_steps, cfg.trainer.total_steps
            saved = sorted({*range(every, total + 1, every), total})
            kept = saved[-cfg.checkpoint.keep_last:]
            assert int(found.group(3)) in kept, (path, arg, kept)
            checked += 1
    assert checked >= 2, checked  # the pool's and the evaluation's


def test_every_relative_link_resolves():
    missing = []
    for path in doc_files():
        text = re.sub(r"^```.*?^```", "", read(path), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            file_part = target.split("#", 1)[0]
            if not os.path.exists(os.path.join(os.path.dirname(path), file_part)):
                missing.append(f"{os.path.relpath(path, REPO_ROOT)}: {target}")
    assert not missing, missing


def test_readme_is_a_front_page_with_its_two_commands_first():
    text = read(os.path.join(REPO_ROOT, "README.md"))
    lines = text.splitlines()
    assert len(lines) <= 300, len(lines)
    assert not [n for n, line in enumerate(lines, 1) if len(line) > 200]
    blocks = [body.strip() for language, body in code_blocks(text) if language == "bash"]
    test_command = 'bash scripts/setup.sh && .venv/bin/python -m pytest -m "not gpu"'
    assert blocks[:2] == ["bash scripts/setup.sh && .venv/bin/rlep demo", test_command]
    # CI runs the README's test command verbatim
    assert test_command in read(os.path.join(REPO_ROOT, ".ci", "run"))


def test_the_readme_lists_say_where_each_feature_and_model_has_run():
    """Each Features bullet ends with its mark (`[CPU]`, or `[CPU; 1 GPU: ...]`), and each
    Supported-models row says what ran on a GPU so far: no feature reads as GPU-verified
    without saying so."""
    text = read(os.path.join(REPO_ROOT, "README.md"))
    features = text.split("## Features\n", 1)[1].split("\n## ", 1)[0]
    bullets = ["- " + b for b in features.split("\n- ")[1:]]
    assert len(bullets) >= 5
    for bullet in bullets:
        assert re.search(r"`\[CPU(; 1 GPU: [^`]+)?\]`\s*$", bullet.strip()), bullet
    models = text.split("## Supported models\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in models.splitlines() if line.startswith("| ")]
    assert rows[0].rstrip(" |").endswith("GPU so far")
    assert all(row.count("|") == rows[0].count("|") and row.split("|")[-2].strip()
               for row in rows[2:])


def test_the_demo_paragraph_gives_a_range_and_says_what_the_demo_is_for():
    text = read(os.path.join(REPO_ROOT, "README.md"))
    demo = text.split("## Quickstart 1: the tiny demo", 1)[1].split("\n## ", 1)[0]
    assert "pipeline check" in demo and "cannot" in demo
    assert re.search(r"from -\d+\.\d to \+\d+\.\d points", demo)
    assert "AMD EPYC" in demo and "Intel Xeon" in demo


def test_the_key_map_names_only_our_keys():
    from rlep_megatron.config import valid_keys

    text = read(os.path.join(REPO_ROOT, "docs", "configuration.md"))
    rows = [line.split("|") for line in text.split("| verl | NeMo-RL | rlep |", 1)[1].splitlines()
            if line.startswith("| `")]
    ours = [k for row in rows for k in re.findall(r"`([a-z_]+\.[a-z_0-9]+)", row[3])]
    assert len(rows) >= 30 and len(ours) >= 30
    assert set(ours) <= set(valid_keys()), set(ours) - set(valid_keys())


def test_configuration_pages_have_an_index_and_short_lines():
    for name in ("CONFIG.md", "configuration.md"):
        lines = read(os.path.join(REPO_ROOT, "docs", name)).splitlines()
        assert not [n for n, line in enumerate(lines, 1) if len(line) > 200], name
    reference = read(os.path.join(REPO_ROOT, "docs", "CONFIG.md"))
    assert "- [trainer](#trainer)" in reference.split("\n## ", 1)[0]


# --------------------------------------------------------------------------------------------
# docs/multinode.md's Slurm template against `rlep init --nodes 2`
# --------------------------------------------------------------------------------------------

FAKE_SRUN = """#!/bin/bash
# srun with one task per node: the command once per node, SLURM_NODEID set as Slurm does
while [[ "$1" == -* ]]; do shift; done
for (( node = 0; node < SLURM_NNODES; node++ )); do SLURM_NODEID=$node "$@"; done
"""


# an interpreter that shows the torchrun command the launcher runs, and runs anything else
FAKE_PYTHON = """#!/bin/bash
if [ "$1 $2" = "-m torch.distributed.run" ]; then shift 2; echo torchrun "$@"; exit 0; fi
exec python3 "$@"
"""


def test_the_slurm_template_runs_the_launcher_lines_rlep_init_prints(tmp_path, tiny_qwen2_dir,
                                                                      capsys):
    """One launcher: the Slurm template of docs/multinode.md and the lines `rlep init --nodes 2
    --gpus-per-node 8` prints run scripts/train_multinode.sh, and for each node end in the
    same torchrun command (rendered by bash, with stand-ins for Slurm and the interpreter)."""
    from rlep_megatron.cli import main
    from rlep_megatron.data.prepare import convert_jsonl

    text = read(os.path.join(REPO_ROOT, "docs", "multinode.md"))
    template = text.split("<!-- slurm-template -->", 1)[1].split("```bash\n", 1)[1]
    template = template.split("```", 1)[0]
    assert "#SBATCH --nodes=2" in template and "GPUS_PER_NODE=8" in template

    # what `rlep init --nodes 2 --gpus-per-node 8` prints for node 0 and node 1
    source = tmp_path / "train.jsonl"  # one batch of the multi-node template (512 rows)
    source.write_text("".join(f'{{"problem": "{i} + 1?", "answer": "{i + 1}"}}\n'
                              for i in range(512)))
    convert_jsonl(str(source), str(tmp_path / "train.parquet"), "math_dapo")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["init", "my_run.yaml", "--model", tiny_qwen2_dir, "--train",
                     "train.parquet", "--nodes", "2", "--gpus-per-node", "8"]) == 0
    finally:
        os.chdir(cwd)
    printed = [line.split(":", 1)[1].strip() for line in capsys.readouterr().out.splitlines()
               if re.match(r"\s+node \d+: ", line)]
    assert len(printed) == 2 and all("scripts/train_multinode.sh my_run.yaml" in line
                                     for line in printed), printed

    # run from a checkout (its scripts/), with stand-ins for Slurm and the interpreter
    os.symlink(os.path.join(REPO_ROOT, "scripts"), tmp_path / "scripts")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {"srun": FAKE_SRUN, "python": FAKE_PYTHON,
                 "scontrol": "#!/bin/bash\necho node-0\necho node-1\n"}
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
           "HOME": str(tmp_path)}

    def torchrun(script: str, **extra) -> list[list[str]]:
        proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env={**env, **extra},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return [shlex.split(line) for line in proc.stdout.splitlines()
                if line.startswith("torchrun ")]

    rendered = torchrun(template, SLURM_NNODES="2", SLURM_JOB_NODELIST="node-[0-1]",
                        JOB="train", RECIPE="my_run.yaml")
    by_init = [command for line in printed for command in torchrun(line, MASTER_ADDR="node-0")]
    assert len(rendered) == 2 and rendered == by_init
    for rank, command in enumerate(rendered):
        assert command[:5] == ["torchrun", "--nnodes", "2", "--node-rank", str(rank)]
        assert f"is_host={int(rank == 0)}" in command and "node-0:29500" in command
        assert command[-4:] == ["rlep_megatron.cli", "train", "--config", "my_run.yaml"]
    # the other jobs: JOB in front of the same line
    collect = torchrun(f"JOB=collect {printed[1]} collect.checkpoint=c", MASTER_ADDR="node-0")
    assert collect[0][-4:] == ["collect", "--config", "my_run.yaml", "collect.checkpoint=c"]
    assert collect[0][:5] == rendered[1][:5]
