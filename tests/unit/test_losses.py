"""The plug-in losses and advantage estimators (``algo.loss``, ``algo.advantage``) against float64
re-derivations of their papers' formulas, written sequence by sequence and token by token with
Python loops, on a micro-batch with replayed rows and unequal lengths: loss values and the
gradients with respect to every log-prob."""
import math
import types
import typing

import pytest
import torch

from rlep_megatron.algo import (ADVANTAGE_ESTIMATORS, LOSSES, LossBatch, Normaliser, Penalties,
                                build_loss, estimator_from_config, kl_penalty, loss_from_config)
from rlep_megatron.config import AlgoConfig, RunConfig, ReplayConfig

pytestmark = pytest.mark.unit

LENGTHS = [5, 2, 7, 3, 6, 1]           # trained tokens per row (the columns after are padding)
REPLAY = [False, False, True, False, True, False]
ADVANTAGES = [1.3, -0.7, 2.1, -1.6, 0.4, 0.9]


def make_batch(seed: int = 0, spread: float = 0.3):
    """logp, old_logp ``[6, 8]`` float64 (logp with gradient), mask, advantages, is_replay."""
    generator = torch.Generator().manual_seed(seed)
    width = max(LENGTHS) + 1
    old = -torch.rand(len(LENGTHS), width, generator=generator, dtype=torch.float64) * 3 - 0.05
    logp = (old + spread * torch.randn(len(LENGTHS), width, generator=generator,
                                       dtype=torch.float64)).clamp(max=-1e-3)
    mask = torch.zeros(len(LENGTHS), width, dtype=torch.float64)
    for row, n in enumerate(LENGTHS):
        mask[row, :n] = 1
    return (logp.requires_grad_(True), old, mask, torch.tensor(ADVANTAGES, dtype=torch.float64),
            torch.tensor(REPLAY))


def loss_and_grad(name, logp, old, mask, adv, replay, normaliser=Normaliser(), rows=None,
                  **options):
    """The loss of ``rows`` (default: all) and its gradient with respect to the whole ``logp``."""
    rows = list(range(len(LENGTHS))) if rows is None else rows
    loss, metrics = build_loss(name, **options)(
        LossBatch(logp[rows], old[rows], adv[rows], mask[rows], replay[rows]), normaliser)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad, metrics


# ---------------------------------------------------------------- GSPO

def gspo_reference(logp, old, adv, eps_low, eps_high):
    """GSPO eq. (5)-(7): -1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i), with
    s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|); the gradient by autograd of this sequence-level
    form (no per-token rewriting)."""
    total = 0
    for row, n in enumerate(LENGTHS):
        log_pi = sum(logp[row, t] for t in range(n))
        log_old = sum(old[row, t].item() for t in range(n))
        s = torch.exp((log_pi - log_old) / n)
        a = ADVANTAGES[row]
        total = total + torch.minimum(s * a, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a)
    return -total / len(LENGTHS)


@pytest.mark.parametrize("spread", [0.02, 0.3])
def test_gspo_matches_the_sequence_level_formula(spread):
    logp, old, mask, adv, replay = make_batch(1, spread)
    eps_low, eps_high = 0.01, 0.015
    value, grad, metrics = loss_and_grad("gspo", logp, old, mask, adv, replay,
                                         clip_low=eps_low, clip_high=eps_high)
    reference = gspo_reference(logp, old, adv, eps_low, eps_high)
    (ref_grad,) = torch.autograd.grad(reference, logp)
    assert value == pytest.approx(reference.item(), abs=1e-13)
    torch.testing.assert_close(grad, ref_grad, atol=1e-13, rtol=0)
    # clip flags per sequence, as a token mean
    clipped_tokens = 0
    for row, n in enumerate(LENGTHS):
        s = math.exp(sum(logp[row, t].item() - old[row, t].item() for t in range(n)) / n)
        a = ADVANTAGES[row]
        clipped_tokens += n * ((a > 0 and s > 1 + eps_high) or (a < 0 and s < 1 - eps_low))
    assert metrics["pg_clipfrac"] == pytest.approx(clipped_tokens / sum(LENGTHS), abs=1e-12)
    if spread > 0.1:
        assert 0 < clipped_tokens < sum(LENGTHS)  # both branches taken


def test_gspo_micro_batches_with_the_global_sequence_count_sum_to_the_whole():
    logp, old, mask, adv, replay = make_batch(2)
    whole, whole_grad, _ = loss_and_grad("gspo", logp, old, mask, adv, replay)
    total, grads = 0.0, []
    for rows in ([0, 1, 2], [3, 4, 5]):
        part, grad, _ = loss_and_grad("gspo", logp, old, mask, adv, replay,
                                      Normaliser(global_num_sequences=6.0), rows)
        total += part
        grads.append(grad)
    assert total == pytest.approx(whole, abs=1e-13)
    torch.testing.assert_close(grads[0] + grads[1], whole_grad, atol=1e-13, rtol=0)


def test_gspo_weighs_every_sequence_alike_whatever_its_length():
    """At ratio 1 the gradient of a token is -A_i / (G |y_i|): a sequence's tokens share 1/G."""
    _, old, mask, adv, replay = make_batch(3)
    logp = old.clone().requires_grad_(True)
    _, grad, _ = loss_and_grad("gspo", logp, old, mask, adv, replay)
    for row, n in enumerate(LENGTHS):
        assert grad[row, :n].sum().item() == pytest.approx(-ADVANTAGES[row] / len(LENGTHS),
                                                           abs=1e-14)
        assert grad[row, n:].abs().max().item() == 0


# ---------------------------------------------------------------- CISPO

@pytest.mark.parametrize("eps_low", [None, 0.2])
def test_cispo_matches_its_formula_and_keeps_the_clipped_tokens_gradient(eps_low):
    logp, old, mask, adv, replay = make_batch(4, spread=0.5)
    eps_high = 0.28
    value, grad, metrics = loss_and_grad("cispo", logp, old, mask, adv, replay,
                                         clip_low=eps_low, clip_high=eps_high)
    tokens = sum(LENGTHS)
    ref_value, clipped = 0.0, 0
    for row, n in enumerate(LENGTHS):
        for t in range(n):
            r = math.exp(logp[row, t].item() - old[row, t].item())
            lower = 0.0 if eps_low is None else 1 - eps_low
            w = min(max(r, lower), 1 + eps_high)
            clipped += (r > 1 + eps_high) or (eps_low is not None and r < 1 - eps_low)
            ref_value += -w * ADVANTAGES[row] * logp[row, t].item() / tokens
            # MiniMax-M1 eq. (4): the gradient is sg(w) A grad log pi for every token
            assert grad[row, t].item() == pytest.approx(-w * ADVANTAGES[row] / tokens,
                                                        abs=1e-15)
        assert grad[row, n:].abs().max().item() == 0
    assert value == pytest.approx(ref_value, abs=1e-13)
    assert metrics["pg_clipfrac"] == pytest.approx(clipped / tokens, abs=1e-12)
    assert clipped > 0
    # the dapo clip would zero those tokens' gradients
    _, dapo_grad, _ = loss_and_grad("dapo", logp, old, mask, adv, replay)
    assert (dapo_grad == 0).logical_and(mask > 0).sum() > 0
    assert ((grad == 0) & (mask > 0)).sum() == 0


# ---------------------------------------------------------------- Dr. GRPO and RLOO

def test_dr_grpo_and_rloo_advantages_match_their_formulas_over_mixed_groups():
    rewards = [1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 0.5, 1.0, -1.0, -1.0, 1.0]
    groups = [0, 0, 0, 0, 1, 1, 1, 2, 3, 3, 3]  # group 2 has one response; replays included
    values = torch.tensor(rewards, dtype=torch.float64)
    dr = estimator_from_config(AlgoConfig(advantage="dr_grpo"))(values, groups)
    rloo = estimator_from_config(AlgoConfig(advantage="rloo"))(values, groups)
    for i, (r, g) in enumerate(zip(rewards, groups)):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == g]
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == g and j != i]
        expected_dr = r - sum(members) / len(members) if len(members) > 1 else 0.0
        expected_rloo = r - sum(others) / len(others) if others else 0.0
        assert dr[i].item() == pytest.approx(expected_dr, abs=1e-15)
        assert rloo[i].item() == pytest.approx(expected_rloo, abs=1e-15)
    grpo = estimator_from_config(AlgoConfig())(values, groups)
    assert not torch.allclose(grpo, dr)  # the default divides by the std


def test_dr_grpo_constant_length_normaliser():
    """Dr. GRPO eq. (3): 1/G sum_i 1/L_max sum_t L_it: the gradient of a token does not depend
    on its response's length, and micro-batches add up to the whole."""
    _, old, mask, adv, replay = make_batch(5)
    logp = old.clone().requires_grad_(True)
    length = 16
    whole = Normaliser("constant_length", global_num_sequences=6.0, constant_length_tokens=length)
    value, grad, _ = loss_and_grad("dapo", logp, old, mask, adv, replay, whole)
    expected = sum(-ADVANTAGES[row] * n for row, n in enumerate(LENGTHS)) / (6 * length)
    assert value == pytest.approx(expected, abs=1e-14)
    for row, n in enumerate(LENGTHS):  # at ratio 1: d/dlogp of -A r is -A
        torch.testing.assert_close(grad[row, :n], torch.full((n,), -ADVANTAGES[row] / (6 * length),
                                                             dtype=torch.float64))
    parts = sum(loss_and_grad("dapo", logp, old, mask, adv, replay, whole, rows)[0]
                for rows in ([0, 1], [2, 3, 4, 5]))
    assert parts == pytest.approx(value, abs=1e-14)


# ---------------------------------------------------------------- KL, importance-weighted k3

def exact_kl_gradients(estimator: str):
    """On a 5-token categorical: the expected gradient over samples of pi_old of the penalty
    ``estimator``, and the exact gradient of KL(pi_theta || pi_ref), both in float64."""
    theta = torch.tensor([0.3, -1.2, 0.8, 0.1, -0.4], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([0.9, -0.2, 0.1, -0.7, 0.0], dtype=torch.float64).log_softmax(0)
    ref = torch.tensor([-0.5, 0.4, 0.6, -1.0, 0.2], dtype=torch.float64).log_softmax(0)
    logp = theta.log_softmax(0)
    penalty = kl_penalty(logp, ref, estimator, old_logp=old)
    (expected,) = torch.autograd.grad((old.exp() * penalty).sum(), theta, retain_graph=True)
    kl = (logp.exp() * (logp - ref)).sum()
    (exact,) = torch.autograd.grad(kl, theta)
    return expected, exact


def test_importance_weighted_k3_has_the_exact_kl_gradient_off_policy():
    expected, exact = exact_kl_gradients("k3_importance_weighted")
    torch.testing.assert_close(expected, exact, atol=1e-14, rtol=0)
    plain, exact = exact_kl_gradients("k3")
    assert (plain - exact).abs().max() > 0.05  # plain k3's gradient is biased here


def test_importance_weighted_k3_equals_k3_on_policy_in_value_and_is_bounded():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -0.7]], dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3_importance_weighted", old_logp=logp),
                               kl_penalty(logp, ref, "k3"))
    far = kl_penalty(torch.tensor([0.0]), torch.tensor([-200.0]), "k3_importance_weighted",
                     old_logp=torch.tensor([-200.0]))
    assert torch.isfinite(far).all()
    with pytest.raises(ValueError, match="needs old_logp"):
        kl_penalty(logp, ref, "k3_importance_weighted")


def test_the_kl_term_uses_the_losses_aggregation():
    logp, old, mask, adv, replay = make_batch(6)
    ref = old - 0.2
    penalties = Penalties(kl_coef=0.5, kl_estimator="k3_importance_weighted")
    for name in LOSSES:
        loss = build_loss(name, penalties)
        with_kl, _ = loss(LossBatch(logp, old, adv, mask, replay, ref_logp=ref))
        without, _ = build_loss(name)(LossBatch(logp, old, adv, mask, replay, ref_logp=ref))
        kl = loss.aggregate(kl_penalty(logp, ref, "k3_importance_weighted", old_logp=old), mask,
                            Normaliser())
        assert with_kl.item() == pytest.approx(without.item() + 0.5 * kl.item(), abs=1e-13)


# ---------------------------------------------------------------- the registry and config

def test_config_choices_are_the_registries():
    hints = typing.get_type_hints(AlgoConfig)
    assert typing.get_args(hints["loss"]) == tuple(LOSSES)
    assert typing.get_args(hints["advantage"]) == tuple(ADVANTAGE_ESTIMATORS)
    for name in LOSSES:
        assert loss_from_config(AlgoConfig(loss=name)).name == name


@pytest.mark.parametrize("name", ["dapo", "gspo", "cispo"])
def test_every_declared_metric_is_computed(name):
    logp, old, mask, adv, replay = make_batch(7)
    loss = build_loss(name)
    _, metrics = loss(LossBatch(logp, old, adv, mask, replay, ref_logp=old - 0.1))
    declared = loss.metric_reductions(with_ref=True)
    assert set(declared) - {"kl"} <= set(metrics), set(declared) - set(metrics)


def test_default_loss_from_config_is_the_papers_clip():
    algo = AlgoConfig()
    loss = loss_from_config(algo, replay_clip_high=0.4)
    assert (loss.name, loss.clip_low, loss.clip_high, loss.clip_c, loss.replay_clip_high) == \
        ("dapo", algo.clip_ratio_low, algo.clip_ratio_high, algo.clip_ratio_c, 0.4)
    assert estimator_from_config(algo).name == "grpo"


def test_bad_loss_settings_are_refused_with_the_key():
    with pytest.raises(ValueError, match="algo.loss=gspo with algo.loss_agg_mode"):
        AlgoConfig(loss="gspo", loss_agg_mode="constant_length")
    with pytest.raises(ValueError, match="gspo_clip_ratio_low"):
        AlgoConfig(gspo_clip_ratio_low=1.5)
    with pytest.raises(ValueError, match="cispo_clip_ratio_low"):
        AlgoConfig(cispo_clip_ratio_low=2.0)
    with pytest.raises(ValueError, match="loss_constant_length_tokens"):
        AlgoConfig(loss_constant_length_tokens=0)
    with pytest.raises(ValueError, match="replay.clip_ratio_high with algo.loss=cispo"):
        RunConfig(algo=AlgoConfig(loss="cispo"), replay=ReplayConfig(clip_ratio_high=0.4))
    with pytest.raises(ValueError, match="algo.loss must be one of"):
        loss_from_config(types.SimpleNamespace(loss="ppo"))
