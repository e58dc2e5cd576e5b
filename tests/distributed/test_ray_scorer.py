"""The Ray scorer backend: a hanging answer is cancelled at the timeout, the rest are scored."""
import os
import time

import pytest

from rlep_megatron.reward import ScoreRequest, make_scorer_pool
from tests import requires

pytestmark = pytest.mark.distributed


@pytest.fixture(autouse=True)
def environment_kept():
    """``ray.init`` in this process sets variables in its environment (``PYTHONBREAKPOINT``,
    ``RAY_*``) that every job a later test starts would inherit: put back as they were."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


def test_ray_pool_times_out_a_hang():
    requires("ray")
    tower = "\\boxed{" + "9^{" * 12 + "9" + "}" * 12 + "}"
    requests = [ScoreRequest("math_dapo", f"Answer: {i}", str(i if i % 2 else -1))
                for i in range(40)]
    requests.insert(10, ScoreRequest("math_verify", tower, "1"))
    with make_scorer_pool("ray", num_workers=2, timeout_s=5.0) as pool:
        # the workers' start (an interpreter, ray, the reward modules) is not the hang's time
        pool.score([ScoreRequest("math_dapo", "Answer: 1", "1")] * 4)
        start = time.monotonic()
        results = pool.score(requests)
        elapsed = time.monotonic() - start
    # the tower alone takes minutes; the slack holds on a machine under twice its load
    assert elapsed < 5.0 + 12.0
    assert results[10]["timed_out"] and results[10]["score"] == -1.0
    others = results[:10] + results[11:]
    assert [r["acc"] for r in others] == [bool(i % 2) for i in range(40)]


def test_ray_pool_counts_an_answers_time_from_its_start_not_its_queueing():
    """One scorer process, the hanging answer first: the answers queued behind it wait its
    5 s out and are then scored right (a clock started when they were submitted timed them
    out with it; that is what failed on a loaded machine with two processes)."""
    requires("ray")
    tower = "\\boxed{" + "9^{" * 12 + "9" + "}" * 12 + "}"
    requests = [ScoreRequest("math_verify", tower, "1")] + [
        ScoreRequest("math_dapo", f"Answer: {i}", str(i if i % 2 else -1)) for i in range(6)]
    with make_scorer_pool("ray", num_workers=1, timeout_s=5.0) as pool:
        results = pool.score(requests)
        assert pool.num_timeouts == 1
    assert results[0]["timed_out"]
    assert [r["acc"] for r in results[1:]] == [bool(i % 2) for i in range(6)]
    assert not any(r["timed_out"] for r in results[1:])


def test_ray_pool_sets_up_a_rule_before_an_answers_clock():
    """math-verify's imports (over a second on a busy host) happen before the first answer's
    clock starts: with a 1 s limit it is scored, not timed out."""
    requires("ray")
    with make_scorer_pool("ray", num_workers=1, timeout_s=1.0) as pool:
        results = pool.score([ScoreRequest("math_verify", "so \\boxed{\\frac{1}{2}}", "0.5")])
        assert pool.num_timeouts == 0
    assert results[0]["acc"] and not results[0]["timed_out"]


def test_ray_pool_ends_scoring_when_no_process_gets_through_its_set_up(tmp_path, monkeypatch):
    """A rule whose import hangs in the scorer processes: no answer's clock ever starts, and
    the set-up's own limit ends scoring with an error naming it."""
    requires("ray")
    from rlep_megatron.reward import pool as pool_module
    from rlep_megatron.reward import use_reward_function
    from tests.unit.test_reward import HANGING_IMPORT

    path = tmp_path / "slow_reward.py"
    path.write_text(HANGING_IMPORT.format(pid=os.getpid()))
    use_reward_function(f"{path}:compute_score")
    monkeypatch.setattr(pool_module, "SETUP_LIMIT_S", 3.0)
    try:
        with make_scorer_pool("ray", num_workers=1, timeout_s=1.0) as pool:
            start = time.monotonic()
            with pytest.raises(RuntimeError, match="every Ray scorer process has spent over 3 s "
                                                   "starting or setting up"):
                pool.score([ScoreRequest("mine", "Answer: 1", "1")])
            assert time.monotonic() - start < 3.0 + 12.0
            assert pool.num_timeouts == 0
    finally:
        use_reward_function("")
