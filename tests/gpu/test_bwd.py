"""Backward correctness on a real GPU: dq, dk, dv (and d learnable_sink) from autograd through the public
functions, against autograd through tests/reference.py, by FlashAttention's rule

    max|grad - grad_ref| <= 2 * max|grad_pt - grad_ref| + atol

grad_ref: gradients of the float32 reference (upcast=True) on float32 copies of the inputs, with the
incoming gradient in float32; grad_pt: the same reference run in the input precision (upcast=False), the
error a plain low-precision implementation makes. atol is twice the error of rounding the exact gradient
to the gradient's dtype (no kernel can beat the rounding of its own output) plus a tiny slack.

Inputs and incoming gradients are fresh random tensors (never zeros) on every run; the seed is printed
for reruns.

Before each backward the caching allocator is handed NaN-filled blocks of the gradients' sizes
(``scribble_free_memory``), so that a kernel leaving part of a gradient unwritten most likely shows NaN
instead of passing on zeros or a previous run's correct values (best effort: the allocator is not
obliged to hand the same blocks back).

What the backward supports (head dims that are multiples of 8 from 16 to 256, equal or not;
bf16/fp16, causal, local windows, GQA/MQA, softcap, learnable_sink, varlen with seqused_k, sq != sk,
deterministic, gradients through the returned lse) must pass: a NotImplementedError is a failure.
What it refuses is listed in tests/unsupported.py (backward_refusals; tests/cpu/test_unsupported.py
keeps the list equal to the code): on a GPU without a backward kernel every test here is skipped by
tests/conftest.py; test_inference_only_inputs_refuse_the_backward checks the listed refusals of forward-only inputs
(seqused_q, a paged KV cache). On a B200 (B300) the tests run the sm100 backward compiled for sm_100a
(sm_103a), after its first-use self-check; the tests of sm90 schedule switches skip there (sm90_schedule).
"""

from __future__ import annotations


import pytest
import torch

from flash_attn4 import flash_attn_func, flash_attn_varlen_func, ops
from tests.gpu.helpers import DEVICE, HEADS, rand, random_lengths, seed_from_urandom
from tests.reference import assert_close_fa_rule, attention_ref, max_abs_diff, random_pages
from tests.unsupported import backward_refusals, refusal_pattern

pytestmark = [pytest.mark.gpu, pytest.mark.backward]



@pytest.fixture(autouse=True)
def poison_forward_outputs(monkeypatch):
    """Outputs are poisoned right after allocation (forward: NaN out, +inf lse, as in test_fwd.py;
    backward: NaN dk, dv), so that what a kernel leaves unwritten fails the comparison."""
    monkeypatch.setattr(ops, "_poison_outputs_for_tests", True)


@pytest.fixture(autouse=True)
def seed():
    return seed_from_urandom()




@pytest.fixture
def sm90_schedule():
    """For tests of Hopper schedule switches (BackwardConfig tile_m / num_stages variants,
    longest_first, exp_eighths_under_dp, sm90's dQ accumulator order): skipped on other GPUs, whose
    backward has no such switch (sm100/tiles.py check_backward raises ValueError for them)."""
    from flash_attn4 import dispatch
    from flash_attn4.fa4_kernels.arch import Arch

    arch = dispatch.arch_for_device(torch.device(DEVICE), kernel="backward")
    if arch is not Arch.SM90:
        pytest.skip(f"sm90 backward schedule switch; this GPU runs the {arch.value} backward")


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def scribble_free_memory(*like: torch.Tensor) -> None:
    """Fill blocks of the sizes the backward is about to allocate (in the tensors' dtype and in float32,
    for accumulators) with NaN and free them again."""
    junk = [torch.full(t.shape, float("nan"), dtype=dt, device=t.device)
            for t in like for dt in {t.dtype, torch.float32}]
    del junk


# ---- references and comparison ----


def reference_grads(q, k, v, dout, *, sink=None, upcast, **ref_kwargs):
    """Gradients of attention_ref w.r.t. q, k, v (and the sink when given), as a dict. upcast=True works
    on float32 copies with a float32 incoming gradient; upcast=False on copies in the input dtype."""
    if upcast:
        q, k, v, dout = q.float(), k.float(), v.float(), dout.float()
    tensors = {"dq": leaf(q), "dk": leaf(k), "dv": leaf(v)}
    if sink is not None:
        tensors["dsink"] = leaf(sink.float())
    out, _ = attention_ref(tensors["dq"], tensors["dk"], tensors["dv"], learnable_sink=tensors.get("dsink"),
                           upcast=upcast, **ref_kwargs)
    if out.requires_grad:  # else no query saw a key (random varlen lengths): every gradient is 0
        out.backward(dout)
    return {name: (t.grad if t.grad is not None else torch.zeros_like(t)) for name, t in tensors.items()}


def grad_atol(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Twice the error of rounding the exact gradient to the output dtype, plus a small slack."""
    return 2 * max_abs_diff(ref.to(dtype).float(), ref) + 1e-4 * max_abs_diff(ref, torch.zeros_like(ref)) + 1e-5


def dsink_rounding(q, k, v, dout, sink, **ref_kwargs) -> float:
    """Six standard deviations of the sink gradient's error from taking rowsum(dO * O) with O in the
    input dtype, as every FlashAttention backward does: dsink_h = -sum_rows exp(sink_h - lse) *
    rowsum(dO * O), and each element of O carries an independent rounding error, uniform within
    +-eps/2 of its size (standard deviation eps / (2 sqrt 3))."""
    out, lse = attention_ref(q.float(), k.float(), v.float(), learnable_sink=sink.float(), **ref_kwargs)
    varlen = "cu_seqlens_q" in ref_kwargs
    weight = ((dout.float() * out) ** 2).sum(-1)  # (b, sq, hq) or (total, hq)
    weight = weight.t() if varlen else weight.transpose(1, 2)  # lse's layout
    p_sink = torch.exp(sink.float()[:, None] - lse) if varlen else torch.exp(sink.float()[None, :, None] - lse)
    per_head = (p_sink ** 2 * weight).sum(-1) if varlen else (p_sink ** 2 * weight).sum((0, 2))
    return 6 * float(per_head.max().sqrt()) * torch.finfo(q.dtype).eps / (2 * 3 ** 0.5)


def with_kernel_rowsum(ref: dict, q, k, v, dout, out, *, sink=None, **ref_kwargs) -> dict:
    """The float32 reference gradients of the backward FlashAttention defines, dS = P (dP - D) with
    D = rowsum(dO * O) taken from the O the forward returned (in the input dtype), where autograd's
    softmax backward sums P dP (the exact D). D's difference delta_i moves dS_ij by -delta_i P_ij,
    the gradient of -delta_i LSE_i w.r.t. the scores, so it reaches dq and dk through the same score
    function (scale, softcap) as autograd of sum_i -delta_i LSE_i. Mostly below rounding; not where a
    row's weight sits on one or two keys but not wholly (a sink beside them): there O is near one
    V row and its rounding does not average out (the varlen sink/window test at 1-2 keys: 4 in 4,000
    seeds, 2-8 x the bf16 reference's error, against the exact D)."""
    qf, kf, out = leaf(q.float()), leaf(k.float()), out.detach()
    o_exact, lse = attention_ref(qf, kf, v.float(), learnable_sink=None if sink is None else sink.float(),
                                 **ref_kwargs)
    # A wrong O would move D with it: the shift is only for O's rounding.
    o_exact_value = o_exact.detach()
    assert max_abs_diff(out, o_exact_value) <= 1e-2 * max(1.0, o_exact_value.abs().max().item()), "forward output"
    delta = (dout.float() * (out.float() - o_exact_value)).sum(-1)  # (b, sq, hq) or (total, hq)
    delta = delta.t() if "cu_seqlens_q" in ref_kwargs else delta.transpose(1, 2)  # lse's layout
    # Rows that see nothing have lse -inf and delta 0; their NaN score gradients are masked out.
    surrogate = -(delta * torch.where(torch.isfinite(lse), lse, 0.0)).sum()
    if not surrogate.requires_grad:
        return ref
    dq, dk = torch.autograd.grad(surrogate, (qf, kf), allow_unused=True)
    shifted = dict(ref)
    for name, shift in (("dq", dq), ("dk", dk)):
        if shift is not None:
            shifted[name] = ref[name] + shift
    return shifted


def assert_grads_close(got: dict, ref: dict, pt: dict, what: str = "", extra_atol: dict | None = None) -> None:
    for name, want in ref.items():
        g = got[name]
        assert g is not None, f"{what}{name}: no gradient returned"
        assert g.shape == want.shape, f"{what}{name}: shape {tuple(g.shape)} != {tuple(want.shape)}"
        assert torch.isfinite(g).all(), f"{what}{name}: non-finite gradient (an unwritten element, or a NaN)"
        atol = grad_atol(want, g.dtype) + (extra_atol or {}).get(name, 0.0)
        assert_close_fa_rule(g, want, pt[name], atol=atol, name=f"{what}{name}")


def run_ours(fn, q, k, v, dout, *, sink=None, **kwargs):
    """Forward through fn with leaf copies of the inputs, backward with dout; returns (out, grads)."""
    tensors = {"dq": leaf(q), "dk": leaf(k), "dv": leaf(v)}
    if sink is not None:
        tensors["dsink"] = leaf(sink)
        kwargs["learnable_sink"] = tensors["dsink"]
    out = fn(tensors["dq"], tensors["dk"], tensors["dv"], **kwargs)
    assert out.shape == dout.shape
    assert torch.isfinite(out).all()
    scribble_free_memory(*tensors.values())
    out.backward(dout)
    grads = {name: t.grad for name, t in tensors.items()}
    for name, t in tensors.items():
        assert grads[name] is not None, f"{name}: no gradient"
        assert grads[name].dtype == t.dtype, f"{name}: dtype {grads[name].dtype}, input {t.dtype}"
    return out, grads


def check_batched(q, k, v, *, sink=None, dout=None, **kwargs):
    """Run our backward on batched inputs and compare every gradient with the references; returns our
    (out, grads)."""
    if dout is None:
        dout = rand(q.shape[0], q.shape[1], q.shape[2], v.shape[-1], dtype=q.dtype)
    out, got = run_ours(flash_attn_func, q, k, v, dout, sink=sink, **kwargs)
    ref = with_kernel_rowsum(reference_grads(q, k, v, dout, sink=sink, upcast=True, **kwargs), q, k, v, dout, out,
                             sink=sink, **kwargs)
    pt = reference_grads(q, k, v, dout, sink=sink, upcast=False, **kwargs)
    extra = {"dsink": dsink_rounding(q, k, v, dout, sink, **kwargs)} if sink is not None else None
    assert_grads_close(got, ref, pt, extra_atol=extra)
    return out, got


# ---- batched: the main grid ----

SEQLENS = [(128, 128), (113, 203), (300, 257), (1000, 1000), (256, 1023), (1, 300)]


def _main_grid():
    """Full grid for d=128 (36 cases); for d=64 and d=96 every (seqlens, causal) once, the head layout
    rotating over MHA/GQA/MQA (each length pair meets two layouts per d, all three over both d)."""
    cases = []
    for sq, sk in SEQLENS:
        for causal in (False, True):
            for heads in HEADS:
                cases.append((128, sq, sk, causal, heads))
    layouts = list(HEADS)
    for d in (64, 96):
        for i, (sq, sk) in enumerate(SEQLENS):
            for j, causal in enumerate((False, True)):
                cases.append((d, sq, sk, causal, layouts[(i + j + (d == 96)) % len(layouts)]))
    return cases


@pytest.mark.parametrize("d,sq,sk,causal,heads", _main_grid())
def test_backward_bf16(d, sq, sk, causal, heads):
    hq, hk = HEADS[heads]
    b = 2
    check_batched(rand(b, sq, hq, d), rand(b, sk, hk, d), rand(b, sk, hk, d), causal=causal)


@pytest.mark.parametrize("variant,d,causal,heads,sq,sk", [
    ({"num_stages": 3, "tile_m": 64}, 64, False, "gqa", 300, 257),
    ({"num_stages": 3, "tile_m": 64}, 128, True, "gqa", 300, 257),
    ({"tile_m": 64}, 64, False, "gqa", 300, 257), ({"tile_m": 64}, 64, True, "mha", 1000, 1000),
    ({"tile_m": 64}, 64, True, "mqa", 113, 203), ({"tile_m": 64}, 128, False, "gqa", 300, 257),
    ({"tile_m": 64}, 128, True, "mha", 1000, 1000), ({"tile_m": 64}, 128, True, "mqa", 113, 203)])
def test_backward_tuning_variants(sm90_schedule, monkeypatch, variant, d, causal, heads, sq, sk):
    """BackwardConfig choices other than the tiles' (bench --mode bwd --variant A/Bs their speed)
    must give the same gradients: 3 Q/dO stages (with 64-query blocks: 128 leave no shared memory for
    a third), 64-query blocks at d = 64 and at d = 128 (where the tiles pick 128 and 80)."""
    from flash_attn4 import dispatch

    chosen = dispatch.backward_config
    monkeypatch.setattr(dispatch, "backward_config", lambda *a, **k: chosen(*a, **k).replace(**variant))
    hq, hk = HEADS[heads]
    check_batched(rand(2, sq, hq, d), rand(2, sk, hk, d), rand(2, sk, hk, d), causal=causal)


@pytest.mark.parametrize("order", [{}, {"longest_first_min_group": 1, "longest_first_min_blocks": 1},
                                   {"longest_first_min_group": 10**6}], ids=["rule", "always_grouped", "launch_order"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d,heads,sq", [(128, "gqa", 1000), (64, "mha", 1000), (256, "mqa", 300), (128, "mha", 8192)])
def test_backward_longest_first_order(sm90_schedule, monkeypatch, d, heads, sq, deterministic, order):
    """BackwardConfig.longest_first (on for masks at d <= 128, sm90/tiles.py; forced on here for
    the split layout too): KV tiles in longest-first order within L2 groups of heads, the partial
    group first; where fewer than longest_first_min_group heads fit a group, or a head has fewer
    than longest_first_min_blocks KV tiles (the rule's 1000-token cases), the launch order through
    the same kernel (groups of one head; also forced by a huge minimum group). Every KV tile must
    still be computed once (dK/dV start as NaN), and the deterministic mode's dQ ordering must not
    deadlock. At 8k, d=128, MHA, a (KV head, batch) pair streams 4 MiB of Q and dO: groups of 6 of
    the 8 pairs, the partial group of 2 first (64 KV tiles a head: the rule groups them)."""
    from flash_attn4 import dispatch
    from flash_attn4.fa4_kernels.sm90 import tiles as sm90_tiles

    chosen = dispatch.backward_config
    picked = chosen(dispatch.Arch.SM90, "bfloat16", d, d, causal=True, local=False, has_softcap=False, varlen=False,
                    has_seqused_k=False, deterministic=deterministic)
    assert picked.longest_first == (d <= 128)
    fields = {"longest_first_min_group": sm90_tiles.BWD_LONGEST_FIRST_MIN_GROUP,
              "longest_first_min_blocks": sm90_tiles.BWD_LONGEST_FIRST_MIN_BLOCKS, **order}
    monkeypatch.setattr(dispatch, "backward_config", lambda *a, **k: chosen(*a, **k).replace(
        longest_first=True, **fields))
    hq, hk = HEADS[heads]
    q, k, v = rand(2, sq, hq, d), rand(2, sq, hk, d), rand(2, sq, hk, d)
    dout = rand(2, sq, hq, d)
    _, got = run_ours(flash_attn_func, q, k, v, dout, causal=True, deterministic=deterministic)
    ref = reference_grads(q, k, v, dout, upcast=True, causal=True)
    pt = reference_grads(q, k, v, dout, upcast=False, causal=True)
    assert_grads_close(got, ref, pt)


@pytest.mark.parametrize("eighths", [0, 3, 8])
@pytest.mark.parametrize("d,heads,sq,sk,kwargs", [
    (128, "gqa", 300, 257, {"causal": True}),  # 80-query blocks, masked and unmasked steps
    (64, "mha", 1000, 1000, {}),  # 128-query blocks
    (128, "mqa", 113, 515, {"window_size": (100, 7), "softcap": 30.0}),  # 64-query blocks, softcap
    (256, "gqa", 200, 150, {"causal": True}),  # the split-head-dim layout
])
def test_backward_exponentials_after_dp(sm90_schedule, monkeypatch, eighths, d, heads, sq, sk, kwargs):
    """BackwardConfig.exp_eighths_under_dp on every layout: 8 (all of P^T under dP^T's GEMM), 3
    (the 80-query blocks' default) and 0 (all after dP^T, column by column with dS^T)."""
    _with_switches(monkeypatch, {"exp_eighths_under_dp": eighths})
    hq, hk = HEADS[heads]
    check_batched(rand(2, sq, hq, d), rand(2, sk, hk, d), rand(2, sk, hk, d), **kwargs)


@pytest.mark.parametrize("eighths", [0, 3, 8])
@pytest.mark.parametrize("d,heads,sq,sk,kwargs", [
    (128, "gqa", 300, 257, {"causal": True}),  # 80-query blocks: 20 columns a thread, 5 stmatrix groups
    (64, "mha", 1000, 1000, {"causal": True}),  # 128-query blocks: 32 columns
    (64, "gqa", 1000, 1000, {}),
    (128, "mqa", 113, 515, {"window_size": (100, 7), "softcap": 30.0}),  # 64-query blocks: 16 columns
])
def test_backward_ds_store_by_group(sm90_schedule, monkeypatch, eighths, d, heads, sq, sk, kwargs):
    """BackwardConfig.ds_store_by_group: dS^T stored a stmatrix at a time as its columns are done,
    whatever share of the columns comes after dP^T (3/8 splits a stmatrix group between the two
    runs of columns at every block size); a group stored early, late or twice breaks dQ."""
    _with_switches(monkeypatch, {"exp_eighths_under_dp": eighths, "ds_store_by_group": True})
    hq, hk = HEADS[heads]
    check_batched(rand(2, sq, hq, d), rand(2, sk, hk, d), rand(2, sk, hk, d), **kwargs)


# The sm90 schedule switches (BackwardConfig; dispatch turns tma_store_dkv on where it can, the others are
# off, for A/B runs): each alone and all of them, on the layouts that take them (tma_store_dkv: batched,
# unsplit).
SCHEDULE_SWITCHES = {"sepdo": {"separate_do_barrier": True}, "bulkdq": {"dq_bulk_reduce": True},
                     "dkv": {"tma_store_dkv": True}, "onebody": {"one_step_body": True},
                     "emu3": {"exp2_emulated_eighths": 3}, "emu8": {"exp2_emulated_eighths": 8},
                     "shfl": {"query_rows_by_shuffle": True},
                     "all": {"separate_do_barrier": True, "dq_bulk_reduce": True, "tma_store_dkv": True,
                             "one_step_body": True}}
SWITCH_CASES = [
    (128, "gqa", 300, 257, {"causal": True}),  # 80-query blocks, masked and unmasked steps, keys past the end
    (64, "mha", 1000, 1000, {}),  # 128-query blocks, many KV tiles per query block
    (128, "mqa", 113, 515, {"window_size": (100, 7), "softcap": 30.0}),  # 64-query blocks, KV tiles no query sees
    (96, "gqa", 1, 203, {"causal": True}),  # one query row, most KV tiles see none
    (256, "gqa", 200, 150, {"causal": True}),  # the split-head-dim layout
]


def _with_switches(monkeypatch, fields: dict):
    from flash_attn4 import dispatch

    chosen = dispatch.backward_config
    monkeypatch.setattr(dispatch, "backward_config", lambda *a, **k: chosen(*a, **k).replace(**fields))


# tma_store_dkv is refused in the split layout (tests/cpu/test_sm90_bwd_switches.py checks the error):
# "dkv" leaves d = 256 out, and "all" runs there without it.
@pytest.mark.parametrize("switches,d,heads,sq,sk,kwargs", [
    (name, *case) for name in SCHEDULE_SWITCHES for case in SWITCH_CASES if not (name == "dkv" and case[0] > 128)])
def test_backward_schedule_switches(sm90_schedule, monkeypatch, switches, d, heads, sq, sk, kwargs):
    """BackwardConfig.separate_do_barrier (dO behind its own mbarrier), dq_bulk_reduce (dQ added by a 1-D
    bulk reduce), tma_store_dkv (dK/dV through shared memory and TMA stores), one_step_body (the
    masked step for every query block) and exp2_emulated_eighths (3/8 or all of the mask-free steps'
    exponentials as a polynomial) must give the reference's gradients; dK/dV start as NaN (the
    fixture), so a tile left unwritten fails."""
    fields = dict(SCHEDULE_SWITCHES[switches])
    if d > 128:
        fields.pop("tma_store_dkv", None)
    _with_switches(monkeypatch, fields)
    hq, hk = HEADS[heads]
    check_batched(rand(2, sq, hq, d), rand(2, sk, hk, d), rand(2, sk, hk, d), **kwargs)


@pytest.mark.parametrize("d", [64, 128])
def test_backward_schedule_switches_varlen(sm90_schedule, monkeypatch, d):
    """separate_do_barrier and dq_bulk_reduce with packed sequences (dq_accum's varlen block offsets)."""
    _with_switches(monkeypatch, {"separate_do_barrier": True, "dq_bulk_reduce": True})
    lens_q, lens_k = random_lengths(5, 300)
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 2, d)
    check_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max(lens_q), causal=True)


@pytest.mark.parametrize("d,heads,sq,sk,kwargs", [
    (64, "mha", 1000, 1000, {"causal": True}),  # 128-query blocks, dS^T stored by groups
    (64, "gqa", 777, 1000, {"window_size": (200, 50), "softcap": 20.0}),  # 128-query blocks, local, softcap
    (128, "mha", 300, 700, {}),  # 80-query blocks: the lanes past the row hold a clamped copy
])
def test_backward_query_rows_by_shuffle(sm90_schedule, monkeypatch, d, heads, sq, sk, kwargs):
    """BackwardConfig.query_rows_by_shuffle: LSE and rowsum fetched from the lane that holds them
    (sm90/fragments.py QueryRowValues); a wrong lane or register gives another query's LSE, which
    the reference's gradients catch."""
    _with_switches(monkeypatch, {"query_rows_by_shuffle": True})
    hq, hk = HEADS[heads]
    check_batched(rand(2, sq, hq, d), rand(2, sk, hk, d), rand(2, sk, hk, d), **kwargs)


@pytest.mark.parametrize("d", [64, 128])
def test_backward_query_rows_by_shuffle_varlen(sm90_schedule, monkeypatch, d):
    """query_rows_by_shuffle with packed sequences: a query block's rows past its sequence."""
    _with_switches(monkeypatch, {"query_rows_by_shuffle": True})
    lens_q, lens_k = random_lengths(5, 300)
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 2, d)
    check_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max(lens_q), causal=True)


def check_deterministic_repeats(q, k, v, dout, causal):
    """deterministic=True three times: identical bits in dq, dk and dv every time, and the
    gradients right against the reference (the suite's rule)."""
    runs = [run_ours(flash_attn_func, q, k, v, dout, causal=causal, deterministic=True)[1] for _ in range(3)]
    for name in ("dq", "dk", "dv"):
        for i in (1, 2):
            assert torch.equal(runs[0][name], runs[i][name]), f"{name}: run {i} differs from run 0"
    ref = reference_grads(q, k, v, dout, upcast=True, causal=causal)
    pt = reference_grads(q, k, v, dout, upcast=False, causal=causal)
    assert_grads_close(runs[0], ref, pt)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_schedule_switches_deterministic_is_bitwise_repeatable(sm90_schedule, monkeypatch, causal):
    """deterministic=True orders the dQ adds with the bulk reduce as with the TMA tensor reduce."""
    _with_switches(monkeypatch, {"separate_do_barrier": True, "dq_bulk_reduce": True, "tma_store_dkv": True})
    b, s, hq, hk, d = 2, 1024, 8, 2, 128
    q, k, v, dout = rand(b, s, hq, d), rand(b, s, hk, d), rand(b, s, hk, d), rand(b, s, hq, d)
    check_deterministic_repeats(q, k, v, dout, causal)


def test_backward_fp16():
    hq, hk = HEADS["gqa"]
    dt = torch.float16
    check_batched(rand(2, 300, hq, 128, dtype=dt), rand(2, 257, hk, 128, dtype=dt),
                  rand(2, 257, hk, 128, dtype=dt), causal=True)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_backward_long_sequence(causal):
    s, h, d = 4096, 2, 128
    check_batched(rand(1, s, h, d), rand(1, s, h, d), rand(1, s, h, d), causal=causal)


def test_backward_rows_without_keys_causal_sq_gt_sk():
    """Causal with sq > sk: the first sq - sk query rows see no key (out 0, lse -inf). Their dq must be 0,
    every gradient finite and matching the reference."""
    b, sq, sk, hq, hk, d = 2, 300, 77, 4, 2, 128
    out, got = check_batched(rand(b, sq, hq, d), rand(b, sk, hk, d), rand(b, sk, hk, d), causal=True)
    assert (out[:, : sq - sk] == 0).all(), "rows that see no key must give out = 0"
    assert (got["dq"][:, : sq - sk] == 0).all(), "dq of rows that see no key must be exactly 0"
    assert (got["dq"][:, sq - sk:] != 0).any()


def test_backward_softmax_scale():
    scale = float(torch.empty(()).uniform_(0.05, 0.5))
    check_batched(rand(2, 190, 6, 128), rand(2, 211, 2, 128), rand(2, 211, 2, 128), softmax_scale=scale,
                  causal=True)


# ---- options ----


@pytest.mark.parametrize("window", [(32, 0), (0, 48), (100, 7)])
@pytest.mark.parametrize("sq,sk", [(113, 203), (300, 257)])
def test_backward_local_window(window, sq, sk):
    hq, hk = HEADS["gqa"]
    check_batched(rand(2, sq, hq, 128), rand(2, sk, hk, 128), rand(2, sk, hk, 128), window_size=window)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(173, 190), (300, 257)])
@pytest.mark.parametrize("d", [64, 128])
def test_backward_softcap(causal, sq, sk, d):
    # q scaled up so that the cap actually bends many scores (as in test_fwd.py)
    hq, hk = HEADS["gqa"]
    check_batched(rand(2, sq, hq, d, scale=4.0), rand(2, sk, hk, d), rand(2, sk, hk, d), causal=causal,
                  softcap=15.0)


def _sink(hq):
    return torch.randn(hq, device=DEVICE, dtype=torch.float32) * 2


@pytest.mark.parametrize("causal", [False, True])
def test_backward_learnable_sink(causal):
    """gpt-oss shape class: d=64, GQA; the sink's gradient is compared too."""
    hq, hk, d = 8, 2, 64
    _, got = check_batched(rand(2, 150, hq, d), rand(2, 170, hk, d), rand(2, 170, hk, d), sink=_sink(hq),
                           causal=causal)
    assert got["dsink"].shape == (hq,) and got["dsink"].dtype == torch.float32


def test_backward_learnable_sink_sliding_window():
    """gpt-oss's sliding layers: causal window of 128 with sinks."""
    hq, hk, d = 8, 2, 64
    check_batched(rand(2, 333, hq, d), rand(2, 333, hk, d), rand(2, 333, hk, d), sink=_sink(hq),
                  window_size=(127, 0))


def test_backward_learnable_sink_rows_without_keys():
    """With a sink a row that sees no key has out 0 and lse = the sink logit: its dq is 0, and it adds
    nothing to dsink (its sink probability is 1 but rowsum(dout * out) is 0)."""
    hq, hk, d = 4, 2, 64
    out, got = check_batched(rand(2, 200, hq, d), rand(2, 50, hk, d), rand(2, 50, hk, d), sink=_sink(hq),
                             causal=True)
    assert (out[:, :150] == 0).all() and (got["dq"][:, :150] == 0).all()


# ---- inputs as models produce them ----


def test_backward_partial_requires_grad():
    """Only q needs a gradient, then only k and v: the others get none, the requested ones are right."""
    hq, hk, d = 6, 2, 128
    q, k, v = rand(2, 113, hq, d), rand(2, 203, hk, d), rand(2, 203, hk, d)
    dout = rand(2, 113, hq, d)
    ref = reference_grads(q, k, v, dout, upcast=True, causal=True)
    pt = reference_grads(q, k, v, dout, upcast=False, causal=True)
    for wanted in (("dq",), ("dk", "dv")):
        ins = {"dq": q.clone(), "dk": k.clone(), "dv": v.clone()}
        for name in wanted:
            ins[name].requires_grad_()
        flash_attn_func(ins["dq"], ins["dk"], ins["dv"], causal=True).backward(dout)
        for name, t in ins.items():
            if name in wanted:
                assert_grads_close({name: t.grad}, {name: ref[name]}, {name: pt[name]})
            else:
                assert t.grad is None


def test_backward_strided_inputs_and_expanded_dout():
    """q, k, v as views of one fused projection (gradients land in the fused tensor's slices); dout a
    transposed (b, h, s, d) buffer; then dout of out.sum(): an expanded tensor with stride 0."""
    b, s, h, d = 2, 157, 4, 128
    fused0 = rand(b, s, 3, h, d)
    fused = leaf(fused0)
    q, k, v = fused.unbind(2)
    assert not q.is_contiguous()
    dout = rand(b, h, s, d).transpose(1, 2)
    out = flash_attn_func(q, k, v, causal=True)
    scribble_free_memory(fused)
    out.backward(dout)
    q0, k0, v0 = fused0.unbind(2)
    ref = reference_grads(q0, k0, v0, dout, upcast=True, causal=True)
    pt = reference_grads(q0, k0, v0, dout, upcast=False, causal=True)
    got = dict(zip(("dq", "dk", "dv"), fused.grad.unbind(2)))
    assert_grads_close(got, ref, pt, what="fused: ")

    qs, ks, vs = (leaf(t) for t in (q0, k0, v0))
    flash_attn_func(qs, ks, vs, causal=True).sum().backward()
    ones = torch.ones(b, s, h, d, device=DEVICE, dtype=torch.bfloat16)
    ref = reference_grads(q0, k0, v0, ones, upcast=True, causal=True)
    pt = reference_grads(q0, k0, v0, ones, upcast=False, causal=True)
    assert_grads_close({"dq": qs.grad, "dk": ks.grad, "dv": vs.grad}, ref, pt, what="out.sum(): ")


def test_backward_with_return_lse_unused():
    """return_lse=True is fine for training as long as the loss does not use lse."""
    hq, hk, d = 6, 2, 128
    q, k, v = rand(2, 200, hq, d), rand(2, 240, hk, d), rand(2, 240, hk, d)
    dout = rand(2, 200, hq, d)
    _, got = run_ours(lambda *a, **kw: flash_attn_func(*a, **kw)[0], q, k, v, dout, causal=True,
                      return_lse=True)
    ref = reference_grads(q, k, v, dout, upcast=True, causal=True)
    pt = reference_grads(q, k, v, dout, upcast=False, causal=True)
    assert_grads_close(got, ref, pt)


# ---- varlen ----


def make_varlen(lens_q, lens_k, hq, hk, d, dtype=torch.bfloat16):
    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)

    cu_q, cu_k = cu(lens_q), cu(lens_k)
    q = rand(sum(lens_q), hq, d, dtype=dtype)
    k = rand(sum(lens_k), hk, d, dtype=dtype)
    v = rand(sum(lens_k), hk, d, dtype=dtype)
    return q, k, v, cu_q, cu_k


def check_varlen(q, k, v, cu_q, cu_k, *, sink=None, max_seqlen_q=None, **kwargs):
    """Our varlen backward against the reference, sequence by sequence (each sequence's slice of dq, dk,
    dv under the rule with its own atol, so a large error in one cannot hide behind another's scale)."""
    dout = rand(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    out, got = run_ours(flash_attn_varlen_func, q, k, v, dout, sink=sink, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                        max_seqlen_q=max_seqlen_q, **kwargs)
    ref_kwargs = {n: a for n, a in kwargs.items() if n != "max_seqlen_k"}
    ref_kwargs.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ref = with_kernel_rowsum(reference_grads(q, k, v, dout, sink=sink, upcast=True, **ref_kwargs), q, k, v, dout,
                             out, sink=sink, **ref_kwargs)
    pt = reference_grads(q, k, v, dout, sink=sink, upcast=False, **ref_kwargs)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    # A sequence with one key has P = 1 and dS = dP - rowsum(dO * O) = 0 in exact arithmetic, so its
    # dQ and dK are exactly 0 and the rule leaves only atol; the kernel's float32 dP and rowsum are
    # summed in different orders, and dK adds that rounding up over the queries. The floor: 1e-5 of
    # the batch's largest gradient.
    floor = {n: 1e-5 * ref[n].abs().max().item() for n in ("dq", "dk", "dv")}
    for i in range(len(cq) - 1):
        rows = {"dq": slice(cq[i], cq[i + 1]), "dk": slice(ck[i], ck[i + 1]), "dv": slice(ck[i], ck[i + 1])}
        assert_grads_close({n: got[n][r] for n, r in rows.items()}, {n: ref[n][r] for n, r in rows.items()},
                           {n: pt[n][r] for n, r in rows.items()}, what=f"sequence {i}: ", extra_atol=floor)
    if sink is not None:
        assert_grads_close({"dsink": got["dsink"]}, {"dsink": ref["dsink"]}, {"dsink": pt["dsink"]},
                           extra_atol={"dsink": dsink_rounding(q, k, v, dout, sink, **ref_kwargs)})
    return got


@pytest.mark.parametrize("use_seqused_k", [False, True])
@pytest.mark.parametrize("heads", ["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_varlen(causal, heads, use_seqused_k):
    hq, hk = HEADS[heads]
    lens_q, lens_k = random_lengths(6, 300)
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, hq, hk, 128)
    seqused_k = None
    if use_seqused_k:
        seqused_k = torch.tensor([int(torch.randint(0, n + 1, ())) for n in lens_k], dtype=torch.int32,
                                 device=DEVICE)
    # max_seqlen_k given here; the other varlen tests leave it (and sometimes max_seqlen_q) to the function
    got = check_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=causal,
                       seqused_k=seqused_k)
    if seqused_k is not None:  # keys past seqused_k take no part: their gradients are exactly 0
        ck = cu_k.tolist()
        for i, used in enumerate(seqused_k.tolist()):
            tail = slice(ck[i] + used, ck[i + 1])
            assert (got["dk"][tail] == 0).all() and (got["dv"][tail] == 0).all(), f"sequence {i}: unused keys"


def test_backward_varlen_unaligned_offsets():
    """Sequence starts that are not multiples of 4 tokens (the LSE rows' TMA once faulted on them)."""
    lens = [10, 20, 15, 16, 28]
    q, k, v, cu_q, cu_k = make_varlen(lens, [5, 9, 18, 10, 26], 4, 4, 128)
    check_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max(lens))


def test_backward_varlen_mqa_default_max_seqlen():
    lens_q, lens_k = random_lengths(5, 400)
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 1, 128)
    check_varlen(q, k, v, cu_q, cu_k, causal=True)  # max_seqlen_q computed by the function


def test_backward_varlen_learnable_sink_window(seed):
    hq, hk, d = 8, 2, 64
    lens_q, lens_k = random_lengths(4, 300)
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, hq, hk, d)
    check_varlen(q, k, v, cu_q, cu_k, sink=_sink(hq), max_seqlen_q=max(lens_q), window_size=(63, 0))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_varlen_keys_without_queries(d):
    """A sequence with keys but no queries: its dK and dV are exactly 0, written by the kernel (the
    op does not zero them; the outputs start as NaN here). The split layout at d=256."""
    lens_q, lens_k = [70, 0, 133], [90, 150, 61]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 2, d)
    got = check_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max(lens_q), causal=True)
    keys = slice(lens_k[0], lens_k[0] + lens_k[1])
    assert (got["dk"][keys] == 0).all() and (got["dv"][keys] == 0).all()


def test_backward_varlen_matches_batched():
    """Equal-length varlen and batched backward on the same data agree up to bf16 rounding."""
    b, s, hq, hk, d = 3, 190, 4, 2, 128
    q, k, v, dout = rand(b, s, hq, d), rand(b, s, hk, d), rand(b, s, hk, d), rand(b, s, hq, d)
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=DEVICE)
    _, got_b = run_ours(flash_attn_func, q, k, v, dout, causal=True)
    _, got_v = run_ours(flash_attn_varlen_func, q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                        dout.flatten(0, 1), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, causal=True)
    for name in ("dq", "dk", "dv"):
        a, c = got_b[name].float(), got_v[name].view(got_b[name].shape).float()
        assert max_abs_diff(a, c) <= 2e-2 * a.abs().max().item(), name


# ---- deterministic ----


@pytest.mark.slow
@pytest.mark.parametrize("causal,hq,hk", [(False, 4, 4), (True, 4, 4), (False, 8, 2)])
def test_deterministic_backward_is_bitwise_repeatable(causal, hq, hk):
    """Many KV tiles per query tile (and, with GQA, several query heads per KV head) is where atomic
    accumulation would reorder sums; deterministic=True must give identical bits on every call."""
    b, s, d = 2, 2048, 128
    q, k, v, dout = rand(b, s, hq, d), rand(b, s, hk, d), rand(b, s, hk, d), rand(b, s, hq, d)
    check_deterministic_repeats(q, k, v, dout, causal)


# ---- the split-head-dim layout (head dims above 128, d != dv) ----


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dv,heads,sq,sk", [(192, 192, "mha", 300, 257), (256, 256, "gqa", 257, 300),
                                              (192, 128, "gqa", 173, 190), (128, 64, "mqa", 300, 257),
                                              (256, 256, "mha", 1000, 1000)])
def test_split_head_dim_backward(d, dv, heads, sq, sk, causal):
    hq, hk = HEADS[heads]
    check_batched(rand(2, sq, hq, d), rand(2, sk, hk, d), rand(2, sk, hk, dv), causal=causal)


def test_split_head_dim_backward_softcap_sink_window():
    hq, hk, d = 8, 2, 256
    check_batched(rand(2, 200, hq, d), rand(2, 230, hk, d), rand(2, 230, hk, d), sink=_sink(hq),
                  window_size=(100, 7), softcap=30.0)


def test_split_head_dim_backward_varlen():
    hq, hk, d, dv = 6, 2, 192, 128
    lens_q, lens_k = random_lengths(5, 300)
    q, k, _, cu_q, cu_k = make_varlen(lens_q, lens_k, hq, hk, d)
    v = rand(sum(lens_k), hk, dv)
    check_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max(lens_q), causal=True)


def test_split_head_dim_deterministic_is_bitwise_repeatable():
    b, s, hq, hk, d = 1, 1024, 4, 2, 256
    q, k, v, dout = rand(b, s, hq, d), rand(b, s, hk, d), rand(b, s, hk, d), rand(b, s, hq, d)
    runs = [run_ours(flash_attn_func, q, k, v, dout, deterministic=True)[1] for _ in range(3)]
    for name in ("dq", "dk", "dv"):
        for i in (1, 2):
            assert torch.equal(runs[0][name], runs[i][name]), f"{name}: run {i} differs from run 0"


# ---- head dims the kernel does not take directly ----


@pytest.mark.parametrize("d,dv,causal", [(72, 72, True), (200, 200, False), (128, 72, True), (24, 24, False),
                                          (88, 88, False)])
def test_head_dims_multiple_of_8_not_16(d, dv, causal):
    """The backward runs these zero-padded to the next multiple of 16 (at least 32) and drops the
    padded gradient columns (ops._backward)."""
    hq, hk = HEADS["gqa"]
    check_batched(rand(2, 300, hq, d), rand(2, 257, hk, d), rand(2, 257, hk, dv), causal=causal)


def test_a_loss_on_the_lse_alone_reaches_q_and_k(seed):
    """lse.sum() only: dO is zero, dQ and dK come from the LSE term alone (dV is exactly 0)."""
    q, k, v = (leaf(rand(1, 64, 2, 64)) for _ in range(3))
    _, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    lse.sum().backward()
    assert q.grad.abs().max() > 0 and k.grad.abs().max() > 0 and torch.count_nonzero(v.grad) == 0


# ---- the pre- and postprocessing kernels against the torch paths they replace ----


@pytest.mark.parametrize("dv", [64, 96, 128, 256])
@pytest.mark.parametrize("varlen", [False, True])
def test_preprocess_kernel_matches_torch(dv, varlen):
    """fa4_kernels/bwd_preprocess.py against the torch path it replaces: LSE in log2 units bitwise
    (rows that saw no key: -inf -> +inf), rowsum(dO * O) to float32 rounding, padding rows 0."""
    shape = (333, 3, dv) if varlen else (2, 301, 3, dv)
    out, dout = rand(*shape), rand(*shape)
    lse_shape = (3, 333) if varlen else (2, 3, 301)
    lse = torch.randn(lse_shape, device=DEVICE) * 4
    lse[..., ::7] = -float("inf")
    cu_q = torch.tensor([0, 101, 101, 230, 333], dtype=torch.int32, device=DEVICE) if varlen else None
    want = ops._backward_rows(dout, out, lse, cu_q, use_kernel=False)
    got = ops._backward_rows(dout, out, lse, cu_q, use_kernel=True)
    assert torch.equal(got[0], want[0]), "lse_log2"
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile_m,head_dim,varlen", [(128, 64, False), (80, 128, False), (64, 128, True),
                                                    (64, 256, False), (128, 32, True)])
def test_postprocess_kernel_matches_its_torch_reference(sm90_schedule, dtype, tile_m, head_dim, varlen):
    """sm90/bwd_postprocess.py against the torch reference in ops, bitwise: dq_accum's register order
    undone the same way (the kernel through the dQ WGMMA's own partition, the reference by
    DqTiling.block_order's formula), the same float32 product rounded to nearest even. Lengths no
    multiple of the block, an empty varlen sequence."""
    from flash_attn4.fa4_kernels.arch import Arch
    from flash_attn4.fa4_kernels.config import BackwardConfig

    split = {"split_head_dim": True, "tile_n": 64} if head_dim > 128 else {}
    cfg = BackwardConfig(arch=Arch.SM90, dtype={torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype],
                         head_dim=head_dim, head_dim_v=head_dim, tile_m=tile_m, varlen=varlen, **split)
    if varlen:
        lens = [tile_m + 3, 0, 2 * tile_m - 1, 40]
        cu = torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)
        q, max_seqlen_q = torch.empty(sum(lens), 5, head_dim, dtype=dtype, device=DEVICE), max(lens)
    else:
        cu, q = None, torch.empty(3, 2 * tile_m + 37, 5, head_dim, dtype=dtype, device=DEVICE)
        max_seqlen_q = q.shape[1]
    dq_accum = torch.randn_like(ops._dq_accum(q, cfg, cu)) * 50
    want = ops._dq_from_accum(dq_accum, cfg, q, cu, max_seqlen_q, 0.0883883, use_kernel=False)
    got = ops._dq_from_accum(dq_accum, cfg, q, cu, max_seqlen_q, 0.0883883, use_kernel=True)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.equal(got, want)



# ---- gradients through the returned LSE ----


def lse_loss_grads(fn, q, k, v, dout, dlse, *, sink=None, upcast=None, **kwargs):
    """Gradients of sum(out * dout) + sum(lse * dlse) (rows with lse = -inf left out) w.r.t. q, k, v
    (and the sink): through ``fn`` (ours: return_lse=True) or, with ``upcast`` set, through
    attention_ref in float32 (True) or the input dtype (False)."""
    if upcast:
        q, k, v, dout = q.float(), k.float(), v.float(), dout.float()
    tensors = {"dq": leaf(q), "dk": leaf(k), "dv": leaf(v)}
    if sink is not None:
        tensors["dsink"] = leaf(sink.float() if upcast is not None else sink)
    if upcast is None:
        out, lse = fn(tensors["dq"], tensors["dk"], tensors["dv"], learnable_sink=tensors.get("dsink"),
                      return_lse=True, **kwargs)
    else:
        out, lse = attention_ref(tensors["dq"], tensors["dk"], tensors["dv"], learnable_sink=tensors.get("dsink"),
                                 upcast=upcast, **kwargs)
    loss = (out.float() * dout.float()).sum() + torch.where(torch.isfinite(lse), lse * dlse, 0.0).sum()
    loss.backward()
    return {name: (t.grad if t.grad is not None else torch.zeros_like(t)) for name, t in tensors.items()}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_gradients_through_the_returned_lse(seed, causal, with_sink, d):
    """Ring attention and other chunk merges differentiate through the LSE: dS gains P * dlse, which
    the backward takes as rowsum(dO * O) - dlse in place of rowsum(dO * O) (ops.bwd)."""
    q, k, v = rand(2, 300, 6, d), rand(2, 333, 2, d), rand(2, 333, 2, d)
    dout, dlse = rand(2, 300, 6, d), torch.randn(2, 6, 300, device=DEVICE)
    sink = torch.randn(6, device=DEVICE) if with_sink else None
    got = lse_loss_grads(flash_attn_func, q, k, v, dout, dlse, sink=sink, causal=causal)
    ref = lse_loss_grads(None, q, k, v, dout, dlse, sink=sink, upcast=True, causal=causal)
    pt = lse_loss_grads(None, q, k, v, dout, dlse, sink=sink, upcast=False, causal=causal)
    extra = {"dsink": dsink_rounding(q, k, v, dout, sink, causal=causal)} if with_sink else None
    assert_grads_close(got, ref, pt, "lse loss: ", extra_atol=extra)


def test_varlen_gradients_through_the_returned_lse(seed):
    lens_q, lens_k = random_lengths(4, 200)
    cu_q = torch.tensor([0] + lens_q, device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=DEVICE).cumsum(0).to(torch.int32)
    q, k, v = rand(int(cu_q[-1]), 4, 128), rand(int(cu_k[-1]), 2, 128), rand(int(cu_k[-1]), 2, 128)
    dout, dlse = rand(q.shape[0], 4, 128), torch.randn(4, q.shape[0], device=DEVICE)
    kwargs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    got = lse_loss_grads(lambda *a, **kw: flash_attn_varlen_func(*a, max_seqlen_q=max(lens_q),
                                                                  max_seqlen_k=max(lens_k), **kw),
                         q, k, v, dout, dlse, **kwargs)
    ref = lse_loss_grads(None, q, k, v, dout, dlse, upcast=True, **kwargs)
    pt = lse_loss_grads(None, q, k, v, dout, dlse, upcast=False, **kwargs)
    assert_grads_close(got, ref, pt, "varlen lse loss: ")


@pytest.mark.parametrize("inference_only", ["seqused_q", "paged"])
def test_inference_only_inputs_refuse_the_backward(seed, inference_only):
    """Inputs that require grad with seqused_q or a page table: the listed NotImplementedError (the
    forward raises it before it runs), never a wrong gradient."""
    from flash_attn4 import dispatch

    pattern = refusal_pattern(backward_refusals(dispatch.arch_for_device(torch.device(DEVICE)),
                                                **{inference_only: True}))
    lens = [37, 90]
    cu = torch.tensor([0, 37, 127], dtype=torch.int32, device=DEVICE)
    used = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = leaf(rand(127, 4, 128))
    if inference_only == "paged":
        table, num_pages = random_pages(lens, 64)
        k, v = leaf(rand(num_pages, 64, 2, 128)), leaf(rand(num_pages, 64, 2, 128))
        kwargs = dict(page_table=table.to(DEVICE), seqused_k=used)
        cu_k = None
    else:
        k, v = leaf(rand(127, 2, 128)), leaf(rand(127, 2, 128))
        kwargs, cu_k = dict(seqused_q=used), cu
    with pytest.raises(NotImplementedError, match=pattern):
        out = flash_attn_varlen_func(q, k, v, cu, cu_k, max_seqlen_q=90, causal=True, **kwargs)
        out.float().sum().backward()
