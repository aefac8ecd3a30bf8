"""grpo/models/deltanet.py's gated delta rule and causal convolution: the chunked form against the token-by-token
recurrence for every chunk size and split point, and the conv window carried across a split."""
import pytest
import torch

from grpo.models.deltanet import causal_conv1d, gated_delta_chunked, gated_delta_recurrent, l2_normalize


def delta_inputs(B=2, T=37, H=3, Dk=8, Dv=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, T, H, Dk, generator=g)) * Dk ** -0.5
    k = l2_normalize(torch.randn(B, T, H, Dk, generator=g))
    v = torch.randn(B, T, H, Dv, generator=g)
    decay = -torch.rand(B, T, H, generator=g) * 3  # from no decay to e^-3 a token
    beta = torch.rand(B, T, H, generator=g)
    state = torch.randn(B, H, Dk, Dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("chunk", [1, 2, 5, 16, 64])
@pytest.mark.parametrize("split", [0, 1, 17, 36, 37])
def test_chunked_equals_recurrent(chunk, split):
    """Any chunk size, and a sequence cut anywhere and continued from the state at the cut, give the
    token-by-token recurrence's outputs and final state."""
    q, k, v, g, beta, state = delta_inputs()
    o_ref, s_ref = gated_delta_recurrent(q, k, v, g, beta, state)
    cut = lambda t, a, b: t[:, a:b]  # noqa: E731
    o1, s1 = gated_delta_chunked(*(cut(t, 0, split) for t in (q, k, v, g, beta)), state=state, chunk_size=chunk)
    o2, s2 = gated_delta_chunked(*(cut(t, split, None) for t in (q, k, v, g, beta)), state=s1, chunk_size=chunk)
    # fp32: the chunked form's triangular solve sums in another order than the recurrence
    torch.testing.assert_close(torch.cat([o1, o2], 1), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s2, s_ref, atol=1e-5, rtol=1e-5)


def test_chunked_from_zero_state_and_padding():
    q, k, v, g, beta, _ = delta_inputs(T=9)
    o_ref, s_ref = gated_delta_recurrent(q, k, v, g, beta)
    o, s = gated_delta_chunked(q, k, v, g, beta, chunk_size=4)  # 9 = 4 + 4 + 1 (+3 padding)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", [1, 2, 3, 7, 9])
def test_conv_window_continues(split):
    """The convolution run in two parts, the second from the first's window, equals one run; a row's
    window with `lengths` is the one after its last real token."""
    x, w = torch.randn(2, 10, 6), torch.randn(6, 4)
    full, last = causal_conv1d(x, w)
    a, window = causal_conv1d(x[:, :split], w)
    b, window = causal_conv1d(x[:, split:], w, window)
    torch.testing.assert_close(torch.cat([a, b], 1), full)
    torch.testing.assert_close(window, last)
    _, cut = causal_conv1d(x, w, lengths=torch.tensor([split, 10]))
    torch.testing.assert_close(cut[0], causal_conv1d(x[:1, :split], w)[1][0])
    torch.testing.assert_close(cut[1], last[1])
