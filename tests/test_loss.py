import pytest
import torch
import torch.nn.functional as F

from memo.loss import chunked_cross_entropy


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_loss_and_grads_match_full_logits_cross_entropy(chunk):
    hidden = torch.randn(2, 19, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 19))
    labels[0, 5:9] = -100
    loss = chunked_cross_entropy(hidden, weight, labels, chunk)
    (loss * 3).backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logits = h2 @ w2.t()
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1))
    (ref * 3).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(hidden.grad, h2.grad)
    torch.testing.assert_close(weight.grad, w2.grad)


def test_all_ignored_labels_is_a_clear_error():
    with pytest.raises(ValueError, match="no target tokens"):
        chunked_cross_entropy(torch.randn(1, 4, 8), torch.randn(10, 8), torch.full((1, 4), -100))
