"""rollplex_trl.torch_compat: the version guard, and every torch private it wraps still exists and behaves as the
package relies on (a torch upgrade that changes one fails here, not deep inside the memory or attention code)."""

import pytest
import torch

from rollplex_trl import torch_compat


def test_the_installed_torch_is_supported():
    torch_compat.check_torch_version()
    torch_compat.check_torch_version("2.14.1+cu130")
    with pytest.raises(ImportError, match="torch >=2.9,<3; found 3.0.0"):
        torch_compat.check_torch_version("3.0.0")
    with pytest.raises(ImportError, match="found 2.8.0"):
        torch_compat.check_torch_version("2.8.0")


def test_storage_key_identifies_the_storage_behind_every_view():
    a = torch.zeros(4, 3)
    b = torch.zeros(4, 3)
    view = a[1:].t()
    assert isinstance(torch_compat.storage_key(a.untyped_storage()), int)
    # a fresh UntypedStorage object per call, the same key
    assert torch_compat.storage_key(a.untyped_storage()) == torch_compat.storage_key(view.untyped_storage())
    assert torch_compat.tensor_storage_key(view) == torch_compat.tensor_storage_key(a)
    assert torch_compat.tensor_storage_key(a) != torch_compat.tensor_storage_key(b)
    # resizing to 0 and back (what the residency code does) keeps the identity
    key = torch_compat.tensor_storage_key(a)
    storage = a.untyped_storage()
    n = storage.nbytes()
    storage.resize_(0)
    storage.resize_(n)
    assert torch_compat.tensor_storage_key(a) == key


def test_tensor_version_counts_in_place_writes_of_the_tensor_and_its_views():
    p = torch.nn.Parameter(torch.zeros(3))
    v0 = torch_compat.tensor_version(p)
    assert isinstance(v0, int)
    assert torch_compat.tensor_version(p) == v0  # reading does not bump it
    with torch.no_grad():
        p.add_(1)
    v1 = torch_compat.tensor_version(p)
    assert v1 > v0
    with torch.no_grad():
        p[1:].mul_(2)  # through a view
    assert torch_compat.tensor_version(p) > v1
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones(3)
    before = torch_compat.tensor_version(p)
    opt.step()  # optimizers write in place too
    assert torch_compat.tensor_version(p) > before


def test_foreach_copy_and_add_convert_dtypes_in_place():
    dsts = [torch.zeros(2, dtype=torch.bfloat16), torch.zeros(3)]
    srcs = [torch.tensor([1.5, 2.0]), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)]
    torch_compat.foreach_copy_(dsts, srcs)
    assert dsts[0].dtype == torch.bfloat16 and dsts[0].tolist() == [1.5, 2.0]
    assert dsts[1].tolist() == [1.0, 2.0, 3.0]
    torch_compat.foreach_add_(dsts, [torch.ones(2, dtype=torch.bfloat16), torch.ones(3)])
    assert dsts[0].tolist() == [2.5, 3.0] and dsts[1].tolist() == [2.0, 3.0, 4.0]


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_flash_attention_returns_the_output_and_the_log_sum_exp(causal):
    torch.manual_seed(0)
    B, H, Q, K, D = 2, 3, 5, 5, 8
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float32) for n in (Q, K, K))
    keep = torch.rand(B, 1, Q, K) > 0.3
    keep[..., 0] = True
    bias = None if causal else torch.zeros(B, 1, Q, K).masked_fill(~keep, float("-inf"))
    scale = 0.3
    out, lse = torch_compat.cpu_flash_attention(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(Q, K, dtype=torch.bool).triu(1), float("-inf"))
    else:
        scores = scores + bias
    assert out.shape == (B, H, Q, D) and lse.shape == (B, H, Q) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, torch.matmul(torch.softmax(scores, dim=-1), v), atol=1e-5, rtol=1e-5)


def test_cpu_flash_attention_backward_gives_the_gradients_of_softmax_attention():
    torch.manual_seed(1)
    B, H, Q, D = 1, 2, 4, 8
    q, k, v = (torch.randn(B, H, Q, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    scale = D ** -0.5
    out, lse = torch_compat.cpu_flash_attention(q.detach(), k.detach(), v.detach(), 0.0, True, scale=scale)
    grad_out = torch.randn_like(out)
    dq, dk, dv = torch_compat.cpu_flash_attention_backward(grad_out, q.detach(), k.detach(), v.detach(), out, lse,
                                                           0.0, True, scale=scale)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    expected.backward(grad_out)
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want)
