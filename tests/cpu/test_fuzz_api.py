"""Property-based fuzzing of the public functions' argument space, on CPU tensors (hypothesis).

The property: a call either validates (and, on a CPU tensor, then stops at the device check, the
ValueError "q is on device 'cpu'") or raises ValueError, TypeError or NotImplementedError whose message
names the argument that is wrong. Nothing else (no AttributeError, IndexError, torch RuntimeError ...).
Each example starts from a random valid call and replaces zero to two arguments with values that are
invalid by construction (junk types, wrong dtypes, ranks, shapes or values); a call with a replaced
argument must not validate. Deterministic: derandomize=True, no example database. Bounded: the whole
file runs in well under a minute. The known bugs the fuzzing found are regression-tested at the end.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_attn4 import flash_attn_combine, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

CLEAN = (ValueError, TypeError, NotImplementedError)
DEVICE_ERROR = re.compile(r"^q is on device 'cpu'|^out_partial is on device 'cpu'")
FUZZ = settings(max_examples=300, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
HEAD_DIMS = [16, 24, 32, 64, 72, 96, 128, 192, 256]
I32 = torch.int32


def tensor(shape, dtype=torch.bfloat16):
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(tuple(shape), dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.rand(*shape) > 0.5
    return torch.randint(0, 4, shape, dtype=dtype)


def index_vector(values):
    return torch.tensor(list(values), dtype=I32)


def cu_seqlens(lengths):
    return index_vector([0] + list(np.cumsum(lengths, dtype=np.int64)))


# ---- invalid values, by kind ----

JUNK = [None, 3, -1, 1.5, math.nan, "x", [1, 2], (1,), {}, object(), torch.float32, np.zeros(3)]


def junk(draw, allow_none=True):
    pool = JUNK if allow_none else JUNK[1:]
    return draw(st.sampled_from(pool))


def bad_flag(draw):
    return draw(st.sampled_from([None, "no", "True", 2, -1, 0.5, [True], torch.ones(2, dtype=torch.bool),
                                 torch.tensor(1.0), object()]))


def bad_float(draw):
    return draw(st.sampled_from([math.nan, math.inf, -math.inf, "1.0", True, [1.0], complex(1, 1),
                                 torch.ones(2), object()]))


def bad_window(draw):
    return draw(st.sampled_from([5, (1, 2, 3), (-2, 0), (0, -5), (1.5, 0), ("a", 0), (0, True), "ab",
                                 (math.nan, 1), [None], object()]))


def bad_int(draw, low=None, high=None):
    pool = [1.5, "2", True, math.nan, [1], None, torch.ones(2)]
    if low is not None:
        pool.append(low - 1)
    if high is not None:
        pool.append(high + 1)
    return draw(st.sampled_from(pool))


def bad_tensor(draw, shape, dtype, allow_none=False):
    """A tensor argument of shape/dtype made invalid: junk, another rank, another dtype."""
    how = draw(st.sampled_from(["junk", "rank", "dtype"]))
    if how == "junk":
        return junk(draw, allow_none)
    if how == "rank":
        rank = draw(st.sampled_from([r for r in range(0, 6) if r != len(shape)]))
        return tensor((2,) * rank, dtype)
    wrong = [t for t in (torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.uint8)
             if t != dtype and not (dtype.is_floating_point and t.is_floating_point and dtype == torch.float32)]
    return tensor(shape, draw(st.sampled_from(wrong)))


def bad_head_dim(draw):
    return draw(st.sampled_from([0, 7, 8, 12, 20, 250, 264, 512]))


# ---- the property ----


def assert_clean(fn, kwargs, bad: dict):
    """Call fn(**kwargs); ``bad`` maps each replaced argument to the names its error may use."""
    try:
        fn(**kwargs)
    except CLEAN as e:
        msg = str(e)
        if DEVICE_ERROR.search(msg):
            assert not bad, f"invalid {sorted(bad)} passed validation: {({n: kwargs.get(n) for n in bad})!r}"
            return
        names = {alias for aliases in bad.values() for alias in aliases}
        assert bad, f"a valid call was rejected: {type(e).__name__}: {msg}"
        assert any(re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", msg) for n in names), (
            f"{type(e).__name__} does not name {sorted(names)}: {msg}")
        return
    except Exception as e:  # noqa: BLE001 - the point of the test
        raise AssertionError(f"{type(e).__name__} (not ValueError/TypeError/NotImplementedError) for replaced "
                             f"{sorted(bad)}: {e}") from e
    raise AssertionError("a CPU call returned instead of raising the device error")


def pick_bad(draw, choices):
    size = draw(st.sampled_from([1, 1, 1, 2, 0]))  # mostly invalid calls; hypothesis shrinks towards 1
    return draw(st.lists(st.sampled_from(choices), min_size=size, max_size=size, unique=True))


# ---- options shared by the attention functions ----


def valid_options(draw, hq, *, varlen=False):
    opts = {
        "softmax_scale": draw(st.one_of(st.none(), st.floats(-10, 10, allow_nan=False))),
        "causal": draw(st.sampled_from([False, True, 0, 1, np.bool_(True)])),
        "window_size": draw(st.one_of(st.none(), st.tuples(st.sampled_from([None, -1, 0, 3, 100]),
                                                           st.sampled_from([None, -1, 0, 2])))),
        "softcap": draw(st.sampled_from([None, 0.0, 0, 5.0, 30])),
        "learnable_sink": draw(st.sampled_from([None, torch.float32, torch.bfloat16, torch.float16])),
        "num_splits": draw(st.sampled_from([0, 1, 2, 7, 256])),
    }
    if opts["learnable_sink"] is not None:
        opts["learnable_sink"] = tensor((hq,), opts["learnable_sink"])
    return opts


def bad_option(draw, name, hq):
    if name in ("softmax_scale", "softcap"):
        v = bad_float(draw) if name == "softmax_scale" else draw(st.sampled_from([-1.0, math.nan, math.inf, "3",
                                                                                    False, [1.0]]))
        return v, (name,)
    if name == "causal":
        return bad_flag(draw), (name,)
    if name == "window_size":
        return bad_window(draw), (name,)
    if name == "learnable_sink":
        v = draw(st.sampled_from(["list", "shape", "dtype", "rank"]))
        value = {"list": [0.0] * hq, "shape": tensor((hq + 1,), torch.float32), "dtype": tensor((hq,), torch.int32),
                 "rank": tensor((1, hq), torch.float32)}[v]
        return value, (name,)
    if name == "num_splits":
        return bad_int(draw, 0, 256), (name,)
    raise KeyError(name)


COMMON = ["softmax_scale", "causal", "window_size", "softcap", "learnable_sink", "num_splits"]


# ---- flash_attn_func ----


def batched_problem(draw):
    b, sq, sk = draw(st.integers(1, 3)), draw(st.integers(0, 9)), draw(st.integers(0, 9))
    hk, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    d, dv = draw(st.sampled_from(HEAD_DIMS)), draw(st.sampled_from(HEAD_DIMS))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    return dict(b=b, sq=sq, sk=sk, hk=hk, hq=hk * group, d=d, dv=dv, dtype=dtype)


def bad_qkv(draw, name, p, layout):
    """q, k or v (layout: "batched" or "varlen") made invalid; its error may name the tensor."""
    shapes = ({"q": (p["b"], p["sq"], p["hq"], p["d"]), "k": (p["b"], p["sk"], p["hk"], p["d"]),
               "v": (p["b"], p["sk"], p["hk"], p["dv"])} if layout == "batched" else
              {"q": (p["tq"], p["hq"], p["d"]), "k": (p["tk"], p["hk"], p["d"]), "v": (p["tk"], p["hk"], p["dv"])})
    shape = list(shapes[name])
    how = draw(st.sampled_from(["tensor", "head_dim"] + (["heads"] if name != "q" or p["hk"] > 1 else [])
                               + (["batch"] if layout == "batched" else [])))
    if how == "tensor":
        return bad_tensor(draw, shape, p["dtype"]), (name,)
    if how == "head_dim":
        shape[-1] = bad_head_dim(draw)
    elif how == "heads":
        if name == "q":  # not a multiple of the KV heads (0 query heads is a valid, empty problem)
            shape[-2] = p["hq"] + 1
        else:
            shape[-2] = p["hk"] + 1
    else:
        shape[0] = p["b"] + 1
    return tensor(shape, p["dtype"]), (name,)


@FUZZ
@given(st.data())
def test_fuzz_flash_attn_func(data):
    draw = data.draw
    p = batched_problem(draw)
    kwargs = dict(q=tensor((p["b"], p["sq"], p["hq"], p["d"]), p["dtype"]),
                  k=tensor((p["b"], p["sk"], p["hk"], p["d"]), p["dtype"]),
                  v=tensor((p["b"], p["sk"], p["hk"], p["dv"]), p["dtype"]),
                  deterministic=draw(st.sampled_from([False, True, 1])),
                  return_lse=draw(st.sampled_from([False, True])),
                  dropout_p=draw(st.sampled_from([0.0, 0, None])),
                  **valid_options(draw, p["hq"]))
    bad = {}
    for name in pick_bad(draw, ["q", "k", "v", "deterministic", "return_lse", "dropout_p", "alibi_slopes",
                                "return_attn_probs"] + COMMON):
        if name in "qkv":
            kwargs[name], bad[name] = bad_qkv(draw, name, p, "batched")
        elif name in ("deterministic", "return_lse", "return_attn_probs"):
            kwargs[name], bad[name] = bad_flag(draw), (name,)
            if name == "return_attn_probs" and kwargs[name] is None:
                kwargs[name] = True  # None is accepted as "no"
        elif name == "dropout_p":
            kwargs[name], bad[name] = draw(st.sampled_from([0.1, 1.0, "0", True, math.nan, [0.0]])), (name,)
        elif name == "alibi_slopes":
            kwargs[name], bad[name] = tensor((p["hq"],), torch.float32), (name,)
        else:
            kwargs[name], bad[name] = bad_option(draw, name, p["hq"])
    assert_clean(flash_attn_func, kwargs, bad)


# ---- flash_attn_varlen_func: packed, padded batch, paged ----


def varlen_base(draw, p, mode):
    b = p["b"]
    lens_q = draw(st.lists(st.integers(0, 6), min_size=b, max_size=b))
    lens_k = draw(st.lists(st.integers(0, 6), min_size=b, max_size=b))
    used_q = [draw(st.integers(0, n)) for n in lens_q]
    used_k = [draw(st.integers(0, n)) for n in lens_k]
    p.update(tq=sum(lens_q), tk=sum(lens_k))
    kw = {}
    if mode == "packed":
        kw.update(q=tensor((p["tq"], p["hq"], p["d"]), p["dtype"]), k=tensor((p["tk"], p["hk"], p["d"]), p["dtype"]),
                  v=tensor((p["tk"], p["hk"], p["dv"]), p["dtype"]), cu_seqlens_q=cu_seqlens(lens_q),
                  cu_seqlens_k=cu_seqlens(lens_k))
        kw["max_seqlen_q"] = draw(st.sampled_from([None, max(lens_q), torch.tensor(max(lens_q)), 64]))
        kw["max_seqlen_k"] = draw(st.sampled_from([None, max(lens_k), 64]))
    elif mode == "padded":
        kw.update(q=tensor((b, p["sq"], p["hq"], p["d"]), p["dtype"]), k=tensor((b, p["sk"], p["hk"], p["d"]), p["dtype"]),
                  v=tensor((b, p["sk"], p["hk"], p["dv"]), p["dtype"]), cu_seqlens_q=None, cu_seqlens_k=None)
        used_q = [draw(st.integers(0, p["sq"])) for _ in range(b)]
        used_k = [draw(st.integers(0, p["sk"])) for _ in range(b)]
    else:  # paged
        page, pages = draw(st.sampled_from([16, 32])), draw(st.integers(1, 4))
        p.update(page=page, pages=pages)
        kw.update(q=tensor((p["tq"], p["hq"], p["d"]), p["dtype"]), k=tensor((pages, page, p["hk"], p["d"]), p["dtype"]),
                  v=tensor((pages, page, p["hk"], p["dv"]), p["dtype"]), cu_seqlens_q=cu_seqlens(lens_q),
                  cu_seqlens_k=None, page_table=torch.randint(0, pages, (b, 2), dtype=I32),
                  seqused_k=index_vector(min(n, 2 * page) for n in used_k))
    if mode != "paged" and draw(st.booleans()):
        kw["seqused_k"] = index_vector(used_k)
    if draw(st.booleans()):
        kw["seqused_q"] = index_vector(used_q)
    return kw


@FUZZ
@given(st.data())
def test_fuzz_flash_attn_varlen_func(data):
    draw = data.draw
    p = batched_problem(draw)
    mode = draw(st.sampled_from(["packed", "padded", "paged"]))
    kwargs = varlen_base(draw, p, mode)
    kwargs.update(return_lse=draw(st.booleans()), **valid_options(draw, p["hq"]))
    choices = ["q", "seqused_q", "return_lse"] + COMMON
    choices += {"packed": ["k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqused_k"],
                "padded": ["k", "v", "seqused_k"], "paged": ["cu_seqlens_q", "page_table", "seqused_k"]}[mode]
    bad = {}
    b = p["b"]
    for name in pick_bad(draw, choices):
        if name in "qkv":
            kwargs[name], bad[name] = bad_qkv(draw, name, p, "batched" if mode == "padded" else "varlen")
        elif name in ("cu_seqlens_q", "cu_seqlens_k"):
            how = draw(st.sampled_from(["tensor", "length"]))
            kwargs[name] = (bad_tensor(draw, (b + 1,), I32) if how == "tensor" else index_vector(range(b + 2)))
            # the batch comes from the cu_seqlens: a wrong length may surface as another (batch,) argument's
            bad[name] = (name, "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table")
        elif name in ("seqused_q", "seqused_k", "page_table"):
            shape = (b,) if name != "page_table" else (b, 2)
            how = draw(st.sampled_from(["tensor", "batch"]))
            kwargs[name] = (bad_tensor(draw, shape, I32) if how == "tensor" else
                            torch.zeros((b + 1,) + shape[1:], dtype=I32))
            bad[name] = (name,)
            if name == "page_table" and kwargs[name] is None:
                kwargs[name] = 7
        elif name in ("max_seqlen_q", "max_seqlen_k"):
            kwargs[name] = draw(st.sampled_from([-1, 1.5, "3", True, torch.tensor([1, 2]), torch.tensor(2.0)]))
            bad[name] = (name,)
        elif name == "return_lse":
            kwargs[name], bad[name] = bad_flag(draw), (name,)
        else:
            kwargs[name], bad[name] = bad_option(draw, name, p["hq"])
    assert_clean(flash_attn_varlen_func, kwargs, bad)


# ---- flash_attn_with_kvcache ----


@FUZZ
@given(st.data())
def test_fuzz_flash_attn_with_kvcache(data):
    draw = data.draw
    p = batched_problem(draw)
    b, dt = p["b"], p["dtype"]
    paged = draw(st.booleans())
    s_new = draw(st.integers(0, 3))
    if paged:
        page, pages = 16, draw(st.integers(1, 4))
        s_cache = 2 * page
        kwargs = dict(k_cache=tensor((pages, page, p["hk"], p["d"]), dt), v_cache=tensor((pages, page, p["hk"], p["dv"]), dt),
                      page_table=torch.randint(0, pages, (b, 2), dtype=I32))
        if draw(st.booleans()):
            kwargs["block_table"] = kwargs.pop("page_table")
    else:
        s_cache = draw(st.integers(4, 12))
        kwargs = dict(k_cache=tensor((b, s_cache, p["hk"], p["d"]), dt), v_cache=tensor((b, s_cache, p["hk"], p["dv"]), dt))
        if draw(st.booleans()):
            kwargs["cache_batch_idx"] = index_vector(range(b))
        if draw(st.booleans()):
            kwargs["cache_leftpad"] = index_vector([0] * b)
    kwargs["q"] = tensor((b, draw(st.integers(1, 4)), p["hq"], p["d"]), dt)
    fill = draw(st.integers(0, s_cache - 3))
    kwargs["cache_seqlens"] = draw(st.sampled_from([fill, index_vector([fill] * b), None]))
    if s_new and kwargs["cache_seqlens"] is not None:
        kwargs.update(k=tensor((b, s_new, p["hk"], p["d"]), dt), v=tensor((b, s_new, p["hk"], p["dv"]), dt))
        if draw(st.booleans()):
            rot = draw(st.sampled_from([1, p["d"] // 2]))
            kwargs.update(rotary_cos=tensor((16, rot), torch.float32), rotary_sin=tensor((16, rot), torch.float32),
                          rotary_interleaved=draw(st.booleans()))
    kwargs.update(return_softmax_lse=draw(st.booleans()), **valid_options(draw, p["hq"]))
    choices = ["q", "k_cache", "v_cache", "cache_seqlens", "rotary_interleaved", "return_softmax_lse"] + COMMON
    choices += ["page_table"] if paged else ["cache_batch_idx", "cache_leftpad"]
    bad = {}
    for name in pick_bad(draw, choices):
        if name in ("rotary_interleaved", "return_softmax_lse"):
            kwargs[name], bad[name] = bad_flag(draw), (name,)
        elif name in ("q", "k_cache", "v_cache"):
            key = {"q": "q", "k_cache": "k", "v_cache": "v"}[name]
            shape = list(kwargs[name].shape)
            how = draw(st.sampled_from(["tensor", "head_dim"]))
            if how == "tensor":
                kwargs[name] = bad_tensor(draw, shape, dt)
            else:
                shape[-1] = bad_head_dim(draw)
                kwargs[name] = tensor(shape, dt)
            bad[name] = (name,) + (("head_dim", "head_dim_v") if key == "q" else ())
        elif name == "cache_seqlens":
            kwargs[name] = draw(st.sampled_from([-1, s_cache + 1, 1.5, "2", torch.zeros(b, dtype=torch.int64),
                                                 torch.zeros(b + 1, dtype=I32)]))
            bad[name] = (name,)
        elif name == "page_table":
            kwargs.pop("block_table", None)
            kwargs[name] = draw(st.sampled_from([torch.zeros(b, 2, dtype=torch.int64), torch.zeros(b + 1, 2, dtype=I32),
                                                 torch.zeros(b, dtype=I32), [[0, 1]], 3]))
            bad[name] = (name,)
        elif name in ("cache_batch_idx", "cache_leftpad"):
            kwargs[name] = draw(st.sampled_from([torch.zeros(b, dtype=torch.int64), torch.zeros(b + 1, dtype=I32),
                                                 [0] * b, 1]))
            bad[name] = (name,)
        else:
            kwargs[name], bad[name] = bad_option(draw, name, p["hq"])
    assert_clean(flash_attn_with_kvcache, kwargs, bad)


# ---- flash_attn_combine ----


@FUZZ
@given(st.data())
def test_fuzz_flash_attn_combine(data):
    draw = data.draw
    splits, b, sq, h = (draw(st.integers(1, 4)) for _ in range(4))
    dv = draw(st.sampled_from([8, 16, 64, 136, 256]))
    kwargs = dict(out_partial=tensor((splits, b, sq, h, dv), torch.float32),
                  lse_partial=tensor((splits, b, h, sq), torch.float32),
                  out_dtype=draw(st.sampled_from([None, torch.float32, torch.bfloat16, torch.float16])))
    bad = {}
    for name in pick_bad(draw, ["out_partial", "lse_partial", "out_dtype"]):
        if name == "out_dtype":
            kwargs[name] = draw(st.sampled_from(["float32", torch.float64, torch.int32, 1, torch.tensor(1.0),
                                                 np.float32, object()]))
        elif name == "out_partial":
            shape = [splits, b, sq, h, dv]
            how = draw(st.sampled_from(["tensor", "head_dim", "splits"]))
            if how == "tensor":
                kwargs[name] = bad_tensor(draw, shape, torch.float32)
            else:
                shape[-1 if how == "head_dim" else 0] = 12 if how == "head_dim" else splits + 1
                kwargs[name] = tensor(shape, torch.float32)
        else:
            shape = [splits, b, h, sq]
            how = draw(st.sampled_from(["tensor", "shape"]))
            kwargs[name] = (bad_tensor(draw, shape, torch.float32) if how == "tensor" else
                            tensor((splits, b, sq + 1, h), torch.float32))
        bad[name] = (name, "lse_partial" if name == "out_partial" else "out_partial")  # shapes are checked jointly
    assert_clean(flash_attn_combine, kwargs, bad)


# ---- regressions found by fuzzing and review ----


def test_list_sink_with_seqused_q_is_a_clean_error():
    q, k, v = tensor((2, 5, 4, 64)), tensor((2, 5, 2, 64)), tensor((2, 5, 2, 64))
    with pytest.raises(ValueError, match=r"^learnable_sink must be a torch.Tensor, got list"):
        flash_attn_varlen_func(q, k, v, None, None, seqused_q=index_vector([1, 2]), learnable_sink=[0.0] * 4)


@pytest.mark.parametrize("out_dtype", ["float32", torch.tensor(1.0), np.float32, 1])
def test_combine_out_dtype_must_be_a_dtype(out_dtype):
    with pytest.raises(TypeError, match=r"^out_dtype must be a torch.dtype"):
        flash_attn_combine(tensor((2, 1, 3, 4, 64), torch.float32), tensor((2, 1, 4, 3), torch.float32), out_dtype)


@pytest.mark.parametrize("flag", ["return_softmax_lse", "rotary_interleaved"])
def test_kvcache_flags_are_checked_before_the_device(flag):
    q, kc = tensor((2, 1, 4, 64)), tensor((2, 8, 2, 64))
    with pytest.raises(TypeError, match=rf"^{flag} must be a bool"):
        flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=3, **{flag: "no"})


def test_return_attn_probs_tensor_is_a_clean_error():
    q, k = tensor((1, 3, 2, 64)), tensor((1, 3, 2, 64))
    with pytest.raises(TypeError, match=r"^return_attn_probs must be a bool"):
        flash_attn_func(q, k, k.clone(), return_attn_probs=torch.ones(2, dtype=torch.bool))


# ---- scripts/fuzz_gpu.py: its problems are valid and its broken calls invalid (checked here on CPU) ----


def test_fuzz_gpu_script_problems_and_breaks():
    import random

    from scripts import fuzz_gpu

    rng = random.Random(0)
    seen = set()
    for _ in range(40):
        p = fuzz_gpu.random_problem(rng, max_len=40, device="cpu")
        with pytest.raises(ValueError, match=DEVICE_ERROR):  # validates: stops at the device check
            p["fn"](*p["args"], **p["kwargs"])
        varlen = p["fn"] is flash_attn_varlen_func
        # cpu_k and cu_values are checked after the device (a second device, the opt-in value check)
        for what in fuzz_gpu.BREAKS + (fuzz_gpu.VARLEN_BREAKS if varlen else []):
            if what in ("cpu_k", "cu_values"):
                continue
            _, args, kwargs, env = fuzz_gpu.break_one(p, rng, "cpu", what)
            with pytest.raises(CLEAN) as info:
                p["fn"](*args, **kwargs)
            assert not DEVICE_ERROR.search(str(info.value)), f"{what} was not rejected before the device check"
            seen.add(what)
    assert seen == set(fuzz_gpu.BREAKS + fuzz_gpu.VARLEN_BREAKS) - {"cpu_k", "cu_values"}


def test_fuzz_gpu_script_checker_accepts_the_reference_and_rejects_an_error():
    """check_problem on CPU with the reference standing in for the kernels: the float32 reference
    rounded to the input dtype passes; the same with one element off by 0.05 fails."""
    import random

    from scripts import fuzz_gpu
    from tests.reference import attention_ref

    def stand_in(shift):
        def fn(q, k, v, *cu, return_lse, num_splits, max_seqlen_q=None, max_seqlen_k=None, **opts):
            ref = dict(opts, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1]) if cu else opts
            out, lse = attention_ref(q, k, v, upcast=True, **ref)
            out = out.to(q.dtype)
            if shift and out.numel():
                out = out + torch.nn.functional.one_hot(torch.tensor(0), out.numel()).reshape(out.shape) * shift
            return out, lse
        return fn

    rng, checked = random.Random(1), {"bwd": 0, "varlen": 0}
    while not (checked["bwd"] and checked["varlen"]):
        p = fuzz_gpu.random_problem(rng, max_len=12, device="cpu")
        varlen = len(p["args"]) == 5
        if p["args"][0].numel() == 0 or not (p["bwd"] and not checked["bwd"] or varlen and not checked["varlen"]):
            continue
        checked["bwd"] += p["bwd"]
        checked["varlen"] += varlen
        p["fn"] = stand_in(0.0)
        fuzz_gpu.check_problem(p)
        p["fn"], p["bwd"] = stand_in(0.05), False
        with pytest.raises(AssertionError, match="exceeds"):
            fuzz_gpu.check_problem(p)
