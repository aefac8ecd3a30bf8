"""The training backward's lean pieces (grpo.models.model: RMSNorm and SwiGLU's down projection as autograd
Functions that keep fewer activations): their gradients against float64 finite differences, the
whole model's gradients against transformers' on the same weights, and the bytes a Block keeps."""
import pytest
import torch
import torch.nn.functional as F
from test_model import CASES

from grpo.fit.memory import act_bytes_per_token
from grpo.models.layers import _RMSNormFn, _SwiGLUDown, rms_norm
from grpo.models.model import Transformer


def test_rms_norm_gradients_against_finite_differences():
    x = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.3 * torch.randn(7, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormFn.apply(x, w, 1e-5), (x, w))


def test_swiglu_down_gradients_against_finite_differences():
    gate = (2 * torch.randn(2, 5, 6, dtype=torch.float64)).requires_grad_()  # both sides of silu's dip
    up = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_SwiGLUDown.apply, (gate, up, w))


def test_the_functions_equal_autograd_of_the_plain_expressions():
    torch.manual_seed(0)
    x, w, g = torch.randn(3, 8, 16), torch.randn(16), torch.randn(3, 8, 16)
    gate, up, wd = torch.randn(3, 8, 32), torch.randn(3, 8, 32), torch.randn(16, 32)
    pairs = [((x, w), lambda x, w: _RMSNormFn.apply(x, w, 1e-6), lambda x, w: rms_norm(x, w, 1e-6)),
             ((gate, up, wd), _SwiGLUDown.apply, lambda a, b, c: F.linear(F.silu(a) * b, c))]
    for inputs, lean, plain in pairs:
        got = []
        for f in (lean, plain):
            leaves = [t.clone().requires_grad_() for t in inputs]
            out = f(*leaves)
            got.append((out, *torch.autograd.grad((out * g).sum(), leaves)))
        for a, b in zip(*got):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("family,overrides", CASES[::2], ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES[::2])])
def test_gradients_match_transformers(tiny_dir, family, overrides):
    """Every parameter's gradient of a loss over the logits, ours against transformers' autograd."""
    path, ref = tiny_dir(family, **overrides)
    model = Transformer.from_pretrained(path).train()
    ref.train()
    ids = torch.randint(0, ref.config.vocab_size, (2, 11))
    weights = torch.randn(2, 11, ref.config.vocab_size)  # a loss whose gradient reaches every logit unevenly
    (ref(ids).logits * weights).sum().backward()
    (model(ids) * weights).sum().backward()
    theirs = {n.removeprefix("model."): p.grad for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, theirs[name], atol=1e-4, rtol=1e-4, msg=name)


def saved_activation_bytes(model, ids) -> int:
    """Bytes of the tensors autograd keeps for the backward of one forward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def keep(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(ids)
    return sum(seen.values())


def test_a_block_keeps_fewer_activations(tiny_dir, monkeypatch):
    """The lean backward keeps neither the norms' normalized values nor silu(gate) and the product:
    2 H + 2 F floats a token and layer fewer than autograd's own graph of the same forward, and H for
    the final norm."""
    path, ref = tiny_dir("llama", num_hidden_layers=4)
    model = Transformer.from_pretrained(path).train()
    a, T = model.args, 64
    ids = torch.randint(0, a.vocab_size, (1, T))
    lean = saved_activation_bytes(model, ids)
    monkeypatch.setattr(_RMSNormFn, "apply", lambda x, w, eps: rms_norm(x, w, eps))
    monkeypatch.setattr(_SwiGLUDown, "apply", lambda g, u, w: F.linear(F.silu(g) * u, w))
    plain = saved_activation_bytes(model, ids)
    assert plain - lean == 4 * T * (a.n_layers * (2 * a.dim + 2 * a.ffn_dim) + a.dim), (plain, lean)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_memory_plan_counts_what_a_layer_keeps(tiny_dir, family):
    """grpo.fit.memory's activation bytes a token and layer, fp32: a 4-layer model keeps exactly two layers'
    worth more than a 2-layer one (q/k norms, qkv bias and GQA shapes across the three families)."""
    kept = []
    for layers in (2, 4):
        path, _ = tiny_dir(family, num_hidden_layers=layers)
        model = Transformer.from_pretrained(path).train()
        kept.append(saved_activation_bytes(model, torch.randint(0, model.args.vocab_size, (1, 64))))
    assert kept[1] - kept[0] == 2 * 64 * act_bytes_per_token(model.args, 4)


def test_bf16_gradients_are_autograds_bit_for_bit():
    """In bf16 (the GPU's FSDP compute dtype) the lean MLP's backward runs autograd's own ops on the same
    values: the same bits, not merely close ones."""
    torch.manual_seed(0)
    gate, up = torch.randn(4, 16, 64).bfloat16(), torch.randn(4, 16, 64).bfloat16()
    w, g = torch.randn(32, 64).bfloat16(), torch.randn(4, 16, 32).bfloat16()
    got = []
    for f in (_SwiGLUDown.apply, lambda a, b, c: F.linear(F.silu(a) * b, c)):
        leaves = [t.clone().requires_grad_() for t in (gate, up, w)]
        out = f(*leaves)
        got.append((out, *torch.autograd.grad(out, leaves, g)))
    for a, b in zip(*got):
        assert torch.equal(a, b)
