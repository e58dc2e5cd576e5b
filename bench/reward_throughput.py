"""Reward throughput: answers/second of the DAPO and math-verify rules, in-process and through
the scorer pool, and the pool's per-answer overhead.

    python bench/reward_throughput.py [--num-answers 20000] [--num-math-verify 2000] [--workers 2]

Answers are synthetic model-like responses (a few hundred characters of reasoning, then the
final answer; half correct).
"""
import argparse
import os
import platform
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rlep_megatron.reward import ScoreRequest, ScorerPool, compute_score  # noqa: E402


def make_requests(rule: str, count: int, seed: int = 0) -> list[ScoreRequest]:
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        steps = " ".join(f"Step {s}: {a} + {s} * {b} = {a + s * b}." for s in range(rng.randint(5, 25)))
        answer = a * b if i % 2 == 0 else a * b + 1
        if rule == "dapo":
            text = f"{steps}\nSo the product is {answer}.\nAnswer: {answer}"
            requests.append(ScoreRequest("math_dapo", text, str(a * b)))
        else:
            text = f"{steps}\nThus the ratio is $\\boxed{{\\frac{{{answer}}}{{{b}}}}}$."
            requests.append(ScoreRequest("math_verify", text, f"\\frac{{{a * b}}}{{{b}}}"))
    return requests


def time_in_process(requests) -> float:
    start = time.perf_counter()
    for r in requests:
        compute_score(r.data_source, r.solution_str, r.ground_truth)
    return time.perf_counter() - start


def time_pool(requests, workers: int) -> float:
    with ScorerPool(num_workers=workers, timeout_s=30) as pool:
        pool.score(requests[: 4 * workers])  # workers started and rule modules imported
        start = time.perf_counter()
        results = pool.score(requests)
        elapsed = time.perf_counter() - start
    assert sum(r["acc"] for r in results) == (len(requests) + 1) // 2
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-answers", type=int, default=20000)
    parser.add_argument("--num-math-verify", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    rows = []
    for rule, count in (("dapo", args.num_answers), ("math_verify", args.num_math_verify)):
        requests = make_requests(rule, count)
        time_in_process(make_requests(rule, 4 * args.workers, seed=1))  # same warm-up as the pool
        in_process = time_in_process(requests)
        one_worker = time_pool(requests, 1)
        pooled = time_pool(requests, args.workers)
        overhead_us = (one_worker - in_process) / count * 1e6
        rows.append((rule, count, count / in_process, count / one_worker, count / pooled,
                     overhead_us))

    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}; pool workers: {args.workers}")
    header = ("rule", "answers", "in-process/s", "pool x1/s", f"pool x{args.workers}/s",
              "pool overhead us/answer")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for rule, count, ip, p1, pn, overhead in rows:
        print(f"{rule} | {count} | {ip:,.0f} | {p1:,.0f} | {pn:,.0f} | {overhead:+.1f}")


if __name__ == "__main__":
    main()
