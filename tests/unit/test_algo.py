"""group_advantages and policy_loss against the spec's worked example and a float64 numpy
re-derivation of the paper's equations (eq. 3-5), token by token."""
import math

import numpy as np
import pytest
import torch

from rlep_megatron.algo import group_advantages, kl_penalty, policy_loss

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- advantages

def test_worked_example_16_wrong_2_replayed_correct():
    rewards = torch.tensor([-1.0] * 16 + [1.0] * 2)
    adv = group_advantages(rewards, torch.zeros(18, dtype=torch.long))
    assert adv[-1].item() == pytest.approx(2.75, abs=0.01)
    assert adv[0].item() == pytest.approx(-0.34, abs=0.01)
    # exact: mean -7/9; squared deviations 16 * (2/9)^2 + 2 * (16/9)^2 = 576/81, over N-1 = 17
    std = math.sqrt(576 / 81 / 17)
    assert adv[-1].item() == pytest.approx((1 + 7 / 9) / (std + 1e-6), rel=1e-6)


def reference_advantages(rewards, groups, eps, normalize_std):
    out = np.zeros(len(rewards), dtype=np.float64)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        vals = np.array([rewards[i] for i in idx], dtype=np.float64)
        if len(vals) < 2:
            continue
        mean = vals.sum() / len(vals)
        std = math.sqrt(((vals - mean) ** 2).sum() / (len(vals) - 1))
        for i, v in zip(idx, vals):
            out[i] = (v - mean) / (std + eps) if normalize_std else v - mean
    return out


@pytest.mark.parametrize("normalize_std", [True, False])
def test_advantages_match_float64_reference_on_ragged_groups(normalize_std):
    rng = np.random.default_rng(0)
    for _ in range(20):
        sizes = rng.integers(1, 20, size=rng.integers(1, 8))
        groups = np.concatenate([np.full(s, 100 + 7 * g) for g, s in enumerate(sizes)])
        rng.shuffle(groups)  # interleaved members
        rewards = rng.choice([-1.0, 1.0, -1.5, 0.25], size=len(groups))
        got = group_advantages(torch.tensor(rewards, dtype=torch.float64),
                               torch.tensor(groups), normalize_std=normalize_std)
        np.testing.assert_allclose(got.numpy(), reference_advantages(
            rewards.tolist(), groups.tolist(), 1e-6, normalize_std), rtol=1e-12, atol=1e-12)


def test_degenerate_groups_get_zero():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, -1.0, 0.5]),
                           torch.tensor([0, 0, 0, 1, 2]))
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(2))


# ---------------------------------------------------------------- loss

def reference_token_loss(logp, old_logp, adv, eps_low, eps_high, c):
    """Paper eq. 3 with dual clip, one token at a time, Python floats."""
    ratio = math.exp(logp - old_logp)
    clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
    loss = max(-adv * ratio, -adv * clipped)
    if adv < 0:
        loss = min(loss, -adv * c)
    return loss


def random_batch(seed, batch=7, seq=11):
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(1.0, size=(batch, seq))
    # ratios far outside the clip range on both sides
    old_logp = logp + rng.normal(0, 1.5, size=(batch, seq))
    adv = rng.normal(0, 2, size=batch)
    lengths = rng.integers(1, seq + 1, size=batch)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float64)
    return logp, old_logp, adv, mask


@pytest.mark.parametrize("seed", range(5))
def test_policy_loss_matches_float64_reference(seed):
    logp, old_logp, adv, mask = random_batch(seed)
    total, count = 0.0, 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t]:
                total += reference_token_loss(logp[i, t], old_logp[i, t], adv[i], 0.2, 0.28, 10.0)
                count += 1
    loss, metrics = policy_loss(torch.tensor(logp), torch.tensor(old_logp), torch.tensor(adv),
                                torch.tensor(mask), 0.2, 0.28, 10.0)
    assert loss.item() == pytest.approx(total / count, rel=1e-12)
    assert metrics["num_tokens"] == count
    ratio = np.exp(logp - old_logp)
    assert metrics["ratio_max"] == pytest.approx(ratio[mask > 0].max(), rel=1e-12)
    assert metrics["approx_kl"] == pytest.approx((old_logp - logp)[mask > 0].mean(), rel=1e-9)


def test_clip_fractions_on_hand_built_tokens():
    # ratio: 2.0 (A>0: high clip), 0.5 (A<0: low clip), 20 (A<0: dual clip), 1.0 (none)
    logp = torch.log(torch.tensor([[2.0, 0.5, 20.0, 1.0]], dtype=torch.float64))
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    loss, m = policy_loss(logp, old, adv, torch.ones_like(logp))
    per_token = [-1.0 * 1.28, 1.0 * 0.8, 10.0, -1.0]
    assert loss.item() == pytest.approx(sum(per_token) / 4)
    assert m["pg_clipfrac_high"] == pytest.approx(0.25)
    assert m["pg_clipfrac_low"] == pytest.approx(0.25)
    assert m["pg_clipfrac_dual"] == pytest.approx(0.25)
    assert m["pg_clipfrac"] == pytest.approx(0.5)


def test_micro_batches_with_global_normaliser_equal_whole_batch():
    logp, old_logp, adv, mask = random_batch(11, batch=9)
    whole_logp = torch.tensor(logp, requires_grad=True)
    whole, _ = policy_loss(whole_logp, torch.tensor(old_logp), torch.tensor(adv),
                           torch.tensor(mask))
    whole.backward()

    split_logp = torch.tensor(logp, requires_grad=True)
    global_tokens = float(mask.sum())
    total = 0.0
    for rows in (slice(0, 2), slice(2, 7), slice(7, 9)):  # uneven micro-batches
        part, _ = policy_loss(split_logp[rows], torch.tensor(old_logp[rows]),
                              torch.tensor(adv[rows]), torch.tensor(mask[rows]),
                              global_num_tokens=global_tokens)
        part.backward()
        total += part.item()
    assert total == pytest.approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(split_logp.grad, whole_logp.grad, rtol=1e-12, atol=1e-15)


def test_reference_micro_batch_mode_weights_by_sequences():
    logp, old_logp, adv, mask = random_batch(3, batch=6)
    mask[:2] = 1.0  # long sequences in the first micro-batch, short ones in the second
    mask[2:] = 0.0
    mask[2:, :2] = 1.0
    parts, expected = [], 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        loss, _ = policy_loss(torch.tensor(logp[rows]), torch.tensor(old_logp[rows]),
                              torch.tensor(adv[rows]), torch.tensor(mask[rows]),
                              loss_agg_mode="reference_micro_batch_mean", global_num_sequences=6)
        # the micro-batch's own token mean, token by token from eq. 3
        tokens = [reference_token_loss(logp[i, t], old_logp[i, t], adv[i], 0.2, 0.28, 10.0)
                  for i in range(rows.start, rows.stop) for t in range(logp.shape[1])
                  if mask[i, t]]
        expected += sum(tokens) / len(tokens) * (rows.stop - rows.start) / 6
        parts.append(loss.item())
    assert sum(parts) == pytest.approx(expected, rel=1e-12)
    exact, _ = policy_loss(torch.tensor(logp), torch.tensor(old_logp), torch.tensor(adv),
                           torch.tensor(mask))
    assert abs(sum(parts) - exact.item()) > 1e-6  # ragged lengths: only approximately equal


def test_fresh_and_replay_splits():
    logp, old_logp, adv, mask = random_batch(5, batch=6)
    is_replay = torch.tensor([False, False, False, False, True, True])
    _, m = policy_loss(torch.tensor(logp), torch.tensor(old_logp), torch.tensor(adv),
                       torch.tensor(mask), is_replay=is_replay)
    ratio = np.exp(logp - old_logp)
    for suffix, rows in (("/fresh", slice(0, 4)), ("/replay", slice(4, 6))):
        # each split from the definitions, over its own valid tokens only
        valid = mask[rows] > 0
        r = ratio[rows][valid]
        a = np.broadcast_to(adv[rows, None], mask[rows].shape)[valid]
        clipped = np.clip(r, 0.8, 1.28)
        assert m[f"num_tokens{suffix}"] == valid.sum()
        assert m[f"ratio_mean{suffix}"] == pytest.approx(r.mean(), rel=1e-12)
        assert m[f"ratio_max{suffix}"] == pytest.approx(r.max(), rel=1e-12)
        assert m[f"approx_kl{suffix}"] == pytest.approx(
            (old_logp - logp)[rows][valid].mean(), rel=1e-9)
        assert m[f"pg_clipfrac{suffix}"] == pytest.approx(
            np.mean(-a * clipped > -a * r), rel=1e-12)
    assert m["num_tokens"] == m["num_tokens/fresh"] + m["num_tokens/replay"]


def test_replays_start_at_ratio_one_and_push_up_positive_advantage():
    logp = torch.log(torch.tensor([[0.2, 0.3]], dtype=torch.float64)).requires_grad_()
    loss, m = policy_loss(logp, logp.detach(), torch.tensor([2.75], dtype=torch.float64),
                          torch.ones(1, 2, dtype=torch.float64))
    loss.backward()
    assert m["ratio_mean"] == 1.0 and m["pg_clipfrac"] == 0.0
    assert (logp.grad < 0).all()  # descending the loss raises the replayed tokens' log-probs


def test_kl_estimators_have_the_true_kl_as_expectation():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(10))
    q = rng.dirichlet(np.ones(10))
    true_kl = float((p * np.log(p / q)).sum())
    logp, logq = torch.tensor(np.log(p)), torch.tensor(np.log(q))
    for estimator in ("k1", "k3"):
        expectation = float((torch.tensor(p) * kl_penalty(logp, logq, estimator)).sum())
        assert expectation == pytest.approx(true_kl, rel=1e-10)
    assert (kl_penalty(logp, logq, "k3") >= 0).all()
    assert torch.allclose(kl_penalty(logp, logq, "k2"), 0.5 * (logp - logq) ** 2)


def test_optional_terms_are_off_by_default_and_applied_when_set():
    logp, old_logp, adv, mask = random_batch(8)
    args = [torch.tensor(x) for x in (logp, old_logp, adv, mask)]
    base, _ = policy_loss(*args)
    ref = torch.tensor(old_logp) - 0.1
    entropy = torch.full_like(args[0], 2.0)
    with_kl, metrics = policy_loss(*args, ref_logp=ref, kl_coef=0.5, kl_estimator="k1")
    expected_kl = float(((torch.tensor(logp) - ref) * args[3]).sum() / args[3].sum())
    assert metrics["kl"] == pytest.approx(expected_kl, rel=1e-12)
    assert with_kl.item() == pytest.approx(base.item() + 0.5 * expected_kl, rel=1e-12)
    with_entropy, _ = policy_loss(*args, entropy=entropy, entropy_coef=0.01)
    assert with_entropy.item() == pytest.approx(base.item() - 0.01 * 2.0, rel=1e-12)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(*args, kl_coef=0.1)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_loss(*args, loss_agg_mode="sum")


def test_metrics_on_device_are_the_same_values_without_a_scalar_read():
    """``metrics_on_device``: the same metrics as tensors, computed without reading any tensor
    into Python (each read waits for a GPU); the float path reads them in one transfer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Reads.count += 1
            return func(*args, **(kwargs or {}))

    logp, old_logp, adv, mask = (torch.tensor(x) for x in random_batch(6, batch=6))
    mask[2] = 0.0  # a row without tokens
    is_replay = torch.tensor([False, False, True, True, False, False])
    options = dict(global_num_tokens=float(mask.sum()), is_replay=is_replay,
                   ref_logp=old_logp - 0.1, kl_coef=0.1)
    _, floats = policy_loss(logp, old_logp, adv, mask, **options)
    with Reads():
        loss, tensors = policy_loss(logp, old_logp, adv, mask, **options, metrics_on_device=True)
    assert Reads.count == 0
    assert sorted(tensors) == sorted(floats) and "ratio_max/replay" in floats
    for key, value in floats.items():
        assert isinstance(tensors[key], torch.Tensor) and tensors[key].dim() == 0
        assert tensors[key].item() == pytest.approx(value, rel=1e-12), key
    # the ratio maximum over a group's tokens, 0 for a group without any
    _, empty = policy_loss(logp, old_logp, adv, mask, is_replay=torch.zeros(6, dtype=torch.bool))
    assert empty["ratio_max/replay"] == 0.0 and empty["num_tokens/replay"] == 0.0
    valid = mask > 0
    assert floats["ratio_max"] == pytest.approx(float(torch.exp(logp - old_logp)[valid].max()),
                                                rel=1e-12)
