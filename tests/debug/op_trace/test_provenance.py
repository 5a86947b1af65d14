"""Provenance in op tracing: a -inf that is neutralised is never reported, however it was built;
a harmful NaN/Inf is reported where it was born, with the Inf a NaN was made from, in forward
and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from stabletrain.debug.op_trace import OpTracer, trace_first_nonfinite


class NegInfSpy(TorchDispatchMode):
    """Counts the ops whose output holds -inf: proof that a test's model really builds -inf masks."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.is_floating_point() and bool(torch.isneginf(out).any()):
            self.ops.append(func.__name__.split(".")[0])
        return out


def _gpt2(attn="sdpa"):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, attn_pdrop=0.0,
                                  embd_pdrop=0.0, resid_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _padded_tokens():
    ids = torch.randint(1, 64, (3, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[0, 6:] = 0
    mask[2, 3:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def test_hf_sdpa_mask_is_not_blamed_for_an_overflow_in_a_later_mlp():
    """Issue 15: the SDPA causal mask (scalar_tensor(-inf), then where) flows through an add in
    the first attention layer; the overflow planted in layer 1's MLP is what is reported."""
    model = _gpt2()
    ids, mask, labels = _padded_tokens()
    with NegInfSpy() as spy:
        assert torch.isfinite(model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert {"scalar_tensor", "where"} <= set(spy.ops), "the model builds its mask with -inf"
    step = lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss  # noqa: E731
    assert trace_first_nonfinite(model, step)[0] is None

    with torch.no_grad():
        w = model.transformer.h[1].mlp.c_fc.weight
        w.div_(w.abs().max()).mul_(3e38)
    f, loss = trace_first_nonfinite(model, step)
    assert not torch.isfinite(loss)
    assert (f.op, f.module, f.module_type) == ("aten.addmm.default", "transformer.h.1.mlp.c_fc", "Conv1D")
    assert f.phase == "forward"
    assert f.origin == "op" and not f.inputs_nonfinite and f.reached == "loss" and f.rows == [0, 1, 2]


class BufferMasked(nn.Module):
    """Causal attention whose -inf mask is a buffer registered in __init__ (never traced)."""

    def __init__(self, n=5, dim=4):
        super().__init__()
        torch.manual_seed(0)
        self.qk = nn.Linear(dim, dim)
        self.register_buffer("mask", torch.full((n, n), float("-inf")).triu(1))

    def forward(self, x):
        scores = self.qk(x) @ x.transpose(-1, -2) + self.mask
        return scores.softmax(-1) @ x


def test_minus_inf_buffer_from_init_is_not_blamed_until_a_row_is_masked_everywhere():
    model = BufferMasked()
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(2))
    f, loss = trace_first_nonfinite(model, lambda: model(x).pow(2).mean())
    assert f is None and torch.isfinite(loss), "forward and backward"

    with torch.no_grad():
        model.mask[3] = float("-inf")  # query 3 may attend to nothing
    f, loss = trace_first_nonfinite(model, lambda: model(x).pow(2).mean())
    assert (f.op, f.module, f.phase, f.kind, f.origin) == ("aten._softmax.default", "", "forward", "NaN", "inf")
    assert f.cause.origin == "buffer" and f.cause.input_name == "mask" and f.cause.deliberate
    assert f.chain().startswith("NaN born in _softmax in <root> (BufferMasked), forward, from -Inf already in the "
                                "buffer mask, first used by add in <root> (BufferMasked)")
    assert f.rows == [0, 1], "every sample has the masked row"


def test_finfo_min_mask_overflowing_in_float16_is_neutralised():
    """Eager attention adds torch.finfo(float16).min: with negative scores the sum overflows to
    -inf in float16. The softmax takes it back to 0: nothing to report; a real overflow is."""

    class Eager(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.qk = nn.Linear(8, 8)
            self.fc = nn.Linear(8, 8)

        def forward(self, x, keep):
            scores = self.qk(x) @ x.transpose(-1, -2)
            scores = scores + (1 - keep[:, None, :]) * torch.finfo(x.dtype).min
            return self.fc(scores.softmax(-1) @ x)

    model = Eager().half()
    x = (torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(3)) * 8).half()
    keep = torch.ones(2, 6, dtype=torch.float16)
    keep[1, 4:] = 0
    with NegInfSpy() as spy:
        model(x, keep)
    assert "add" in spy.ops, "float16 overflows finfo.min + a negative score to -inf"
    f, loss = trace_first_nonfinite(model, lambda: model(x, keep).float().pow(2).mean())
    assert f is None and torch.isfinite(loss)

    with torch.no_grad():
        model.fc.weight.mul_(1e4)  # float16 overflows at 65504
    f, _ = trace_first_nonfinite(model, lambda: model(x, keep).float().pow(2).mean())
    assert f.module == "fc" and f.origin == "op" and f.dtype == "float16" and f.op_name == "addmm"


def test_float_masks_of_torch_attention_modules_are_not_blamed():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(4))
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    padding = torch.zeros(3, 5).masked_fill(torch.tensor([[0, 0, 0, 1, 1], [0] * 5, [0, 0, 0, 0, 1]]).bool(),
                                            float("-inf"))
    model = nn.ModuleDict({"layer": layer, "mha": mha})

    def loss():
        h = layer(x, src_mask=causal, src_key_padding_mask=padding)
        out, weights = mha(h, h, h, attn_mask=causal, key_padding_mask=padding)
        return out.pow(2).mean() + weights.sum()

    with NegInfSpy() as spy:
        loss()
    assert spy.ops, "the masks carry -inf through the modules"
    f, value = trace_first_nonfinite(model, loss)
    assert f is None and torch.isfinite(value)


class Pooling(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pool = nn.MultiheadAttention(8, 2, batch_first=True)
        self.query = nn.Parameter(torch.randn(1, 1, 8))

    def forward(self, h, pad):
        out, _ = self.pool(self.query.expand(len(h), -1, -1), h, h, key_padding_mask=pad)
        return out


def test_nan_from_a_fully_masked_row_names_the_softmax_the_mask_and_the_sample():
    model = Pooling()
    h = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(5))
    pad = torch.zeros(4, 5, dtype=torch.bool)
    pad[0, 3:] = True
    pad[2] = True  # sample 2 is all padding
    with OpTracer(model) as tracer:
        tracer.watch_batch({"h": h, "pad": pad})
        loss = model(h, pad).pow(2).mean()
        tracer.check_loss(loss)
    f = tracer.finding
    assert (f.op, f.module, f.module_type) == ("aten._softmax.default", "pool", "MultiheadAttention")
    assert f.phase == "forward"
    assert f.kind == "NaN" and f.origin == "inf" and f.rows == [2] and f.reached == "loss"
    assert f.cause.written and f.cause.op_name == "masked_fill_" and f.cause.module == "pool"
    assert f.chain() == ("NaN born in _softmax in pool (MultiheadAttention), forward, from -Inf written by "
                         "masked_fill_ in pool (MultiheadAttention), forward, on row [2]")


def test_backward_nan_from_a_forward_mask_is_born_in_backward():
    """The classic: a -inf mask multiplied by a weight. The forward is finite (the softmax takes
    the -inf to 0); in backward 0 * -inf makes the weight's gradient NaN."""

    class MaskTimesWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, scores, mask):
            return (scores.masked_fill(mask, float("-inf")) * self.w).softmax(-1)

    model = MaskTimesWeight()
    scores = torch.randn(2, 4, generator=torch.Generator().manual_seed(6))
    mask = torch.tensor([[False, False, True, True], [False, True, False, False]])
    f, loss = trace_first_nonfinite(model, lambda: model(scores, mask)[:, 0].sum())
    assert torch.isfinite(loss) and not torch.isfinite(model.w.grad)
    assert (f.phase, f.kind, f.origin, f.forward_op) == ("backward", "NaN", "inf", "MulBackward0")
    assert f.reached == "gradient"
    assert f.cause.op_name == "masked_fill" and f.cause.phase == "forward" and f.cause.written


def test_forward_nan_neutralised_by_where_is_found_through_its_gradient():
    class SafeSqrt(nn.Module):
        def forward(self, x):
            return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))  # NaN for x < 0, masked away

    model = nn.Sequential(nn.Linear(3, 3), SafeSqrt())
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(7))
    f, loss = trace_first_nonfinite(model, lambda: model(x).sum())
    assert torch.isfinite(loss)
    # The gradient of where's masked branch is 0, times sqrt's infinite/NaN derivative: NaN.
    assert (f.op, f.module, f.phase, f.kind, f.reached) == ("aten.sqrt.default", "1", "forward", "NaN", "gradient")


def test_log_of_zero_is_reported_at_the_log_not_where_the_nan_follows():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(8))
    x[1] = 0.0
    f, loss = trace_first_nonfinite(model, lambda: F.softplus(model(torch.log(x.abs()))).mean(), batch=x)
    assert torch.isnan(loss) or torch.isinf(loss)
    assert (f.op, f.kind, f.origin, f.outside_forward, f.rows) == ("aten.log.default", "-Inf", "op", True, [1])
