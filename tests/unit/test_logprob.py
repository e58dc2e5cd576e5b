"""Log-probs and entropy from (vocab-parallel) logits at TP=1, against torch's own full-vocabulary
softmax in float64, with a padded vocabulary and a temperature; the entropy kept out of autograd
unless it is a loss term."""
import pytest
import torch

from rlep_megatron.actor.logprob import vocab_parallel_logprobs

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_logprobs_and_entropy_match_a_float64_softmax(entropy_grad):
    generator = torch.Generator().manual_seed(0)
    real_vocab, padded = 13, 16
    logits = (torch.randn(3, 5, padded, generator=generator, dtype=torch.float64) * 3)
    targets = torch.randint(0, real_vocab, (3, 5), generator=generator)
    x = logits.float().requires_grad_()
    logp, entropy = vocab_parallel_logprobs(x, targets, real_vocab, temperature=0.7,
                                            with_entropy=True, entropy_grad=entropy_grad)
    reference = torch.log_softmax(logits[..., :real_vocab] / 0.7, dim=-1)
    expected_logp = reference.gather(-1, targets[..., None])[..., 0]
    expected_entropy = -(reference.exp() * reference).sum(-1)
    torch.testing.assert_close(logp.double(), expected_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), expected_entropy, rtol=0, atol=1e-5)
    assert entropy.requires_grad is entropy_grad
    logp.sum().backward()
    # d sum(logp) / d logits = (onehot - softmax) / T on the real vocabulary, 0 on padding
    expected_grad = (torch.nn.functional.one_hot(targets, padded).double()
                     - torch.nn.functional.pad(reference.exp(), (0, padded - real_vocab))) / 0.7
    torch.testing.assert_close(x.grad.double(), expected_grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 12, 1000])
def test_forward_only_logprobs_in_chunks_match_a_float64_softmax(monkeypatch, chunk_tokens,
                                                                 dtype):
    """Without autograd the log-probs and entropy are computed chunk by chunk of tokens, in
    place on a copy (the caller's logits are untouched): the same values as the float64
    softmax of the same (rounded) logits, for chunks of one token, part of a row, two rows,
    or all."""
    from rlep_megatron.actor import logprob

    real_vocab, padded = 13, 16
    monkeypatch.setattr(logprob, "NO_GRAD_CHUNK_BYTES", chunk_tokens * 4 * padded)
    generator = torch.Generator().manual_seed(1)
    # as the actor passes them: ``logits[:, :-1]`` of a padded batch (not flattenable in place)
    logits = (torch.randn(3, 6, padded, generator=generator) * 3).to(dtype)[:, :-1]
    assert not logits.is_contiguous()
    before = logits.clone()
    targets = torch.randint(0, real_vocab, (3, 5), generator=generator)
    with torch.no_grad():
        logp, entropy = vocab_parallel_logprobs(logits, targets, real_vocab, temperature=0.7,
                                                with_entropy=True)
    assert torch.equal(logits, before)
    reference = torch.log_softmax(logits[..., :real_vocab].double() / 0.7, dim=-1)
    expected_logp = reference.gather(-1, targets[..., None])[..., 0]
    expected_entropy = -(reference.exp() * reference).sum(-1)
    assert logp.shape == entropy.shape == targets.shape and logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), expected_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), expected_entropy, rtol=0, atol=1e-5)
