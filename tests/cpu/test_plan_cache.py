"""The per-call caches of the host path (docs/DECODING.md "Host time"): ops' launch plans and
interface's validation memo.

A repeated call must launch exactly what the full path would (same kernel configuration, same
arguments in the same layouts), miss when anything the cached decisions read changes, and raise
every error the full path raises, also right after a cached good call. Kernels are recording
stand-ins (no numerics here: tests/cpu/test_ops.py and the GPU tests cover those)."""

from __future__ import annotations

import random

import pytest
import torch

from flash_attn4 import (compile_cache, device_info, dispatch, flash_attn_func, flash_attn_varlen_func,
                         flash_attn_with_kvcache, interface, ops, validate)
from flash_attn4.fa4_kernels.arch import Arch


def _describe(x, inputs):
    """A launch argument as comparable data: a tensor by shape, strides, dtype and whether it is one
    of the caller's tensors (which one) or a fresh one; anything else as itself."""
    if isinstance(x, torch.Tensor):
        ptr = x.data_ptr()
        origin = next((i for i, t in enumerate(inputs) if t is not None and t.data_ptr() == ptr), None)
        return ("tensor", tuple(x.shape), x.stride(), x.dtype, origin)
    return (type(x).__name__, x)


@pytest.fixture
def launches(monkeypatch):
    """CPU tensors pass, the device is an sm_90 with 132 SMs, kernels record their launches into
    the returned list (cfg, described args); the caller sets ``launches.inputs``."""
    record = []

    class Recorder(list):
        inputs = ()

    record = Recorder()

    def stand_in(cfg, **_):
        def run(*args):
            record.append((cfg, tuple(_describe(a, record.inputs) for a in args)))
        return run

    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(dispatch, "arch_for_device", lambda device, kernel="forward": Arch.SM90)
    monkeypatch.setattr(device_info, "get_device_info",
                        lambda device: device_info.DeviceInfo(0, "stand-in H200", (9, 0), 132))
    monkeypatch.setattr(compile_cache, "_compile_forward", stand_in)
    monkeypatch.setattr(compile_cache, "_compile_combine", stand_in)
    monkeypatch.setattr(compile_cache, "_compile_split_kv", stand_in)
    monkeypatch.setenv("FLASH_ATTN4_DISABLE_DISK_CACHE", "1")
    monkeypatch.delenv("FLASH_ATTN4_CHECK_CU_SEQLENS", raising=False)
    compile_cache.clear()
    interface._MEMO.clear()
    yield record
    compile_cache.clear()
    interface._MEMO.clear()


def _caches(monkeypatch, on: bool):
    monkeypatch.setattr(ops, "PLAN_CACHE", on)
    monkeypatch.setattr(interface, "VALIDATION_MEMO", on)


def _layout(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """t's values in a random legal layout: contiguous, heads/seq swapped in memory, a strided slice
    of a wider tensor (its row stride a multiple of 16 bytes or not), or one element off 16-byte
    alignment (the op copies the last two)."""
    how = rng.choice(["contiguous", "swapped", "slice", "odd", "misaligned"])
    if how == "swapped" and t.dim() == 4:
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if how in ("slice", "odd"):  # row strides a multiple of 16 bytes, or not (copied)
        wide = torch.randn(*t.shape[:-1], t.shape[-1] + (8 if how == "slice" else 1), dtype=t.dtype)
        wide[..., : t.shape[-1]] = t
        return wide[..., : t.shape[-1]]
    if how == "misaligned":
        flat = torch.randn(t.numel() + 1, dtype=t.dtype)
        view = flat[1:].view(t.shape)
        view.copy_(t)
        return view
    return t


def _random_call(rng: random.Random, lay: random.Random):
    """(function, args, kwargs, inputs) of a random valid forward call; ``lay`` picks the layouts."""
    dtype = rng.choice([torch.bfloat16, torch.float16])
    hk = rng.choice([1, 2, 4])
    hq = hk * rng.choice([1, 2, 3, 4, 8])
    d = rng.choice([64, 128])
    dv = rng.choice([d, 64])
    b, sq = rng.randint(1, 3), rng.choice([1, 2, 17, 128])
    sk = rng.choice([1, 64, 700, 5000])
    opts = dict(causal=rng.random() < 0.4, softcap=rng.choice([0.0, 0.0, 30.0]),
                window_size=rng.choice([(-1, -1), (-1, -1), (64, 0), (32, 32)]),
                softmax_scale=rng.choice([None, 0.1]))
    if rng.random() < 0.3:
        opts["learnable_sink"] = torch.randn(hq, dtype=rng.choice([torch.float32, torch.bfloat16]))
    kind = rng.choice(["func", "varlen", "kvcache"])
    if kind == "func":
        q = _layout(torch.randn(b, sq, hq, d, dtype=dtype), lay)
        k = _layout(torch.randn(b, sk, hk, d, dtype=dtype), lay)
        v = _layout(torch.randn(b, sk, hk, dv, dtype=dtype), lay)
        opts["num_splits"] = rng.choice([0, 1, 3])
        return flash_attn_func, (q, k, v), opts, (q, k, v, opts.get("learnable_sink"))
    if kind == "varlen":
        lens_q = [rng.randint(1, sq) for _ in range(b)]
        lens_k = [rng.randint(1, sk) for _ in range(b)]
        cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
        cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
        q = _layout(torch.randn(int(cu_q[-1]), hq, d, dtype=dtype), lay)
        k = _layout(torch.randn(int(cu_k[-1]), hk, d, dtype=dtype), lay)
        v = _layout(torch.randn(int(cu_k[-1]), hk, dv, dtype=dtype), lay)
        opts.update(num_splits=rng.choice([0, 1, 2]), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
        return flash_attn_varlen_func, (q, k, v, cu_q, cu_k), opts, (q, k, v, cu_q, cu_k, opts.get("learnable_sink"))
    s_cache = sk + 8
    q = torch.randn(b, sq, hq, d, dtype=dtype)
    k_cache, v_cache = torch.randn(b, s_cache, hk, d, dtype=dtype), torch.randn(b, s_cache, hk, dv, dtype=dtype)
    opts["num_splits"] = rng.choice([0, 1, 4])
    opts["cache_seqlens"] = torch.randint(0, sk, (b,), dtype=torch.int32)
    args = (q, k_cache, v_cache)
    if rng.random() < 0.5:
        args += (torch.randn(b, 1, hk, d, dtype=dtype), torch.randn(b, 1, hk, dv, dtype=dtype))
    return flash_attn_with_kvcache, args, opts, (q, k_cache, v_cache)


@pytest.mark.parametrize("seed", range(12))
def test_cached_calls_launch_what_the_full_path_launches(launches, monkeypatch, seed):
    """Random problems, options and layouts; each problem also in a second layout right after the
    first one's plan was made (a key that forgot a stride or the alignment would reuse it)."""
    rng = random.Random(seed)
    for _ in range(8):
        layout_seeds = (rng.random(), rng.random())
        state = rng.getstate()
        calls = []
        for layout_seed in layout_seeds:
            rng.setstate(state)
            calls.append(_random_call(rng, random.Random(layout_seed)))
        for fn, args, kwargs, inputs in calls:
            launches.inputs = inputs
            seen = []
            for on in (True, True, False):  # a plan built (or reused), reused, then the full path
                _caches(monkeypatch, on)
                launches.clear()
                with torch.inference_mode():
                    fn(*args, **kwargs)
                seen.append(list(launches))
            assert seen[2], "the stand-in kernels ran"
            assert seen[0] == seen[2] and seen[1] == seen[2], (fn.__name__, seed)


def test_a_changed_key_property_misses(launches):
    q, k, v = torch.randn(2, 3, 8, 64, dtype=torch.bfloat16), *(torch.randn(2, 50, 2, 64, dtype=torch.bfloat16)
                                                                  for _ in range(2))
    base = dict(causal=False, window_size=(-1, -1), softcap=0.0, num_splits=1)
    flash_attn_func(q, k, v, **base)
    plans, memo = len(ops._PLANS), len(interface._MEMO)
    assert plans == memo == 1
    flash_attn_func(q, k, v, **base)
    assert (len(ops._PLANS), len(interface._MEMO)) == (1, 1)
    variants = [  # (tensors, options, whether the validation memo misses too: the checks read no strides)
        ((q.half(), k.half(), v.half()), base, True),  # dtype
        ((q[:1], k[:1], v[:1]), base, True),  # shape
        ((q, k.transpose(1, 2).contiguous().transpose(1, 2), v), base, False),  # strides
        ((q, k, v), dict(base, causal=True), True),
        ((q, k, v), dict(base, window_size=(8, 8)), True),
        ((q, k, v), dict(base, softcap=5.0), True),
        ((q, k, v), dict(base, num_splits=0), True),
    ]
    for tensors, opts, validated in variants:
        launches.clear()
        flash_attn_func(*tensors, **opts)
        assert len(launches) >= 1
        assert len(ops._PLANS) == plans + 1 and len(interface._MEMO) == memo + validated, opts
        plans, memo = len(ops._PLANS), len(interface._MEMO)
    # pointer alignment is part of the plan's key (a misaligned tensor is copied, never planned as is)
    flat = torch.randn(q.numel() + 1, dtype=q.dtype)
    misaligned = flat[1:].view(q.shape)
    launches.inputs = (misaligned,)
    launches.clear()
    flash_attn_func(misaligned, k, v, **base)
    assert len(ops._PLANS) == plans + 1
    assert launches[0][1][0][4] is None, "the kernel got an aligned copy of q"


def _bad_calls():
    """(name, call) of invalid calls sharing the warm-up call's tensors where they can."""
    bf = torch.bfloat16
    q, k, v = torch.randn(1, 2, 4, 64, dtype=bf), torch.randn(1, 9, 2, 64, dtype=bf), torch.randn(1, 9, 2, 64, dtype=bf)
    k_cache, v_cache = torch.randn(1, 32, 2, 64, dtype=bf), torch.randn(1, 32, 2, 64, dtype=bf)
    lens = torch.tensor([5], dtype=torch.int32)
    func = lambda **kw: flash_attn_func(q, k, v, **kw)  # noqa: E731
    cache = lambda *a, **kw: flash_attn_with_kvcache(q, k_cache, v_cache, *a, **kw)  # noqa: E731
    # Each bad call differs from one of these in one argument (a value equal to the bad one in a
    # dict key where the types differ: True == 1 == 1.0).
    qv, kv, vv = q[0], k[0], v[0]
    cu_q, cu_k = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32)
    pages = torch.randn(2, 16, 2, 64, dtype=bf)
    table, used = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    varlen = lambda *a, **kw: flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, *a, **kw)  # noqa: E731
    paged = lambda **kw: flash_attn_varlen_func(qv, pages, pages, cu_q, None, seqused_k=used,  # noqa: E731
                                                page_table=table, **kw)
    padded = lambda **kw: flash_attn_varlen_func(q, k, v, None, None, **kw)  # noqa: E731
    grad_q = q.clone().requires_grad_()
    warm = [lambda: varlen(), lambda: varlen(max_seqlen_q=2, max_seqlen_k=9), lambda: varlen(max_seqlen_q=1),
            lambda: paged(), lambda: padded(seqused_k=used[:1] - 15), lambda: padded(seqused_q=used[:1] - 19),
            lambda: flash_attn_varlen_func(qv, pages, pages, cu_q, None, seqused_k=used, page_table=table,
                                           learnable_sink=torch.randn(4, requires_grad=True)),
            lambda: func(), lambda: func(causal=True), lambda: func(window_size=(1, 0)), lambda: func(softcap=1.0),
            lambda: func(num_splits=0), lambda: func(return_lse=True), lambda: func(deterministic=True),
            lambda: cache(cache_seqlens=lens), lambda: cache(cache_seqlens=5), lambda: cache(cache_seqlens=1),
            lambda: cache(cache_seqlens=lens, return_softmax_lse=False)]
    bad = {
        "k dtype": lambda: flash_attn_func(q, k.half(), v),
        "q float32": lambda: flash_attn_func(q.float(), k.float(), v.float()),
        "q meta device": lambda: flash_attn_func(q.to("meta"), k, v),
        "causal float": lambda: func(causal=1.0),
        "causal string": lambda: func(causal="no"),
        "causal tensor": lambda: func(causal=torch.tensor([True, False])),
        "return_lse 1.0": lambda: func(return_lse=1.0),
        "deterministic 1.0": lambda: func(deterministic=1.0),
        "softcap bool": lambda: func(softcap=True),
        "window bool": lambda: func(window_size=(True, 0)),
        "window float": lambda: func(window_size=(-1.0, -1.0)),
        "window short": lambda: func(window_size=(-1,)),
        "softcap negative": lambda: func(softcap=-1.0),
        "softcap nan": lambda: func(softcap=float("nan")),
        "scale nan": lambda: func(softmax_scale=float("nan")),
        "scale inf": lambda: func(softmax_scale=float("inf")),
        "num_splits negative": lambda: func(num_splits=-1),
        "num_splits bool": lambda: func(num_splits=True),
        "num_splits float": lambda: func(num_splits=1.0),
        "dropout": lambda: func(dropout_p=0.1),
        "return_lse string": lambda: func(return_lse="no"),
        "deterministic 2": lambda: func(deterministic=2),
        "sink shape": lambda: func(learnable_sink=torch.randn(3)),
        "sink dtype": lambda: func(learnable_sink=torch.randn(4).double()),
        "alibi": lambda: func(alibi_slopes=torch.randn(4)),
        "head dim": lambda: flash_attn_func(q, torch.randn(1, 9, 2, 32, dtype=bf), v),
        "heads": lambda: flash_attn_func(q, torch.randn(1, 9, 3, 64, dtype=bf), torch.randn(1, 9, 3, 64, dtype=bf)),
        "varlen cu int64": lambda: flash_attn_varlen_func(qv, kv, vv, cu_q.long(), cu_k),
        "varlen cu length": lambda: flash_attn_varlen_func(qv, kv, vv, cu_q, torch.tensor([0, 4, 9], dtype=torch.int32)),
        "varlen max bool": lambda: varlen(max_seqlen_q=True),
        "varlen max float": lambda: varlen(max_seqlen_q=2.0),
        "varlen max negative": lambda: varlen(max_seqlen_q=-1),
        "varlen 4-D q": lambda: flash_attn_varlen_func(q, kv, vv, cu_q, cu_k),
        "varlen seqused dtype": lambda: varlen(seqused_k=used.long()),
        "paged cu_k": lambda: flash_attn_varlen_func(qv, pages, pages, cu_q, cu_k, seqused_k=used, page_table=table),
        "paged no seqused": lambda: flash_attn_varlen_func(qv, pages, pages, cu_q, None, page_table=table),
        "paged grad": lambda: flash_attn_varlen_func(qv.clone().requires_grad_(), pages, pages, cu_q, None,
                                                     seqused_k=used, page_table=table),
        "padded seqused_k grad": lambda: flash_attn_varlen_func(grad_q, k, v, None, None, seqused_k=used[:1] - 15),
        "padded seqused_q grad": lambda: flash_attn_varlen_func(grad_q, k, v, None, None, seqused_q=used[:1] - 19),
        "cache seqlens too long": lambda: cache(cache_seqlens=40),
        "cache seqlens float": lambda: cache(cache_seqlens=5.0),
        "cache seqlens bool": lambda: cache(cache_seqlens=True),
        "cache seqlens int64": lambda: cache(cache_seqlens=lens.long()),
        "cache k without v": lambda: cache(torch.randn(1, 1, 2, 64, dtype=bf), cache_seqlens=lens),
        "cache v dtype": lambda: flash_attn_with_kvcache(q, k_cache, v_cache.half(), cache_seqlens=lens),
        "cache lse flag": lambda: cache(cache_seqlens=lens, return_softmax_lse=None),
        "cache meta lens": lambda: cache(cache_seqlens=lens.to("meta")),
        "cache grad": lambda: flash_attn_with_kvcache(q.clone().requires_grad_(), k_cache, v_cache,
                                                      cache_seqlens=lens),
    }
    return warm, bad


def _error(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - compared below, type and message
        return type(exc), str(exc)
    return None


def test_every_error_fires_after_a_cached_good_call(launches, monkeypatch):
    warm, bad = _bad_calls()
    _caches(monkeypatch, False)
    expected = {name: _error(call) for name, call in bad.items()}
    assert all(expected.values()), [n for n, e in expected.items() if e is None]
    _caches(monkeypatch, True)
    for name, call in bad.items():
        for good in warm:
            good()
            good()  # cached now
        assert _error(call) == expected[name], name


def test_device_types_are_part_of_the_memo(launches, monkeypatch):
    q, k, v = (torch.randn(1, 2, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v)
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda",))
    with pytest.raises(ValueError, match="runs on the GPU only"):
        flash_attn_func(q, k, v)


def test_compile_cache_clear_forgets_the_plans(launches):
    q, k, v = (torch.randn(1, 2, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    flash_attn_func(q, k, v)
    assert ops._PLANS
    compile_cache.clear()
    assert not ops._PLANS


def test_adapter_key_ranges_are_repeated_once_per_mask_and_heads():
    """The transformers adapter repeats a step's key ranges per KV head once for all layers; a new
    head count or an in-place change of the mask recomputes them."""
    from flash_attn4 import transformers_adapter as ta

    mask = torch.rand(3, 40) < 2.0
    mask[0, :5] = False  # left padding
    mask[2, -7:] = False  # an unused static-cache tail
    leftpad, end, contiguous = ta._eager_key_ranges(mask, 2)
    assert contiguous and leftpad.tolist() == [5, 5, 0, 0, 0, 0] and end.tolist() == [40, 40, 40, 40, 33, 33]
    assert ta._eager_key_ranges(mask, 2)[0] is leftpad  # the next layer: the same tensors
    assert ta._eager_key_ranges(mask, 4)[1].tolist() == [40] * 8 + [33] * 4
    mask[1, :3] = False
    assert ta._eager_key_ranges(mask, 4)[0].tolist() == [5] * 4 + [3] * 4 + [0] * 4
