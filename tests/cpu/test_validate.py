"""Argument validation of the public functions: every bad input is a ValueError that names the argument,
unsupported options are NotImplementedError naming the parameter. Runs on CPU: shape/dtype checks come
before the device check, and the device check itself is exercised with CPU tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flash_attn4 import flash_attn_func, flash_attn_varlen_func, validate
from flash_attn4.fa4_kernels.arch import IMPLEMENTED, Arch

BF16 = torch.bfloat16


def qkv(b=2, sq=5, sk=7, hq=4, hk=2, d=64, dv=None, dtype=BF16, device="cpu"):
    dv = d if dv is None else dv
    return (torch.randn(b, sq, hq, d, dtype=dtype, device=device),
            torch.randn(b, sk, hk, d, dtype=dtype, device=device),
            torch.randn(b, sk, hk, dv, dtype=dtype, device=device))


def varlen_qkv(lens_q=(3, 0, 5), lens_k=(4, 2, 5), hq=4, hk=2, d=64, device="cpu"):
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=device)
    q = torch.randn(int(cu_q[-1]), hq, d, dtype=BF16, device=device)
    k = torch.randn(int(cu_k[-1]), hk, d, dtype=BF16, device=device)
    v = torch.randn(int(cu_k[-1]), hk, d, dtype=BF16, device=device)
    return q, k, v, cu_q, cu_k


@pytest.fixture
def allow_cpu(monkeypatch):
    """Let tensors on 'cpu' (and 'meta') pass the device check, to reach checks that come after it."""
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu", "meta"))


# ---- dtype ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_q_dtype(dtype):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^q has dtype .*bfloat16.*float16"):
        flash_attn_func(q.to(dtype), k, v)


@pytest.mark.parametrize("which", ["k", "v"])
def test_kv_dtype_mismatch(which):
    q, k, v = qkv()
    args = {"k": k, "v": v}
    args[which] = args[which].half()
    with pytest.raises(ValueError, match=rf"^{which} has dtype torch.float16 but q has torch.bfloat16"):
        flash_attn_func(q, args["k"], args["v"])


# ---- device ----


def test_cpu_tensors_name_the_device_and_what_is_supported():
    q, k, v = qkv()
    with pytest.raises(ValueError) as info:
        flash_attn_func(q, k, v)
    msg = str(info.value)
    assert "'cpu'" in msg and "GPU" in msg and "sm_90" in msg
    assert ("sm_100" in msg) == bool(IMPLEMENTED[Arch.SM100])  # only what has kernels is claimed


def test_cpu_tensors_varlen():
    q, k, v, cu_q, cu_k = varlen_qkv()
    with pytest.raises(ValueError, match="'cpu'"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k)


@pytest.mark.parametrize("which", ["k", "v", "learnable_sink"])
def test_mixed_devices_name_the_tensor(allow_cpu, which):
    q, k, v = qkv()
    args = {"k": k, "v": v, "learnable_sink": torch.zeros(4)}
    args[which] = args[which].to("meta")
    with pytest.raises(ValueError, match=rf"^{which} is on device 'meta' but q is on 'cpu'"):
        flash_attn_func(q, args["k"], args["v"], learnable_sink=args["learnable_sink"])


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k", "seqused_k"])
def test_mixed_devices_varlen(allow_cpu, which):
    q, k, v, cu_q, cu_k = varlen_qkv()
    args = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "seqused_k": torch.zeros(3, dtype=torch.int32)}
    args[which] = args[which].to("meta")
    with pytest.raises(ValueError, match=rf"^{which} is on device 'meta'"):
        flash_attn_varlen_func(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], max_seqlen_q=5,
                               seqused_k=args["seqused_k"])


# ---- shapes ----


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_batched_ndim(which):
    t = dict(zip("qkv", qkv()))
    t[which] = t[which][0]
    with pytest.raises(ValueError, match=rf"^{which} must be 4-D"):
        flash_attn_func(t["q"], t["k"], t["v"])


def test_batch_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="batch sizes differ"):
        flash_attn_func(q[:1], k, v)


def test_v_seqlen_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="^v must match k"):
        flash_attn_func(q, k, v[:, :3])


def test_k_head_dim_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="^k must have the head_dim of q"):
        flash_attn_func(q, k[..., :32], v)


@pytest.mark.parametrize("hq,hk", [(6, 4), (3, 2), (2, 4)])
def test_heads_not_a_multiple(hq, hk):
    q, k, v = qkv(hq=hq, hk=hk)
    with pytest.raises(ValueError, match=rf"query heads \(q.shape\[-2\] = {hq}\).*\(k.shape\[-2\] = {hk}\)"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("d", [264, 100, 4, 512])
def test_head_dim_bad(d):
    q, k, v = qkv(d=d)
    with pytest.raises(ValueError, match=rf"^head_dim \(last dim of q and k\) must be a multiple of 8 .* got {d}"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("dv", [264, 36])
def test_head_dim_v_bad(dv):
    q, k, v = qkv(dv=dv)
    with pytest.raises(ValueError, match=rf"^head_dim_v \(last dim of v\) .* got {dv}"):
        flash_attn_func(q, k, v)


def test_not_a_tensor():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="^k must be a torch.Tensor"):
        flash_attn_func(q, [1, 2], v)


# ---- varlen metadata ----


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_varlen_ndim(which):
    q, k, v, cu_q, cu_k = varlen_qkv()
    t = {"q": q, "k": k, "v": v}
    t[which] = t[which][None]
    with pytest.raises(ValueError, match=rf"^{which} must be 3-D"):
        flash_attn_varlen_func(t["q"], t["k"], t["v"], cu_q, cu_k)


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_dtype(which):
    q, k, v, cu_q, cu_k = varlen_qkv()
    args = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    args[which] = args[which].long()
    with pytest.raises(ValueError, match=rf"^{which} must have dtype torch.int32"):
        flash_attn_varlen_func(q, k, v, **args)


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_ndim(which):
    q, k, v, cu_q, cu_k = varlen_qkv()
    args = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    args[which] = args[which][None]
    with pytest.raises(ValueError, match=rf"^{which} must be 1-D"):
        flash_attn_varlen_func(q, k, v, **args)


def test_cu_seqlens_length_mismatch():
    q, k, v, cu_q, cu_k = varlen_qkv()
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must both have length batch"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k[:-1])


def test_cu_seqlens_missing():
    q, k, v, cu_q, cu_k = varlen_qkv()
    with pytest.raises(ValueError, match="^cu_seqlens_k is required"):
        flash_attn_varlen_func(q, k, v, cu_q, None)


@pytest.mark.parametrize("bad", [torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int32),
                                 torch.zeros(3, 1, dtype=torch.int32)])
def test_seqused_k(bad):
    q, k, v, cu_q, cu_k = varlen_qkv()
    with pytest.raises(ValueError, match="^seqused_k must have"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, seqused_k=bad)


@pytest.mark.parametrize("value", [-1, torch.tensor(-3), 2.5, torch.tensor([1, 2]), torch.tensor(1.0)])
def test_max_seqlen_bad(value):
    q, k, v, cu_q, cu_k = varlen_qkv()
    with pytest.raises(ValueError, match="^max_seqlen_q must be"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=value)


def test_max_seqlen_from_tensor():
    n = int(torch.randint(1, 10_000, ()))
    assert validate.as_max_seqlen("max_seqlen_q", torch.tensor(n, dtype=torch.int32)) == n
    assert validate.as_max_seqlen("max_seqlen_q", n) == n
    assert validate.as_max_seqlen("max_seqlen_q", None) is None


# ---- options ----


@pytest.mark.parametrize("window", [(-2, -1), (0, -5), (1.5, 0), "ab", (1, 2, 3)])
def test_window_size(window):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="^window_size"):
        flash_attn_func(q, k, v, window_size=window)


@pytest.mark.parametrize("softcap", [-1.0, float("inf"), float("nan"), "x"])
def test_softcap(softcap):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="^softcap must be"):
        flash_attn_func(q, k, v, softcap=softcap)


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), "x"])
def test_softmax_scale(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="^softmax_scale must be"):
        flash_attn_func(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("sink", [torch.zeros(3), torch.zeros(4, 1), torch.zeros(4, dtype=torch.int32),
                                  torch.zeros(4, dtype=torch.float64)])
def test_learnable_sink(sink):
    q, k, v = qkv(hq=4)
    with pytest.raises(ValueError, match="^learnable_sink must"):
        flash_attn_func(q, k, v, learnable_sink=sink)


@pytest.mark.parametrize("causal", ["yes", "no", 2, None, 0.5])
def test_causal_must_be_bool(causal):
    with pytest.raises(TypeError, match="^causal must be a bool"):
        validate.canonical_mask(causal, -1, -1)


@pytest.mark.parametrize("value,expected", [(True, True), (False, False), (np.bool_(True), True),
                                            (np.bool_(False), False), (torch.tensor(True), True),
                                            (torch.tensor([False]), False), (1, True), (0, False)])
def test_flags_accept_python_numpy_and_torch_booleans(value, expected):
    assert validate.check_flag("causal", value) is expected
    assert validate.canonical_mask(value, -1, -1)[0] is expected


@pytest.mark.parametrize("name", ["deterministic", "return_lse"])
@pytest.mark.parametrize("value", ["no", "False", None, 2, torch.tensor([True, False])])
def test_boolean_options_of_the_public_functions_reject_other_types(name, value):
    """deterministic="no" used to mean True (Python truthiness): now a TypeError naming the option,
    before any other check (these tensors are on the CPU)."""
    q, k, v = qkv()
    with pytest.raises(TypeError, match=f"^{name} must be a bool"):
        flash_attn_func(q, k, v, **{name: value})
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(TypeError, match=f"^{name} must be a bool"):
        flash_attn_varlen_func(q[0], k[0], v[0], cu, torch.tensor([0, 7], dtype=torch.int32), **{name: value})


def test_causal_accepts_0_and_1():
    assert validate.canonical_mask(1, -1, -1) == (True, False, -1, 0)
    assert validate.canonical_mask(0, -1, -1) == (False, False, -1, -1)


# ---- unsupported options: NotImplementedError naming the parameter ----


@pytest.mark.parametrize("kwargs,name", [
    ({"dropout_p": 0.1}, "dropout_p"),
    ({"alibi_slopes": torch.zeros(4)}, "alibi_slopes"),
    ({"return_attn_probs": True}, "return_attn_probs"),
])
def test_unsupported_batched(kwargs, name):
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match=name):
        flash_attn_func(q, k, v, **kwargs)


@pytest.mark.parametrize("seqused_q,grad,exc,match", [
    (torch.zeros(3, dtype=torch.int64), False, ValueError, "seqused_q must have dtype torch.int32"),
    (torch.zeros(2, dtype=torch.int32), False, ValueError, r"seqused_q must have shape \(batch,\)"),
    (torch.zeros(3, dtype=torch.int32), True, NotImplementedError, "no backward with seqused_q"),
])
def test_seqused_q_checks(seqused_q, grad, exc, match):
    """seqused_q: int32 (batch,), and forward only (the backward has no per-sequence query lengths)."""
    q, k, v, cu_q, cu_k = varlen_qkv()
    with pytest.raises(exc, match=match):
        flash_attn_varlen_func(q.requires_grad_(grad), k, v, cu_q, cu_k, seqused_q=seqused_q)


def test_padded_batch_with_seqused_k_only_is_forward_only():
    q, k, v = (torch.randn(2, 5, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(NotImplementedError, match="seqused_k without cu_seqlens_k"):
        flash_attn_varlen_func(q.requires_grad_(), k, v, None, None, seqused_k=torch.ones(2, dtype=torch.int32))


# ---- mask canonical form ----


@pytest.mark.parametrize("causal,window,expected", [
    (False, (-1, -1), (False, False, -1, -1)),
    (True, (-1, -1), (True, False, -1, 0)),
    (False, (-1, 0), (True, False, -1, 0)),
    (True, (-1, 7), (True, False, -1, 0)),      # causal overrides the right side
    (True, (16, -1), (False, True, 16, 0)),     # causal + left window = local
    (False, (16, 4), (False, True, 16, 4)),
    (False, (-1, 3), (False, True, -1, 3)),
    (False, (0, -1), (False, True, 0, -1)),
])
def test_canonical_mask(causal, window, expected):
    assert validate.canonical_mask(causal, *validate.check_window_size(window)) == expected


def test_window_none_means_unbounded():
    assert validate.check_window_size(None) == (-1, -1)
    assert validate.check_window_size((None, 5)) == (-1, 5)


# ---- layout fixes (real tensors, inside the op) ----


def test_kernel_layout_keeps_good_tensors():
    q = torch.randn(2, 9, 4, 64, dtype=BF16)
    assert validate.kernel_layout(q) is q
    # a slice of a fused qkv projection: strides are multiples of 8 elements, pointer offset 128 B
    qkv_fused = torch.randn(2, 9, 3, 4, 64, dtype=BF16)
    k = qkv_fused[:, :, 1]
    assert not k.is_contiguous()
    assert validate.kernel_layout(k) is k


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 9, 64, 4, dtype=BF16).transpose(-1, -2),   # last dim not unit-stride
    lambda: torch.randn(2, 9, 4, 68, dtype=BF16)[..., :64],            # row stride 68: not 16-byte multiple
    lambda: torch.randn(2 * 9 * 4 * 64 + 1, dtype=BF16)[1:].view(2, 9, 4, 64),  # pointer off by 2 bytes
])
def test_kernel_layout_copies_bad_tensors(make):
    t = make()
    assert validate.needs_copy(t)
    fixed = validate.kernel_layout(t)
    assert fixed is not t and fixed.is_contiguous() and fixed.data_ptr() % 16 == 0
    assert torch.equal(fixed, t)
    assert not validate.needs_copy(fixed)


def test_empty_tensors_are_never_copied():
    for t in (torch.randn(0, 9, 4, 64, dtype=BF16), torch.randn(2, 0, 64, 4, dtype=BF16).transpose(-1, -2),
              torch.randn(2, 9, 0, 68, dtype=BF16)[..., :64]):
        assert t.numel() == 0 and not validate.needs_copy(t)
        assert validate.kernel_layout(t) is t


def test_varlen_value_check_accepts_good_metadata():
    lens_q = torch.randint(0, 50, (5,))
    lens_k = torch.randint(0, 50, (5,))
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), lens_q.cumsum(0)]).int()
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), lens_k.cumsum(0)]).int()
    used = (lens_k * torch.rand(5)).int()
    validate.check_varlen_values(cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]), int(lens_q.max()), used)


@pytest.mark.parametrize("case,needle", [
    ("start", "cu_seqlens_q[0] must be 0"),
    ("decreasing", "cu_seqlens_k must be non-decreasing"),
    ("total", "cu_seqlens_q[-1] must equal"),
    ("max_seqlen", "max_seqlen_q"),
    ("seqused", "seqused_k[i] must be <="),
])
def test_varlen_value_check_rejects(case, needle):
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    total_q, total_k, max_q, used = 8, 11, 5, None
    if case == "start":
        cu_q = torch.tensor([1, 3, 3, 8], dtype=torch.int32)
    elif case == "decreasing":
        cu_k = torch.tensor([0, 6, 4, 11], dtype=torch.int32)
    elif case == "total":
        total_q = 9
    elif case == "max_seqlen":
        max_q = 4
    else:
        used = torch.tensor([4, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        validate.check_varlen_values(cu_q, cu_k, total_q, total_k, max_q, used)


def test_float32_inputs_say_what_to_do():
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"q has dtype torch.float32.*load it in bfloat16 or float16"):
        flash_attn_func(q, k, v)


def test_the_package_docstring_names_a_register_call_that_works():
    """The docstring's way to register with transformers works without the submodule imported before."""
    import flash_attn4

    assert "from flash_attn4 import transformers_adapter; transformers_adapter.register()" in " ".join(
        flash_attn4.__doc__.split())
    from flash_attn4 import transformers_adapter

    assert callable(transformers_adapter.register)
