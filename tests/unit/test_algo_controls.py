"""KL to a reference policy, rollout correction and the replay-specific clip against float64
re-derivations from their defining formulas, token by token in Python floats (values and
gradients), on random ragged batches with padding."""
import math

import numpy as np
import pytest
import torch

from rlep_megatron.algo import mismatch_kl, policy_loss, rollout_correction_weights
from rlep_megatron.config import load_config

pytestmark = pytest.mark.unit


def ragged(seed, batch=6, seq=9, spread=0.7):
    """logp, a second log-prob table near it, advantages and a right-padded mask; the padded
    positions hold large garbage values that must not leak into any result."""
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(1.0, size=(batch, seq))
    other = logp + rng.normal(0, spread, size=(batch, seq))
    adv = rng.normal(0, 2, size=batch)
    lengths = rng.integers(1, seq + 1, size=batch)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float64)
    logp = np.where(mask > 0, logp, 50.0)
    other = np.where(mask > 0, other, -50.0)
    return logp, other, adv, mask


def t(x):
    return torch.tensor(x, dtype=torch.float64)


# ---------------------------------------------------------------- KL to the reference

def kl_token(logp, ref, estimator):
    """Schulman's estimators from their definitions, with r = pi_ref / pi (samples of pi)."""
    r = math.exp(ref - logp)
    if estimator == "k1":
        return -math.log(r)
    if estimator == "k2":
        return 0.5 * math.log(r) ** 2
    return (r - 1) - math.log(r)


def kl_token_grad(logp, ref, estimator):
    """d/d logp of the estimators above, derived by hand."""
    if estimator == "k1":
        return 1.0
    if estimator == "k2":
        return logp - ref
    return 1.0 - math.exp(ref - logp)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("seed", range(3))
def test_kl_term_value_and_gradient_match_float64_derivation(estimator, seed):
    logp, ref, adv, mask = ragged(seed)
    old = logp.copy()  # ratio 1: the policy-gradient part is -A per token
    coef = 0.3
    count = mask.sum()
    expected_kl, expected_grad = 0.0, np.zeros_like(logp)
    expected_metric = 0.0
    for i, j in zip(*np.nonzero(mask)):
        expected_kl += kl_token(logp[i, j], ref[i, j], estimator) / count
        # -A * ratio has gradient -A * ratio = -A at ratio 1; plus coef * d KL / d logp
        expected_grad[i, j] = (-adv[i] + coef * kl_token_grad(logp[i, j], ref[i, j], estimator)
                               ) / count
    for i, j in zip(*np.nonzero(mask)):
        expected_metric += kl_token(logp[i, j], ref[i, j], estimator) / count
    x = t(logp).requires_grad_()
    loss, metrics = policy_loss(x, t(old), t(adv), t(mask), ref_logp=t(ref), kl_coef=coef,
                                kl_estimator=estimator)
    loss.backward()
    assert metrics["kl"] == pytest.approx(expected_kl, rel=1e-12)
    assert loss.item() == pytest.approx(metrics["pg_loss"] + coef * expected_kl, rel=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), expected_grad, rtol=1e-10, atol=1e-14)
    assert metrics[f"kl_{estimator}"] == pytest.approx(expected_metric, rel=1e-12)


def test_kl_metrics_split_fresh_and_replay_and_need_no_coefficient():
    logp, ref, adv, mask = ragged(4)
    is_replay = torch.tensor([False, True, False, True, False, False])
    _, m = policy_loss(t(logp), t(logp), t(adv), t(mask), ref_logp=t(ref), is_replay=is_replay)
    assert "kl" not in m  # no penalty term without a coefficient
    for estimator in ("k1", "k2", "k3"):
        for suffix, rows in (("/fresh", ~is_replay), ("/replay", is_replay)):
            values = [kl_token(logp[i, j], ref[i, j], estimator)
                      for i, j in zip(*np.nonzero(mask)) if rows[i]]
            assert m[f"kl_{estimator}{suffix}"] == pytest.approx(np.mean(values), rel=1e-12)


def test_kl_clamp_bounds_each_token_and_stops_its_gradient():
    # token 1: the policy has moved far below the reference, k3 = e^8.8 - 1 - 8.8, about 6.6e3
    logp = t([[-0.1, -9.0, -0.3]]).requires_grad_()
    ref = t([[-0.1, -0.2, -0.35]])
    mask = torch.ones(1, 3, dtype=torch.float64)
    loss, m = policy_loss(logp, logp.detach(), t([0.0]), mask, ref_logp=ref, kl_coef=1.0,
                          kl_estimator="k3", kl_clamp=10.0)
    loss.backward()
    k3 = [kl_token(a, b, "k3") for a, b in zip(logp[0].tolist(), ref[0].tolist())]
    assert k3[1] > 10
    assert m["kl"] == pytest.approx((k3[0] + 10.0 + k3[2]) / 3, rel=1e-12)
    assert logp.grad[0, 1].item() == 0.0
    assert logp.grad[0, 2].item() == pytest.approx(
        kl_token_grad(-0.3, -0.35, "k3") / 3, rel=1e-12)


def test_kl_is_zero_when_the_policy_is_the_reference():
    logp, _, adv, mask = ragged(5)
    for estimator in ("k1", "k2", "k3"):
        loss_kl, m = policy_loss(t(logp), t(logp), t(adv), t(mask), ref_logp=t(logp),
                                 kl_coef=0.5, kl_estimator=estimator)
        loss, _ = policy_loss(t(logp), t(logp), t(adv), t(mask))
        assert m["kl"] == 0.0 and loss_kl.item() == loss.item()


# ---------------------------------------------------------------- rollout correction

def reference_weights(old, rollout, mask, mode, level, c):
    """Weights per token from the definitions: rho = pi_old / pi_rollout per token, the
    product of a sequence's rhos, or their geometric mean; truncate = min(rho, C), mask =
    rho (mask) or 1 (reject) inside [1/C, C] and 0 outside. Python floats."""
    weights = np.ones_like(old)
    changed = np.zeros(old.shape, dtype=bool)
    for i in range(old.shape[0]):
        cols = [j for j in range(old.shape[1]) if mask[i, j]]
        rhos = {j: math.exp(old[i, j] - rollout[i, j]) for j in cols}
        for j in cols:
            if level == "token":
                rho = rhos[j]
            elif level == "sequence":
                rho = math.prod(rhos.values())
            else:
                rho = math.prod(rhos.values()) ** (1.0 / len(cols))
            if mode == "truncate":
                weights[i, j] = min(rho, c)
                changed[i, j] = rho > c
            else:
                keep = 1.0 / c <= rho <= c
                # mask: importance weight rho on kept tokens; reject: weight 1
                weights[i, j] = (rho if mode == "mask" else 1.0) if keep else 0.0
                changed[i, j] = not keep
    return weights, changed


@pytest.mark.parametrize("mode", ["truncate", "mask", "reject"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("seed", range(3))
def test_correction_weights_match_their_definitions(mode, level, seed):
    old, rollout, _, mask = ragged(seed, spread=0.4)
    mask[-1] = 0.0  # a replay: no rollout log-probs, weight 1
    c = 1.1 if level == "geometric" else 1.5  # a sequence's mean log-ratio spreads less
    expected, expected_changed = reference_weights(old, rollout, mask, mode, level, c)
    weights, changed = rollout_correction_weights(t(old), t(rollout), t(mask), mode, level, c)
    np.testing.assert_allclose(weights.numpy(), expected, rtol=1e-12, atol=0)
    assert (changed.numpy() == expected_changed).all()
    assert changed.any() and not changed.all()  # the threshold bites on some tokens only
    assert (weights[-1] == 1).all()


def test_sequence_ratio_of_a_long_response_does_not_overflow():
    n = 4000
    old = torch.zeros(1, n, dtype=torch.float64)
    rollout = torch.full((1, n), -0.5, dtype=torch.float64)  # rho = e^0.5 per token
    mask = torch.ones(1, n)
    weights, changed = rollout_correction_weights(old, rollout, mask, "truncate", "sequence",
                                                  2.0)
    assert torch.equal(weights, torch.full_like(weights, 2.0)) and changed.all()
    weights, _ = rollout_correction_weights(old, rollout, mask, "mask", "geometric", 2.0)
    # geometric mean e^0.5 < 2: kept, with its importance weight
    assert torch.allclose(weights, torch.full_like(weights, math.exp(0.5)), rtol=1e-12)


def test_off_and_identical_numerics_leave_the_update_unchanged():
    logp, _, adv, mask = ragged(7)
    old = logp + 0.05
    for mode in ("off", "truncate", "mask", "reject"):
        weights, changed = rollout_correction_weights(t(old), t(old), t(mask), mode)
        assert torch.equal(weights, torch.ones_like(weights)) and not changed.any()
    a = t(logp).requires_grad_()
    b = t(logp).requires_grad_()
    plain, _ = policy_loss(a, t(old), t(adv), t(mask))
    corrected, _ = policy_loss(b, t(old), t(adv), t(mask), token_weights=weights)
    plain.backward()
    corrected.backward()
    assert plain.item() == corrected.item()
    assert torch.equal(a.grad, b.grad)


def test_weighted_loss_and_gradient_match_float64_derivation():
    logp, old, adv, mask = ragged(8, spread=0.5)
    rollout = old + np.random.default_rng(1).normal(0, 0.5, size=old.shape)
    weights, _ = rollout_correction_weights(t(old), t(rollout), t(mask), "truncate", "token",
                                            1.3)
    x = t(logp).requires_grad_()
    loss, _ = policy_loss(x, t(old), t(adv), t(mask), token_weights=weights)
    loss.backward()
    count = mask.sum()
    expected, grad = 0.0, np.zeros_like(logp)
    eps_low, eps_high, c = 0.2, 0.28, 10.0
    for i, j in zip(*np.nonzero(mask)):
        w = min(math.exp(old[i, j] - rollout[i, j]), 1.3)
        ratio = math.exp(logp[i, j] - old[i, j])
        clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
        a = adv[i]
        # d(-a * ratio)/d logp = -a * ratio; the clipped branch is constant in logp
        if clipped == ratio or -a * ratio > -a * clipped:
            token, g = -a * ratio, -a * ratio
        else:
            token, g = -a * clipped, 0.0
        if a < 0 and -a * c < token:  # dual clip
            token, g = -a * c, 0.0
        expected += w * token / count
        grad[i, j] = w * g / count
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), grad, rtol=1e-10, atol=1e-14)


def test_mismatch_kl_matches_its_definition():
    old, rollout, _, mask = ragged(9, spread=0.3)
    got = mismatch_kl(t(old), t(rollout), t(mask))
    k1 = k3 = 0.0
    for i, j in zip(*np.nonzero(mask)):
        r = math.exp(old[i, j] - rollout[i, j])  # pi_old / pi_rollout, samples of pi_rollout
        k1 += -math.log(r)
        k3 += (r - 1) - math.log(r)
    assert got["tokens"] == mask.sum()
    assert got["k1"] == pytest.approx(k1, rel=1e-12)
    assert got["k3"] == pytest.approx(k3, rel=1e-12)
    assert mismatch_kl(t(old), t(old), t(mask)) == {"k1": 0.0, "k3": 0.0,
                                                    "tokens": float(mask.sum())}


# ---------------------------------------------------------------- replay clip

def test_replay_clip_high_caps_only_replayed_rows():
    # ratio 1.2 everywhere, positive advantages: inside eps_high = 0.28, outside 0.1
    logp = torch.log(torch.full((2, 2), 1.2, dtype=torch.float64)).requires_grad_()
    old = torch.zeros(2, 2, dtype=torch.float64)
    adv = t([1.0, 1.0])
    mask = torch.ones(2, 2, dtype=torch.float64)
    is_replay = torch.tensor([False, True])
    loss, m = policy_loss(logp, old, adv, mask, is_replay=is_replay, replay_clip_high=0.1)
    loss.backward()
    assert loss.item() == pytest.approx((-1.2 * 2 - 1.1 * 2) / 4, rel=1e-12)
    assert m["pg_clipfrac/replay"] == 1.0 and m["pg_clipfrac/fresh"] == 0.0
    assert (logp.grad[1] == 0).all() and (logp.grad[0] != 0).all()
    same, _ = policy_loss(logp.detach(), old, adv, mask, is_replay=is_replay,
                          replay_clip_high=0.28)
    plain, _ = policy_loss(logp.detach(), old, adv, mask, is_replay=is_replay)
    assert same.item() == plain.item()
    with pytest.raises(ValueError, match="is_replay"):
        policy_loss(logp.detach(), old, adv, mask, replay_clip_high=0.1)


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("override, message", [
    ("algo.kl_coef=-0.1", "kl_coef"),
    ("algo.kl_clamp=0", "kl_clamp"),
    ("algo.rollout_correction_threshold=1.0", "rollout_correction_threshold"),
    ("algo.rollout_correction=clip", "rollout_correction"),
    ("algo.rollout_correction_level=batch", "rollout_correction_level"),
    ("replay.clip_ratio_high=-1", "clip_ratio_high"),
])
def test_bad_control_values_are_refused_by_name(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_a_bare_off_in_yaml_means_off(tmp_path):
    # YAML 1.1 reads `off` as false: the documented value must still work in a recipe
    path = tmp_path / "r.yaml"
    path.write_text("algo:\n  rollout_correction: off\n")
    assert load_config(str(path)).algo.rollout_correction == "off"
    assert load_config(None, ["algo.rollout_correction=off"]).algo.rollout_correction == "off"


def test_masked_importance_sampling_drops_rejected_tokens_from_the_normaliser():
    """``mask`` (verl's MIS): kept tokens weighted by rho, rejected tokens out of the loss and
    of the token count; ``reject`` keeps them in the count with weight 0."""
    from rlep_megatron.algo import rollout_loss_mask

    logp, old, adv, mask = ragged(11, spread=0.5)
    rollout = old + np.random.default_rng(2).normal(0, 0.6, size=old.shape)
    c = 1.4
    results = {}
    for mode in ("mask", "reject"):
        weights, changed = rollout_correction_weights(t(old), t(rollout), t(mask), mode,
                                                      "token", c)
        keep = rollout_loss_mask(mode, changed)
        loss_mask = t(mask) * (keep.double() if keep is not None else 1.0)
        x = t(logp).requires_grad_()
        loss, metrics = policy_loss(x, t(old), t(adv), loss_mask, token_weights=weights)
        loss.backward()
        results[mode] = (loss.item(), x.grad.clone(), metrics["num_tokens"])
    assert rollout_loss_mask("reject", changed) is None
    kept = [(i, j) for i, j in zip(*np.nonzero(mask))
            if 1 / c <= math.exp(old[i, j] - rollout[i, j]) <= c]
    assert 0 < len(kept) < mask.sum()
    eps_low, eps_high, clip_c = 0.2, 0.28, 10.0
    expected = {"mask": 0.0, "reject": 0.0}
    for i, j in kept:
        rho = math.exp(old[i, j] - rollout[i, j])
        ratio = math.exp(logp[i, j] - old[i, j])
        a = adv[i]
        token = max(-a * ratio, -a * min(max(ratio, 1 - eps_low), 1 + eps_high))
        if a < 0:
            token = min(token, -a * clip_c)
        expected["mask"] += rho * token / len(kept)  # normaliser: kept tokens only
        expected["reject"] += token / mask.sum()  # normaliser: every response token
    assert results["mask"][0] == pytest.approx(expected["mask"], rel=1e-12)
    assert results["reject"][0] == pytest.approx(expected["reject"], rel=1e-12)
    assert results["mask"][2] == len(kept) and results["reject"][2] == mask.sum()
    for mode in ("mask", "reject"):  # no gradient through a dropped token
        grad = results[mode][1].numpy()
        dropped = [(i, j) for i, j in zip(*np.nonzero(mask)) if (i, j) not in kept]
        assert all(grad[i, j] == 0.0 for i, j in dropped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_terms_stay_finite_at_large_log_ratios(dtype, estimator):
    """|log r| up to 100 in fp32 and bf16: finite values and gradients (k3 clamps the
    log-ratio at +-20 before exp; inside that bound it is the exact formula)."""
    from rlep_megatron.algo import kl_penalty

    log_ratios = torch.tensor([-100.0, -60.0, -20.0, -1.0, 0.0, 1.0, 20.0, 60.0, 100.0])
    logp = (log_ratios - 5.0).to(dtype).requires_grad_()
    ref = torch.full_like(log_ratios, -5.0).to(dtype)
    value = kl_penalty(logp, ref, estimator)
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(logp.grad).all(), (value, logp.grad)
    if estimator == "k3":
        inside = log_ratios.abs() <= 20
        exact = torch.exp(-log_ratios[inside].double()) - 1 + log_ratios[inside].double()
        assert torch.allclose(value[inside].double(), exact,
                              rtol=1e-5 if dtype == torch.float32 else 2e-2)
        assert (logp.grad[~inside] == 0).all()
        # with kl_clamp on top (the setting that used to give a NaN gradient)
        logp.grad = None
        clamped = kl_penalty(logp, ref, estimator, clamp=10.0)
        clamped.sum().backward()
        assert torch.isfinite(logp.grad).all()
