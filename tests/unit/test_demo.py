"""``rlep demo``'s report: curves across seeds, best/final spread, steps to the baseline's best,
worked by hand on small curves."""
import json
import statistics

import pytest

from rlep_megatron.demo import band, comparison_table, plot_comparison, read_curves, summarise_arm
from tests import bench_module

pytestmark = pytest.mark.unit


def run(val, train, step_s=1.0, opt_steps=8):
    # every validation adds 0.5 s to its step's all-included time
    return {"val": dict(val), "train": dict(train), "step_s": {s: step_s for s in train},
            "all_s": {s: step_s * (s in train) + 0.5 * (s in val) for s in set(train) | set(val)},
            "opt_steps": {s: opt_steps for s in train}}


BASELINE = [run({0: 0.30, 4: 0.50, 8: 0.60}, {1: 0.3, 2: 0.4}, 1.0),
            run({0: 0.32, 4: 0.40, 8: 0.56}, {1: 0.5, 2: 0.6}, 2.0)]
RLEP = [run({0: 0.30, 4: 0.58, 8: 0.62}, {1: 0.4, 2: 0.5}, opt_steps=9),
        run({0: 0.32, 4: 0.60, 8: 0.50}, {1: 0.6, 2: 0.7}, opt_steps=9)]


def test_band_is_mean_min_max_over_seeds_on_shared_steps():
    got = band([{0: 0.2, 4: 0.6}, {0: 0.4, 4: 0.2, 8: 0.9}])
    assert list(got) == [0, 4]  # step 8 is missing from one seed
    assert got[0] == pytest.approx((0.3, 0.2, 0.4))
    assert got[4] == pytest.approx((0.4, 0.2, 0.6))


def test_arm_summaries_and_steps_to_the_baseline_best():
    base = summarise_arm(BASELINE, None)
    # mean curve 0.31, 0.45, 0.58: best mean 0.58 at step 8; per-seed bests 0.60 and 0.56
    assert base["best_mean_val"] == pytest.approx(0.58) and base["best_mean_step"] == 8
    assert base["best_val"]["values"] == [0.60, 0.56]
    assert base["best_val"]["mean"] == pytest.approx(0.58)
    assert base["best_val"]["sd"] == pytest.approx(0.028284271, rel=1e-6)
    assert base["final_val"]["values"] == [0.60, 0.56]
    assert base["start_val"]["min"] == 0.30 and base["start_val"]["max"] == 0.32
    assert base["steps_to_target"] == 8
    assert base["step_s"]["mean"] == pytest.approx(1.5)
    # per training step (2 of them): 2 x step_s + 3 validations x 0.5 s
    assert base["all_s"]["values"] == pytest.approx([(2 * 1.0 + 1.5) / 2, (2 * 2.0 + 1.5) / 2])
    rlep = summarise_arm(RLEP, base["best_mean_val"])
    # mean curve 0.31, 0.59, 0.56: first reaches 0.58 at step 4
    assert rlep["steps_to_target"] == 4
    assert rlep["final_val"]["values"] == [0.62, 0.50]
    assert summarise_arm(RLEP, 0.99)["steps_to_target"] is None


def test_table_and_plot(tmp_path):
    summary = {"k": 8, "baseline": summarise_arm(BASELINE, None)}
    summary["rlep"] = summarise_arm(RLEP, summary["baseline"]["best_mean_val"])
    table = comparison_table(summary)
    assert "over 2 seeds" in table
    assert "best validation mean@8" in table and "58.0% (sd 2.8, 56.0-60.0)" in table
    assert "steps for the mean curve to reach the baseline's peak (58.0%)" in table
    lines = {line.split("  ")[0]: line for line in table.splitlines()}
    reach = lines["steps for the mean curve to reach the baseline's peak (58.0%)"]
    assert reach.split()[-2:] == ["8", "4"]
    assert lines["optimizer steps per training step"].split()[-2:] == ["8.00", "9.00"]
    # a third arm gets its own column, in the order asked
    summary["arm_names"] = ["baseline", "rlep", "online"]
    summary["online"] = summarise_arm(BASELINE, summary["baseline"]["best_mean_val"])
    table = comparison_table(summary)
    assert table.splitlines()[0].split()[-4:] == ["baseline", "RLEP", "online", "replay"]
    plot_comparison(summary, str(tmp_path / "three.png"))
    assert (tmp_path / "three.png").stat().st_size > 10_000
    assert lines["training step alone (s)"].split()[-2:] == ["1.50", "1.00"]
    assert lines["per step with validation and checkpoints (s)"].split()[-2:] == ["2.25", "1.75"]
    plot_comparison(json.loads(json.dumps(summary)), str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_read_curves_from_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    entries = [{"step": 0, "val/a/mean@8": 0.2, "val/b/mean@8": 0.4},
               {"step": 1, "rollout/acc_mean": 0.5, "timing/step_s": 1.5},
               {"step": 2, "rollout/acc_mean": 0.7, "timing/step_s": 2.5, "val/a/mean@8": 0.6,
                "val/b/mean@8": 0.8, "val/a/pass@8": 1.0, "timing/validate_s": 0.25,
                "timing/checkpoint_s": 0.125}]
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    curves = read_curves(str(path))
    assert curves["val"] == pytest.approx({0: 0.3, 2: 0.7})
    assert curves["train"] == {1: 0.5, 2: 0.7}
    assert curves["step_s"] == {1: 1.5, 2: 2.5}
    assert curves["all_s"] == {0: 0.0, 1: 1.5, 2: 2.875}


def test_a_demo_directory_from_other_settings_is_refused(tmp_path):
    from rlep_megatron.demo import SETTINGS_FILE, _check_settings

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _check_settings(str(fresh), 0)  # empty: the settings are recorded
    _check_settings(str(fresh), 0)  # same settings: continued
    assert (fresh / SETTINGS_FILE).is_file()
    with pytest.raises(FileExistsError, match="--warm-start-seed"):
        _check_settings(str(fresh), 1)
    old = tmp_path / "old"
    (old / "model").mkdir(parents=True)  # an older demo's directory has no settings file
    with pytest.raises(FileExistsError, match="other settings"):
        _check_settings(str(old), 0)
    (fresh / SETTINGS_FILE).write_text(json.dumps({"task": {"kind": "max"}}))
    with pytest.raises(FileExistsError, match="remove it or give another --out-dir"):
        _check_settings(str(fresh), 0)
    assert len(list(old.iterdir())) == 1  # nothing written or removed


def test_arms_and_their_optimizer_steps_follow_the_protocol():
    """rlep: the paper's (G + M) / G optimizer steps per training step; rlep_equal: the
    baseline's; checked through the trainer's own mini-batch plan on the recipes' settings."""
    from rlep_megatron.config import load_config
    from rlep_megatron.demo import arm_settings, check_arms, examples_dir
    from rlep_megatron.actor.old_logprob import mini_batch_plan

    assert check_arms(None) == ["baseline", "rlep"]
    assert check_arms(["online", "baseline"]) == ["baseline", "online"]
    assert check_arms(["rlep"]) == ["baseline", "rlep"]
    with pytest.raises(ValueError, match="unknown demo arm"):
        check_arms(["rlep", "dpo"])
    steps = {}
    for arm in ("baseline", "rlep", "rlep_equal", "online", "one_step_off"):
        recipe, extra = arm_settings(arm, examples_dir(), "pool.parquet")
        cfg = load_config(recipe, extra)
        group = cfg.rollout.num_samples_per_prompt + cfg.replay.num_replays_per_prompt
        steps[arm] = len(mini_batch_plan(cfg.data.train_batch_size * group, cfg))
    # the equal-updates arm follows the user's G and mini-batch (overrides of every arm)
    user = ["rollout.num_samples_per_prompt=4", "trainer.mini_batch_size=3"]
    _, extra = arm_settings("rlep_equal", examples_dir(), "pool.parquet", user)
    assert "trainer.mini_batch_size=15" in extra  # 3 prompts x (4 + 1)
    g = load_config(arm_settings("rlep", examples_dir(), "p")[0]).rollout.num_samples_per_prompt
    assert steps["baseline"] == steps["rlep_equal"] == steps["one_step_off"] == 8
    assert load_config(*arm_settings("one_step_off", examples_dir(), "p")).trainer.max_staleness == 1
    assert steps["online"] == steps["rlep"]  # once every group has online answers
    assert steps["rlep"] * g == steps["baseline"] * (g + 1)  # 9 vs 8 with G = 8, M = 1


def test_t_quantiles_match_the_printed_tables():
    from rlep_megatron.demo import t_quantile

    # two-sided 95% critical values of Student's t (any statistics table)
    for df, value in ((1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (10, 2.228), (30, 2.042)):
        assert t_quantile(0.975, df) == pytest.approx(value, abs=2e-3), df
    assert t_quantile(0.5, 5) == pytest.approx(0.0, abs=1e-9)


def test_paired_differences_area_and_verdict_worked_by_hand():
    from rlep_megatron.demo import (area_under_curve, paired_comparison, paired_table,
                                    t_quantile, verdict)

    # trapezoids: (0.30 + 0.50) / 2 * 4 + (0.50 + 0.60) / 2 * 4 = 3.8 over 8 steps
    assert area_under_curve({0: 0.30, 4: 0.50, 8: 0.60}) == pytest.approx(3.8 / 8)
    paired = paired_comparison(BASELINE, RLEP, 0.58)
    best = paired["differences"]["best"]
    # per seed: 0.62 - 0.60 = 0.02 and 0.60 - 0.56 = 0.04
    assert best["values"] == pytest.approx([0.02, 0.04])
    half = t_quantile(0.975, 1) * statistics.stdev([0.02, 0.04]) / 2 ** 0.5
    assert (best["low"], best["high"]) == pytest.approx((0.03 - half, 0.03 + half))
    # steps to the peak of the baseline's mean curve (0.58): baseline seed 1 at 8, seed 2 never (counted
    # at 8 + 4 = 12); RLEP seed 1 at 4, seed 2 at 4 -> differences -4 and -8
    to_best = paired["differences"]["to_best"]
    assert to_best["values"] == [-4, -8]
    assert not paired["per_seed"][1]["baseline"]["to_best_reached"]
    # the fixed level: step 0 + 2 points (0.32 and 0.34)
    assert paired["fixed_gain"] == 0.02
    assert [r["baseline"]["to_fixed"] for r in paired["per_seed"]] == [4, 4]
    assert [r["rlep"]["to_fixed"] for r in paired["per_seed"]] == [4, 4]
    sentence = verdict(paired)
    assert "3.0 points above" in sentence and "includes 0" in sentence
    # fresh training accuracy, mean over steps: 0.45 - 0.35 and 0.65 - 0.55, +10 points each
    assert paired["differences"]["train"]["values"] == pytest.approx([0.1, 0.1])
    table = paired_table(paired, 8)
    assert "best validation mean@8 (points)" in table and "never reached" in table
    assert "fresh accuracy on the training questions, mean over steps (points)  +10.0 [+10.0, " \
           "+10.0]" in table
    # an interval that excludes 0
    runs = [run({0: 0.3, 4: 0.5}, {1: 0.1}), run({0: 0.3, 4: 0.52}, {1: 0.1}),
            run({0: 0.3, 4: 0.51}, {1: 0.1})]
    better = [run({0: 0.3, 4: 0.6}, {1: 0.1}), run({0: 0.3, 4: 0.62}, {1: 0.1}),
              run({0: 0.3, 4: 0.605}, {1: 0.1})]
    assert "excludes 0" in verdict(paired_comparison(runs, better, 0.51))
    # a level no run of either arm reaches has no steps to compare
    flat = [run({0: 0.3, 4: 0.3}, {1: 0.1}), run({0: 0.3, 4: 0.31}, {1: 0.1})]
    lines = paired_table(paired_comparison(flat, flat, 0.9), 8).splitlines()
    assert lines[4].rstrip().endswith("reached by no run")
    assert lines[5].rstrip().endswith("reached by no run")


def test_phases_at_once_and_a_failure_stops_the_others(monkeypatch, tmp_path):
    """``--jobs``: phases run together, and the first failure terminates the phase processes
    still running and is raised (a demo never waits on a run whose sibling failed)."""
    import subprocess
    import threading
    import time

    from rlep_megatron import demo

    started = threading.Barrier(2, timeout=10)  # both phases must be running at once
    registered = threading.Event()  # the long phase's process is one the demo tracks
    sleeper = {}

    def long_phase():
        started.wait()
        proc = subprocess.Popen(["sleep", "60"])
        sleeper["proc"] = proc
        with demo._LIVE_LOCK:
            demo._LIVE.add(proc)
        registered.set()
        try:
            proc.wait()
        finally:
            with demo._LIVE_LOCK:
                demo._LIVE.discard(proc)

    def failing_phase():
        started.wait()
        assert registered.wait(timeout=30)
        raise RuntimeError("rlep train failed")

    # a third phase, queued: it starts (or is cancelled) as the failure is handled, and its
    # process must not outlive the failure either
    fake = tmp_path / "fake_python"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setattr(demo.sys, "executable", str(fake))

    def queued_phase():
        demo._run(["train"], 1, str(tmp_path / "third.log"))

    begin = time.perf_counter()
    with pytest.raises(RuntimeError, match="rlep train failed"):
        demo._run_all([long_phase, failing_phase, queued_phase], jobs=2)
    assert time.perf_counter() - begin < 20
    assert sleeper["proc"].returncode is not None and sleeper["proc"].returncode < 0
    assert not demo._LIVE
    # one job: in order, one at a time
    order = []
    demo._run_all([lambda: order.append(1), lambda: order.append(2)], jobs=1)
    assert order == [1, 2]
    monkeypatch.setattr(demo.os, "cpu_count", lambda: 2)
    assert (demo.default_jobs(1), demo.default_jobs(2)) == (2, 1)
    monkeypatch.setattr(demo.os, "cpu_count", lambda: 64)
    assert demo.default_jobs(1) == 4


def test_replay_policy_bench_bins_questions_by_step0_pass_rate_worked_by_hand():
    """bench/replay_policies.py's difficulty table: questions binned by their pass rate at
    step 0, each arm's accuracy per bin (mean over the bin's questions, then over seeds) and
    its paired difference to the baseline."""
    bench = bench_module("replay_policies")

    def q(*acc):
        return {"acc": list(acc)}

    # pass rates 0, 1/4, 1/2, 1 and 3/4: bins 0, 1, 2, 3, 3
    step0 = [q(0, 0, 0, 0), q(1, 0, 0, 0), q(1, 1, 0, 0), q(1, 1, 1, 1), q(1, 1, 1, 0)]
    bins = bench.difficulty_bins(step0)
    assert bins == [0, 1, 2, 3, 3]
    after = [q(1, 0), q(1, 1), q(0, 0), q(1, 1), q(1, 0)]
    assert bench.accuracy_by_bin(after, bins) == [0.5, 1.0, 0.0, 0.75]
    with pytest.raises(ValueError, match="5 questions evaluated, 2 binned"):
        bench.accuracy_by_bin(after, bins[:2])
    # two seeds; the other arm is 10 and 30 points above the baseline in bin 0
    by_arm = {"baseline": [[0.5, 1.0, 0.0, 0.75], [0.3, 1.0, 0.0, 0.75]],
              "rescue": [[0.6, 1.0, 0.0, 0.75], [0.6, 1.0, 0.0, 0.75]]}
    table = bench.bin_table(by_arm, [1, 1, 1, 2])
    row = next(line for line in table.splitlines() if line.startswith("| [0, .25)"))
    # mean 60.0; paired differences +10 and +30: mean +20, t(0.975, 1) = 12.706,
    # sd 14.14 / sqrt(2) = 10 -> +20 +- 127.1
    assert row.split(" | ")[2:] == ["40.0", "60.0 (+20.0 [-107.1, +147.1]) |"]


def test_the_hard_miniature_has_a_directory_of_its_own(tmp_path):
    """A directory built for the tiny default is refused for the hard miniature and back: its
    task (and so its warm start) differs only in the corpus' slips and column share."""
    from rlep_megatron.demo import HARD_TASK, TASK, _check_settings

    assert {k for k in TASK if TASK[k] != HARD_TASK[k]} == {
        "num_slips_easy", "num_slips_hard", "stepwise_fraction"}
    default, hard = tmp_path / "default", tmp_path / "hard"
    default.mkdir()
    hard.mkdir()
    _check_settings(str(default), 0)
    _check_settings(str(hard), 0, HARD_TASK)
    _check_settings(str(hard), 0, HARD_TASK)  # continued
    with pytest.raises(FileExistsError, match="other settings"):
        _check_settings(str(hard), 0)
    with pytest.raises(FileExistsError, match="other settings"):
        _check_settings(str(default), 0, HARD_TASK)


def test_replay_policy_bench_hard_bins_and_diagnostics_worked_by_hand(tmp_path):
    """bench/replay_policies.py --hard: the finer bins, and the diagnostics' per-run means over
    the training steps (the replay share counts replays among all trained sequences) with the
    paired difference to the reference arm."""
    bench = bench_module("replay_policies")

    assert bench.bin_names(bench.HARD_EDGES) == ["[0, .05)", "[.05, .1)", "[.1, .25)",
                                                 "[.25, 1]"]
    # pass rates 0, 1/20, 2/20, 5/20, 4/20: bins 0, 1, 2, 3, 2
    step0 = [{"acc": [1] * n + [0] * (20 - n)} for n in (0, 1, 2, 5, 4)]
    assert bench.difficulty_bins(step0, bench.HARD_EDGES) == [0, 1, 2, 3, 2]

    def write(path, steps):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(json.dumps({"step": i + 1, **s}) for i, s in
                                  enumerate(steps)) + "\n")

    # 16 groups of 8 fresh responses; 4 and 12 replays: shares 4/132 and 12/140
    rlep = [{"train/entropy": 0.5, "rollout/num_groups": 16, "replay/num_sequences": n,
             "advantage/mean/replay": a, "advantage/mean/fresh": -0.1,
             "train/pg_clipfrac/replay": 0.2, "train/pg_clipfrac/fresh": 0.01,
             "rollout/acc_mean": acc}
            for n, a, acc in ((4, 1.0, 0.25), (12, 0.5, 0.5))]
    base = [{"train/entropy": 0.7, "rollout/num_groups": 16, "replay/num_sequences": 0,
             "advantage/mean/fresh": 0.0, "train/pg_clipfrac": 0.02}] * 2
    write(tmp_path / "rlep.jsonl", rlep + [{"val/tiny_arith/mean@8": 0.5}])
    write(tmp_path / "base.jsonl", base)
    r = bench.run_diagnostics(str(tmp_path / "rlep.jsonl"), 8)
    b = bench.run_diagnostics(str(tmp_path / "base.jsonl"), 8)
    assert r["replay share of trained sequences"] == pytest.approx((4 / 132 + 12 / 140) / 2)
    assert r["mean advantage of replays"] == 0.75
    assert r["clip fraction, fresh tokens"] == 0.01
    assert b["clip fraction, fresh tokens"] == 0.02  # a run without replays: the whole clip
    assert "mean advantage of replays" not in b
    # fresh accuracy on the training questions: a mean over steps (absent in the base runs)
    assert r["accuracy of fresh rollouts on the training questions"] == 0.375
    assert "accuracy of fresh rollouts on the training questions" not in b
    table = bench.diagnostics_table({"baseline": [b, b], "rlep": [r, r]})
    row = next(line for line in table.splitlines() if line.startswith("| entropy"))
    # the same values on both seeds: intervals of width 0; rlep - baseline = -0.2
    assert row == ("| entropy (nats per token) | 0.7 [0.7, 0.7] | 0.5 [0.5, 0.5] (vs "
                   "baseline: -0.2 [-0.2, -0.2]) |")
    row = next(line for line in table.splitlines() if "advantage of replays" in line)
    assert row == "| mean advantage of replays | - | 0.75 [0.75, 0.75] |"
