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


@pytest.mark.parametrize("chunk_tokens", [1, 4, 1000])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.3])
def test_chunked_output_layer_logprobs_match_float64_autograd(chunk_tokens, entropy_coef):
    """The output layer applied chunk by chunk with an analytic backward (logits recomputed per
    chunk): log-probs, entropy and the gradients of the hidden states and of the weight equal
    float64 autograd through the full logits (padded vocabulary, temperature), for chunks of one
    token, of part of the batch, and of all of it; the entropy is a loss term or not."""
    from rlep_megatron.actor.logprob import output_layer_logprobs

    generator = torch.Generator().manual_seed(2)
    real_vocab, padded, width = 13, 16, 8
    hidden64 = torch.randn(3, 5, width, generator=generator, dtype=torch.float64)
    weight64 = torch.randn(padded, width, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, real_vocab, (3, 5), generator=generator)
    upstream = torch.randn(3, 5, generator=generator, dtype=torch.float64)

    hidden = hidden64.float().requires_grad_()
    weight = weight64.float().requires_grad_()
    logp, entropy = output_layer_logprobs(hidden, weight, targets, real_vocab, temperature=0.7,
                                          with_entropy=True, entropy_grad=entropy_coef != 0,
                                          chunk_tokens=chunk_tokens)
    assert entropy.requires_grad is (entropy_coef != 0)
    loss = (logp * upstream.float()).sum() + (entropy_coef * entropy.sum() if entropy_coef
                                              else 0.0)
    loss.backward()

    h, w = hidden64.clone().requires_grad_(), weight64.clone().requires_grad_()
    reference = torch.log_softmax((h @ w.T)[..., :real_vocab] / 0.7, dim=-1)
    expected_logp = reference.gather(-1, targets[..., None])[..., 0]
    expected_entropy = -(reference.exp() * reference).sum(-1)
    ((expected_logp * upstream).sum() + entropy_coef * expected_entropy.sum()).backward()
    torch.testing.assert_close(logp.double(), expected_logp.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), expected_entropy.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden.grad.double(), h.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w.grad, rtol=0, atol=1e-5)
    assert w.grad[real_vocab:].abs().max() == 0 and weight.grad[real_vocab:].abs().max() == 0


def test_chunked_output_layer_logprobs_equal_the_full_logits_path():
    """In float32, chunked (3 tokens at a time) and full logits agree within float rounding in
    values and gradients, with and without autograd."""
    from rlep_megatron.actor.logprob import output_layer_logprobs

    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 7, 16, generator=generator).requires_grad_()
    weight = (torch.randn(40, 16, generator=generator) * 0.5).requires_grad_()
    targets = torch.randint(0, 37, (2, 7), generator=generator)
    logp, entropy = output_layer_logprobs(hidden, weight, targets, 37, with_entropy=True,
                                          chunk_tokens=3)
    (logp.sum() + 0.1 * entropy.sum()).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    full_logp, full_entropy = vocab_parallel_logprobs(hidden @ weight.T, targets, 37,
                                                      with_entropy=True)
    (full_logp.sum() + 0.1 * full_entropy.sum()).backward()
    torch.testing.assert_close(logp, full_logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, full_entropy, rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[1], weight.grad, rtol=0, atol=1e-6)
    with torch.no_grad():
        again, _ = output_layer_logprobs(hidden, weight, targets, 37, chunk_tokens=3)
    assert torch.equal(again, logp.detach())
