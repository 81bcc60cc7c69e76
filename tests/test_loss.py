import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from memo.loss import IGNORE_INDEX, chunked_cross_entropy


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_loss_and_grads_match_full_logits_cross_entropy(chunk):
    hidden = torch.randn(2, 19, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 19))
    labels[0, 5:9] = IGNORE_INDEX
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
        chunked_cross_entropy(torch.randn(1, 4, 8), torch.randn(10, 8), torch.full((1, 4), IGNORE_INDEX))


class MatmulDtypes(TorchDispatchMode):
    """Records the input dtypes of every matrix product."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


def test_bf16_loss_runs_no_fp32_matmul_and_keeps_fp32_accuracy_of_the_head_gradient():
    """The head's weight gradient is the largest matmul of the loss: bf16 inputs, fp32 accumulation."""
    hidden = torch.randn(1, 64, 32, requires_grad=True)
    weight = torch.randn(100, 32, requires_grad=True)
    labels = torch.randint(0, 100, (1, 64))
    h16, w16 = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight))
    with MatmulDtypes() as mode:
        chunked_cross_entropy(h16, w16, labels, 16).backward()
    assert mode.seen and all(torch.float32 not in dtypes for dtypes in mode.seen), mode.seen
    chunked_cross_entropy(hidden, weight, labels, 16).backward()
    torch.testing.assert_close(w16.grad.float(), weight.grad, rtol=0.02, atol=2e-3)
