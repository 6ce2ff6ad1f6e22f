"""transformers integration on the CPU, with a pure-torch stand-in for the kernels.

The stand-in (``RefBackend``) puts tests/reference.py's ``attention_ref`` (the semantics of
CONTRACTS.md: bottom-right alignment, window (left, right), causal = right 0) behind the public
signatures of flash_attn_func / flash_attn_varlen_func, computes in float32 and records every call, so the tests can check both *what the adapter asks the
kernels for* (layout, heads, cu_seqlens, options) and *that the answer is right* (against
PyTorch SDPA with an explicit mask, or against transformers' own eager/sdpa models).

Run: python -m pytest tests/cpu/test_transformers_adapter.py -q
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib
import importlib.util
import sys
import inspect
import tomllib
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import flash_attn4  # noqa: E402  (tests/conftest.py puts torch-ext and the repo root on sys.path)
from flash_attn4 import transformers_adapter as ta  # noqa: E402
from tests.reference import attention_ref  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
_TRANSFORMERS_VERSION = tuple(int(x) for x in transformers.__version__.split(".")[:2])


# ----------------------------------------------------------------------------------------------
# Reference backend: tests/reference.py's attention_ref behind the public signatures
# ----------------------------------------------------------------------------------------------


class RefBackend:
    """flash_attn_func / flash_attn_varlen_func with the contract's signatures; records calls."""

    def __init__(self):
        self.calls = []

    def flash_attn_func(self, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        learnable_sink=None, dropout_p=0.0, alibi_slopes=None, deterministic=False,
                        return_lse=False, return_attn_probs=False, num_splits=1):
        assert q.dim() == 4 and k.dim() == 4, "flash_attn_func takes (batch, seqlen, heads, head_dim)"
        assert dropout_p == 0.0 and alibi_slopes is None and not return_lse
        self.calls.append(dict(fn="dense", q=q, k=k, v=v, softmax_scale=softmax_scale, causal=causal,
                               window_size=tuple(window_size), softcap=softcap, learnable_sink=learnable_sink,
                               num_splits=num_splits))
        out, _ = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                               softcap=softcap, learnable_sink=learnable_sink)
        return out

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                               seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, learnable_sink=None, dropout_p=0.0,
                               alibi_slopes=None, deterministic=False, return_lse=False, return_attn_probs=False,
                               num_splits=1):
        assert q.dim() == 3 and k.dim() == 3, "flash_attn_varlen_func takes (total, heads, head_dim)"
        assert dropout_p == 0.0 and alibi_slopes is None and not return_lse
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        self.calls.append(dict(fn="varlen", q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q.clone(),
                               cu_seqlens_k=cu_seqlens_k.clone(), max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                               window_size=tuple(window_size), softcap=softcap, learnable_sink=learnable_sink))
        out, _ = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                               softcap=softcap, learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k)
        return out

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                                softcap=0.0, learnable_sink=None, rotary_interleaved=True, num_splits=0,
                                return_softmax_lse=False):
        """Attention over the keys [cache_leftpad[b], cache_seqlens[b]) of cache row b (no append: the
        adapter never passes new keys), from a masked dense computation: static shapes, no host reads,
        so it also runs inside a compiled graph."""
        assert q.dim() == 4 and k_cache.dim() == 4 and k is None and v is None and page_table is None
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (q.shape[0],)
        assert cache_leftpad is None or cache_leftpad.dtype == torch.int32
        self.calls.append(dict(fn="kvcache", q=q, k=k_cache, v=v_cache, cache_seqlens=cache_seqlens.clone(),
                               cache_leftpad=None if cache_leftpad is None else cache_leftpad.clone(),
                               softmax_scale=softmax_scale, causal=causal, window_size=tuple(window_size),
                               softcap=softcap, learnable_sink=learnable_sink, num_splits=num_splits))
        b, sq, hq, d = q.shape
        s_cache, hk = k_cache.shape[1], k_cache.shape[2]
        scale = softmax_scale if softmax_scale is not None else d ** -0.5
        kr = k_cache.float().repeat_interleave(hq // hk, dim=2)
        vr = v_cache.float().repeat_interleave(hq // hk, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kr) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        j = torch.arange(s_cache).view(1, 1, s_cache)
        start = (cache_leftpad if cache_leftpad is not None else torch.zeros_like(cache_seqlens)).view(b, 1, 1)
        end = cache_seqlens.view(b, 1, 1)
        diag = torch.arange(sq).view(1, sq, 1) + end - sq  # bottom-right: the last query sees key end - 1
        left, right = window_size
        right = 0 if causal else right
        visible = ((j >= start) & (j < end)).expand(b, sq, s_cache).clone()
        if left >= 0:
            visible &= j >= diag - left
        if right >= 0:
            visible &= j <= diag + right
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        if learnable_sink is not None:
            sink = learnable_sink.float().view(1, hq, 1, 1).expand(b, hq, sq, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs.nan_to_num(0.0), vr)
        return out.to(q.dtype)

    def fns(self, fn):
        return [c for c in self.calls if c["fn"] == fn]


@pytest.fixture
def backend(monkeypatch):
    """Inject the reference as the package's public kernels (the adapter looks them up per call)."""
    rb = RefBackend()
    monkeypatch.setattr(flash_attn4, "flash_attn_func", rb.flash_attn_func, raising=False)
    monkeypatch.setattr(flash_attn4, "flash_attn_varlen_func", rb.flash_attn_varlen_func, raising=False)
    monkeypatch.setattr(flash_attn4, "flash_attn_with_kvcache", rb.flash_attn_with_kvcache, raising=False)
    return rb


@pytest.fixture(scope="module", autouse=True)
def registered():
    return ta.register()


def _module(is_causal=True, training=False):
    m = torch.nn.Module()
    m.is_causal = is_causal
    m.train(training)
    return m


def _qkv(b, hq, hk, sq, sk, d=32, dv=None, dtype=torch.float32, gen=None):
    dv = dv or d
    q = torch.randn(b, hq, sq, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hk, sk, d, generator=gen, dtype=dtype)
    v = torch.randn(b, hk, sk, dv, generator=gen, dtype=dtype)
    return q, k, v


def _sdpa(q, k, v, allowed, scale=None):
    """SDPA with an explicit (B, Sq, Sk) boolean mask; (B, H, S, D) in -> (B, Sq, Hq, Dv) out."""
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
        attn_mask=allowed[:, None], scale=scale,
    )
    return out.transpose(1, 2)


def _causal_allowed(b, sq, sk, key_valid=None, window=None):
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    allowed = (j <= i + sk - sq).expand(b, sq, sk).clone()
    if window is not None:  # transformers' sliding_window_overlay: kv_idx > q_idx - window
        allowed &= j > i + sk - sq - window
    if key_valid is not None:
        allowed &= key_valid[:, None, :]
    return allowed


def _left_padding_mask(lengths, total):
    j = torch.arange(total).view(1, -1)
    return j >= (total - torch.as_tensor(lengths)).view(-1, 1)


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------


def test_register_puts_both_functions_in_transformers_interfaces():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = ta.register("fa4_test_name")
    assert name == "fa4_test_name"
    assert ALL_ATTENTION_FUNCTIONS[name] is ta.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is ta.padding_mask
    assert ta.maybe_register() == ta.DEFAULT_NAME
    assert ALL_ATTENTION_FUNCTIONS[ta.DEFAULT_NAME] is ta.attention_forward


@pytest.mark.parametrize("bad", ["flash_fa4", "my-Flash", "org/fa4", "org/fa4:fn", ""])
def test_register_rejects_names_transformers_would_reroute(bad):
    with pytest.raises(ValueError):
        ta.register(bad)


def test_maybe_register_never_imports_transformers_by_itself(monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for mod in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, mod)  # as if transformers had not been imported yet
    assert ta.maybe_register("fa4_not_imported") is None
    assert "transformers" not in sys.modules
    assert "fa4_not_imported" not in ALL_ATTENTION_FUNCTIONS


def test_maybe_register_with_import_and_without_transformers(monkeypatch):
    monkeypatch.delitem(sys.modules, "transformers")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a, **k: None if n == "transformers" else real_find_spec(n, *a, **k))
    assert ta.maybe_register("fa4_absent", import_transformers=True) is None


_ORDER_PRELUDE = """
import sys, importlib.util
sys.path[:0] = [{torch_ext!r}, {root!r}]
def load_built(variant):  # as kernels.get_kernel does: the package under a name of its own
    spec = importlib.util.spec_from_file_location("fa4_hub_build", variant + "/__init__.py",
                                                  submodule_search_locations=[variant])
    module = importlib.util.module_from_spec(spec)
    sys.modules["fa4_hub_build"] = module
    spec.loader.exec_module(module)
    return module
"""

_ORDER_MODEL = """
import transformers
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1)
model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="fa4")
print("built", model.config._attn_implementation, ALL_ATTENTION_FUNCTIONS["fa4"].__module__,
      ALL_MASK_ATTENTION_FUNCTIONS["fa4"].__module__)
"""


def _run_order(code: str, **fmt) -> str:
    import subprocess

    prelude = _ORDER_PRELUDE.format(torch_ext=str(REPO_ROOT / "torch-ext"), root=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", prelude + code + _ORDER_MODEL], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_fa4_registered_when_flash_attn4_is_imported_before_transformers():
    out = _run_order("""
import flash_attn4
assert not [m for m in sys.modules if m.split(".")[0] == "transformers"], "importing flash_attn4 imported transformers"
""")
    assert "built fa4 flash_attn4.transformers_adapter flash_attn4.transformers_adapter" in out


def test_fa4_registered_when_flash_attn4_is_imported_after_transformers():
    out = _run_order("""
import transformers, transformers.modeling_utils  # the registry modules are loaded: registration is at once
import flash_attn4
""")
    assert "built fa4 flash_attn4.transformers_adapter flash_attn4.transformers_adapter" in out
    # the lazy top-level package alone (registries not loaded yet): the hook registers later
    out = _run_order("""
import transformers
import flash_attn4
assert "transformers.modeling_utils" not in sys.modules
""")
    assert "built fa4 flash_attn4.transformers_adapter" in out


@pytest.mark.parametrize("first", ["hub_build", "transformers"])
def test_fa4_registered_by_the_hub_build_alone(hub_build, first):
    """Only the kernel loaded (as kernels.get_kernel loads it: its own module name), in either order."""
    variant = str(hub_build / "build" / "torch-cuda")
    load = f"built = load_built({variant!r})\n"
    code = load + "import transformers\n" if first == "hub_build" else "import transformers\n" + load
    out = _run_order(code + "assert 'flash_attn4' not in sys.modules\n")
    assert "built fa4 fa4_hub_build.transformers_adapter fa4_hub_build.transformers_adapter" in out


def test_import_hook_is_idempotent_and_never_breaks_an_import(monkeypatch):
    before = list(sys.meta_path)
    ta.install_import_hook()
    ta.install_import_hook()
    # one finder per module instance: a Hub build imported in the same process (its own module name)
    # installs its own, which registers its own functions
    assert sum(isinstance(f, ta._RegistrationFinder) for f in sys.meta_path) == 1
    # a failing registration warns instead of failing transformers' import
    monkeypatch.setattr(ta, "_register_mask", lambda name: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.warns(UserWarning, match="boom"):
        ta._register_part(ta._MASK_MODULE, "fa4")
    assert [f for f in sys.meta_path if f not in before] == []


def test_hub_constants_match_build_toml():
    cfg = tomllib.loads((REPO_ROOT / "build.toml").read_text())  # tracked in git: a missing one is a failure
    assert ta.HUB_REPO_ID == cfg["general"]["hub"]["repo-id"]
    assert ta.HUB_VERSION == cfg["general"]["version"]
    assert ta.HUB_ATTN_IMPLEMENTATION == f"{cfg['general']['hub']['repo-id']}@v{cfg['general']['version']}"


# ----------------------------------------------------------------------------------------------
# The attention function on its own
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_dense_layout_gqa_and_values(backend, hq, hk, causal):
    gen = torch.Generator().manual_seed(hq * 10 + hk + causal)
    b, s, d = 2, 37, 32
    q, k, v = _qkv(b, hq, hk, s, s, d, gen=gen)
    out, weights = ta.attention_forward(_module(causal), q, k, v, None, scaling=0.3)
    assert weights is None
    assert out.shape == (b, s, hq, d)
    (call,) = backend.calls
    assert call["fn"] == "dense"
    # (B, S, H, D) views of the inputs, KV heads not repeated, no copy made by the adapter.
    assert call["q"].shape == (b, s, hq, d) and call["k"].shape == (b, s, hk, d)
    assert call["q"].data_ptr() == q.data_ptr() and call["k"].data_ptr() == k.data_ptr()
    assert torch.equal(call["k"], k.transpose(1, 2))
    assert call["causal"] is causal and call["window_size"] == (-1, -1)
    assert call["softmax_scale"] == 0.3 and call["softcap"] == 0.0 and call["learnable_sink"] is None
    allowed = _causal_allowed(b, s, s) if causal else torch.ones(b, s, s, dtype=torch.bool)
    torch.testing.assert_close(out, _sdpa(q, k, v, allowed, scale=0.3), atol=1e-5, rtol=1e-5)


def test_is_causal_kwarg_overrides_module(backend):
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(1, 2, 2, 9, 9, gen=gen)
    out, _ = ta.attention_forward(_module(is_causal=True), q, k, v, None, is_causal=False)
    assert backend.calls[-1]["causal"] is False
    torch.testing.assert_close(out, _sdpa(q, k, v, torch.ones(1, 9, 9, dtype=torch.bool)), atol=1e-5, rtol=1e-5)
    ta.attention_forward(_module(is_causal=False), q, k, v, None, is_causal=True)
    assert backend.calls[-1]["causal"] is True


def test_chunk_after_cache_is_bottom_right_causal(backend):
    gen = torch.Generator().manual_seed(2)
    b, sq, sk = 2, 5, 19
    q, k, v = _qkv(b, 4, 2, sq, sk, gen=gen)
    out, _ = ta.attention_forward(_module(), q, k, v, None)
    assert backend.calls[-1]["causal"] is True
    torch.testing.assert_close(out, _sdpa(q, k, v, _causal_allowed(b, sq, sk)), atol=1e-5, rtol=1e-5)


def test_single_query_decode_step_is_sent_causal(backend):
    """One bottom-right-aligned query sees every key, causal or not: the step is sent causal, as
    FlashAttention-style decode callers send it (one kernel for both, the one the shipped set holds)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = _qkv(3, 4, 2, 1, 23, gen=gen)
    out, _ = ta.attention_forward(_module(), q, k, v, None)
    assert backend.calls[-1]["causal"] is True and backend.calls[-1]["num_splits"] == 0
    torch.testing.assert_close(out, _sdpa(q, k, v, torch.ones(3, 1, 23, dtype=torch.bool)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_mask_unpads_to_varlen_and_repads_with_zeros(backend, side):
    gen = torch.Generator().manual_seed(4 + (side == "right"))
    b, s, hq, hk, d = 4, 29, 6, 2, 32
    lengths = torch.randint(1, s + 1, (b,), generator=gen)
    lengths[0] = s  # one full row
    valid = _left_padding_mask(lengths, s)
    if side == "right":
        valid = valid.flip(-1)
    q, k, v = _qkv(b, hq, hk, s, s, d, gen=gen)
    out, _ = ta.attention_forward(_module(), q, k, v, valid)
    assert out.shape == (b, s, hq, d)
    (call,) = backend.calls
    assert call["fn"] == "varlen"
    expected_cu = F.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    assert torch.equal(call["cu_seqlens_q"], expected_cu) and torch.equal(call["cu_seqlens_k"], expected_cu)
    assert call["max_seqlen_q"] == int(lengths.max()) and isinstance(call["max_seqlen_q"], int)
    assert call["q"].shape == (int(lengths.sum()), hq, d) and call["k"].shape == (int(lengths.sum()), hk, d)
    assert torch.count_nonzero(out[~valid]) == 0  # padded query positions are zeros
    # Right padding keeps queries and keys top-left aligned, i.e. plain causal within each row.
    i = torch.arange(s).view(-1, 1)
    j = torch.arange(s).view(1, -1)
    if side == "left":
        allowed = _causal_allowed(b, s, s, key_valid=valid)
    else:
        allowed = (j <= i) & valid[:, None, :]
    ref = _sdpa(q, k, v, allowed)
    torch.testing.assert_close(out[valid], ref[valid], atol=1e-5, rtol=1e-5)


def test_padded_decode_step_and_padded_chunk_read_the_cache_in_place(backend):
    """Left-padded steps on a cache go to flash_attn_with_kvcache on the (B * Hk, S, 1, D) rows of
    transformers' (B, Hk, S, D) cache, with the padding as cache_leftpad: no copy of the keys."""
    gen = torch.Generator().manual_seed(6)
    b, sk, hq, hk = 3, 17, 6, 2
    lengths = torch.tensor([17, 9, 3])
    valid = _left_padding_mask(lengths, sk)
    for sq in (1, 3):  # decode step, then a 3-token chunk on top of the cache
        q, k, v = _qkv(b, hq, hk, sq, sk, gen=gen)
        out, _ = ta.attention_forward(_module(), q, k, v, valid)
        call = backend.calls[-1]
        assert call["fn"] == "kvcache" and call["causal"] is True
        assert call["q"].shape == (b * hk, sq, hq // hk, 32) and call["k"].shape == (b * hk, sk, 1, 32)
        assert call["k"].data_ptr() == k.data_ptr()  # the cache itself, not a copy
        assert call["cache_leftpad"].tolist() == (sk - lengths).repeat_interleave(hk).tolist()
        assert call["cache_seqlens"].tolist() == [sk] * (b * hk)
        assert call["num_splits"] == 0  # automatic split-KV
        ref = _sdpa(q, k, v, _causal_allowed(b, sq, sk, key_valid=valid))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_cache_step_with_holes_or_per_head_sinks_unpads(backend):
    """Masks whose valid keys are not one range per row, and sinks that differ between KV heads'
    query groups, cannot use the cache rows: they take transformers' unpadding and varlen."""
    gen = torch.Generator().manual_seed(16)
    b, sk, hq, hk = 2, 13, 4, 2
    valid = _left_padding_mask([13, 8], sk)
    valid[0, 5] = False  # a hole
    q, k, v = _qkv(b, hq, hk, 1, sk, gen=gen)
    out, _ = ta.attention_forward(_module(), q, k, v, valid)
    assert backend.calls[-1]["fn"] == "varlen"
    torch.testing.assert_close(out, _sdpa(q, k, v, _causal_allowed(b, 1, sk, key_valid=valid)), atol=1e-5, rtol=1e-5)
    sinks = torch.randn(hq, generator=gen)
    left = _left_padding_mask([13, 8], sk)
    out, _ = ta.attention_forward(_module(), q, k, v, left, s_aux=sinks)
    assert backend.calls[-1]["fn"] == "varlen" and backend.calls[-1]["learnable_sink"] is not None
    # one KV head: its query group holds every head, so the sinks fit the cache rows
    q1, k1, v1 = _qkv(b, hq, 1, 1, sk, gen=gen)
    ta.attention_forward(_module(), q1, k1, v1, left, s_aux=sinks)
    assert backend.calls[-1]["fn"] == "kvcache" and torch.equal(backend.calls[-1]["learnable_sink"], sinks)


def test_static_cache_tail_is_not_attended(backend):
    """A static cache's keys run past the tokens seen: the mask (shorter than the keys) bounds them."""
    gen = torch.Generator().manual_seed(17)
    b, s_cache, seen, hq, hk = 2, 40, 11, 4, 2
    q, k, v = _qkv(b, hq, hk, 1, s_cache, gen=gen)
    k[:, :, seen:] = 1e3  # garbage in the unused tail would dominate the softmax
    mask = ta.padding_mask(b, 1, s_cache, q_offset=seen - 1, attention_mask=None)
    out, _ = ta.attention_forward(_module(), q, k, v, mask)
    call = backend.calls[-1]
    assert call["fn"] == "kvcache" and call["cache_seqlens"].tolist() == [seen] * (b * hk)
    assert call["cache_leftpad"] is None  # nothing left-padded (one sync per mask tells)
    expected = _sdpa(q[:, :, :, :], k[:, :, :seen], v[:, :, :seen], torch.ones(b, 1, seen, dtype=torch.bool))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_key_ranges():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 0, 0]], dtype=torch.bool)
    leftpad, end, contiguous = ta._key_ranges(mask)
    assert leftpad.tolist() == [2, 0, 1] and end.tolist() == [5, 6, 4] and not bool(contiguous)
    assert bool(ta._key_ranges(mask[:2])[2])


def test_noncausal_mask_with_fewer_queries_pads_keys_only(backend):
    gen = torch.Generator().manual_seed(7)
    b, sq, sk = 2, 5, 11  # e.g. cross-attention: the mask is the encoder's padding mask
    valid = _left_padding_mask([11, 4], sk).flip(-1)
    q, k, v = _qkv(b, 2, 2, sq, sk, gen=gen)
    out, _ = ta.attention_forward(_module(is_causal=False), q, k, v, valid)
    ref = _sdpa(q, k, v, valid[:, None, :].expand(b, sq, sk))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_mask_shorter_than_keys_ignores_the_cache_tail(backend):
    """Static cache: keys have the cache's full length, the mask covers the tokens seen so far."""
    gen = torch.Generator().manual_seed(8)
    b, sq, seen, cache = 2, 1, 13, 32
    q, k, v = _qkv(b, 4, 2, sq, cache, gen=gen)
    k[:, :, seen:] = 1e4  # garbage in the unused tail would dominate the softmax
    v[:, :, seen:] = 1e4
    for valid in (torch.ones(b, seen, dtype=torch.bool), _left_padding_mask([13, 6], seen)):
        out, _ = ta.attention_forward(_module(), q, k, v, valid)
        call = backend.calls[-1]
        # the cache rows in place, bounded by the mask: its left padding and its length
        assert call["fn"] == "kvcache" and call["k"].shape[1] == cache
        assert call["cache_seqlens"].tolist() == [seen] * 4
        pads = (seen - valid.sum(-1)).repeat_interleave(2)
        if pads.any():
            assert call["cache_leftpad"].tolist() == pads.tolist()
        else:  # no row left-padded: no cache_leftpad, the KV-cache call's common (batched) case
            assert call["cache_leftpad"] is None
        ref = _sdpa(q[..., :seen, :], k[:, :, :seen], v[:, :, :seen], _causal_allowed(b, sq, seen, key_valid=valid))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_padding_mask_function_rules():
    full = torch.ones(2, 10, dtype=torch.bool)
    assert ta.padding_mask(2, 10, 10, attention_mask=full) is None
    padded = full.clone()
    padded[1, :5] = False
    got = ta.padding_mask(2, 10, 10, attention_mask=padded)
    assert got.dtype == torch.bool and torch.equal(got, padded)
    assert torch.equal(ta.padding_mask(2, 10, 10, attention_mask=padded.long()), padded)
    # sliding-window cache layers: the mask is cut to the last kv_length columns...
    assert torch.equal(ta.padding_mask(2, 1, 6, kv_offset=4, attention_mask=padded), padded[:, -6:])
    # ...and is dropped when that part has no padding
    assert ta.padding_mask(2, 1, 5, kv_offset=5, attention_mask=padded) is None
    # dynamic cache, nothing padded: nothing to do
    assert ta.padding_mask(2, 1, 11, q_offset=10, attention_mask=None) is None
    assert ta.padding_mask(2, 7, 7, attention_mask=None) is None
    # static cache (keys longer than what was seen): a (batch, kv_length) mask, False on the unused
    # tail, built from the tensor query offset StaticLayer gives (no sync), padded or not
    m = ta.padding_mask(2, 1, 64, q_offset=torch.tensor(10), attention_mask=None, device="cpu")
    assert m.dtype == torch.bool and m.shape == (2, 64) and m[:, :11].all() and not m[:, 11:].any()
    m = ta.padding_mask(2, 1, 64, q_offset=9, attention_mask=padded)
    assert m.shape == (2, 64) and torch.equal(m[:, :10], padded) and not m[:, 10:].any()
    m = ta.padding_mask(2, 1, 64, q_offset=9, attention_mask=full)
    assert m.shape == (2, 64) and m[:, :10].all() and not m[:, 10:].any()
    # a sliding-window layer of a static cache holds only keys in use
    assert ta.padding_mask(2, 1, 8, q_offset=torch.tensor(20), kv_offset=13, attention_mask=None) is None


def test_packed_position_ids_go_varlen(backend):
    gen = torch.Generator().manual_seed(9)
    lens = [7, 1, 12, 5]
    total = sum(lens)
    q, k, v = _qkv(1, 4, 2, total, total, gen=gen)
    position_ids = torch.cat([torch.arange(n) for n in lens]).view(1, -1)
    out, _ = ta.attention_forward(_module(), q, k, v, None, position_ids=position_ids)
    (call,) = backend.calls
    assert call["fn"] == "varlen"
    assert call["cu_seqlens_q"].tolist() == [0, 7, 8, 20, 25] and call["max_seqlen_q"] == 12
    seq_id = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    allowed = _causal_allowed(1, total, total) & (seq_id[:, None] == seq_id[None, :])
    torch.testing.assert_close(out, _sdpa(q, k, v, allowed), atol=1e-5, rtol=1e-5)
    # plain increasing positions (one sequence, possibly offset) stay dense
    ta.attention_forward(_module(), q, k, v, None, position_ids=torch.arange(total).view(1, -1) + 3)
    assert backend.calls[-1]["fn"] == "dense"


def test_packed_position_ids_checked_once_per_forward(backend, monkeypatch):
    """Every layer passes the same position_ids: transformers' check (a host sync on a GPU) runs
    once, until the tensor changes in place or another one comes; inference tensors (no version
    counter) are checked every call."""
    mfau = ta._flash_utils()
    checks = []
    real = mfau._is_packed_sequence
    monkeypatch.setattr(mfau, "_is_packed_sequence", lambda *a: checks.append(1) or real(*a))
    gen = torch.Generator().manual_seed(19)
    lens = [6, 9, 3]
    total = sum(lens)
    q, k, v = _qkv(1, 4, 2, total, total, gen=gen)
    position_ids = torch.cat([torch.arange(n) for n in lens]).view(1, -1)
    outs = [ta.attention_forward(_module(), q, k, v, None, position_ids=position_ids)[0] for _ in range(4)]
    assert len(checks) == 1 and [c["fn"] for c in backend.calls] == ["varlen"] * 4
    assert all(c["cu_seqlens_q"].tolist() == [0, 6, 15, 18] for c in backend.calls)
    assert all(torch.equal(o, outs[0]) for o in outs)
    position_ids.copy_(torch.arange(total).view(1, -1))  # in place: now one sequence
    ta.attention_forward(_module(), q, k, v, None, position_ids=position_ids)
    assert len(checks) == 2 and backend.calls[-1]["fn"] == "dense"
    other = torch.cat([torch.arange(n) for n in (10, 8)]).view(1, -1)  # a new tensor
    ta.attention_forward(_module(), q, k, v, None, position_ids=other)
    assert len(checks) == 3 and backend.calls[-1]["cu_seqlens_q"].tolist() == [0, 10, 18]
    with torch.inference_mode():
        frozen = torch.cat([torch.arange(n) for n in lens]).view(1, -1)
        for _ in range(2):
            ta.attention_forward(_module(), q, k, v, None, position_ids=frozen)
    assert len(checks) == 5 and backend.calls[-1]["cu_seqlens_q"].tolist() == [0, 6, 15, 18]


@pytest.mark.parametrize("as_tensor", [False, True])
def test_cu_seq_lens_kwargs(backend, as_tensor):
    gen = torch.Generator().manual_seed(10 + as_tensor)
    lens = torch.tensor([3, 10, 6])
    cu = F.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
    total = int(lens.sum())
    q, k, v = _qkv(1, 4, 4, total, total, gen=gen)
    mx = lens.max() if as_tensor else int(lens.max())
    out, _ = ta.attention_forward(_module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                  max_length_q=mx, max_length_k=mx)
    (call,) = backend.calls
    assert call["fn"] == "varlen" and torch.equal(call["cu_seqlens_k"], cu)
    assert type(call["max_seqlen_q"]) is int and type(call["max_seqlen_k"]) is int and call["max_seqlen_q"] == 10
    seq_id = torch.repeat_interleave(torch.arange(3), lens)
    allowed = _causal_allowed(1, total, total) & (seq_id[:, None] == seq_id[None, :])
    torch.testing.assert_close(out, _sdpa(q, k, v, allowed), atol=1e-5, rtol=1e-5)


def test_sliding_window_follows_transformers_flash_convention(backend):
    gen = torch.Generator().manual_seed(12)
    b, s, w = 2, 40, 9
    q, k, v = _qkv(b, 4, 2, s, s, gen=gen)
    out, _ = ta.attention_forward(_module(), q, k, v, None, sliding_window=w)
    assert backend.calls[-1]["window_size"] == (w - 1, 0)
    torch.testing.assert_close(out, _sdpa(q, k, v, _causal_allowed(b, s, s, window=w)), atol=1e-5, rtol=1e-5)
    # non-causal: symmetric (w - 1, w - 1), as transformers' flash path sends it
    ta.attention_forward(_module(is_causal=False), q, k, v, None, sliding_window=w)
    assert backend.calls[-1]["window_size"] == (w - 1, w - 1)
    # keys no longer than the window: no window at all (transformers does the same)
    ta.attention_forward(_module(), q[:, :, :w], k[:, :, :w], v[:, :, :w], None, sliding_window=w)
    assert backend.calls[-1]["window_size"] == (-1, -1)
    # decode step with a window: right 0 and the left edge still applies
    q1 = q[:, :, -1:]
    out1, _ = ta.attention_forward(_module(), q1, k, v, None, sliding_window=w)
    assert backend.calls[-1]["window_size"] == (w - 1, 0)
    torch.testing.assert_close(out1, _sdpa(q1, k, v, _causal_allowed(b, 1, s, window=w)), atol=1e-5, rtol=1e-5)


def test_softcap_scaling_and_sinks_pass_through(backend):
    gen = torch.Generator().manual_seed(13)
    b, s, hq, hk, d = 2, 21, 4, 2, 32
    q, k, v = _qkv(b, hq, hk, s, s, d, gen=gen)
    q = q * 4  # large logits, so that the cap matters
    sinks = torch.randn(hq, generator=gen).to(torch.bfloat16)
    out, _ = ta.attention_forward(_module(), q, k, v, None, scaling=0.2, softcap=3.0, s_aux=sinks)
    call = backend.calls[-1]
    assert call["softcap"] == 3.0 and call["softmax_scale"] == 0.2
    assert call["learnable_sink"].dtype == torch.float32 and torch.equal(call["learnable_sink"], sinks.float())
    # eager formula: capped scores, a per-head sink logit in the softmax denominator
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = 3.0 * torch.tanh(q @ kr.transpose(-1, -2) * 0.2 / 3.0)
    scores = scores.masked_fill(~_causal_allowed(b, s, s)[:, None], float("-inf"))
    logits = torch.cat([scores, sinks.float().view(1, hq, 1, 1).expand(b, hq, s, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    torch.testing.assert_close(out, (probs @ vr).transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_errors(backend):
    gen = torch.Generator().manual_seed(14)
    q, k, v = _qkv(1, 2, 2, 8, 8, gen=gen)
    with pytest.raises(NotImplementedError, match="dropout"):
        ta.attention_forward(_module(training=True), q, k, v, None, dropout=0.1)
    assert backend.calls == []
    ta.attention_forward(_module(training=False), q, k, v, None, dropout=0.1)  # eval: dropout is off
    ta.attention_forward(_module(training=True), q, k, v, None, dropout=0.0)
    with pytest.raises(ValueError, match="2-D"):
        ta.attention_forward(_module(), q, k, v, torch.zeros(1, 1, 8, 8))
    with pytest.raises(ValueError, match="cu_seq_lens"):
        ta.attention_forward(_module(), q, k, v, None, cu_seq_lens_q=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError):
        ta.attention_forward(_module(), q[0], k[0], v[0], None)


# ----------------------------------------------------------------------------------------------
# Whole models: attn_implementation="fa4" (reference backend) against transformers' own
# ----------------------------------------------------------------------------------------------

VOCAB = 256


def _llama_config(**overrides):
    cfg = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    return transformers.LlamaConfig(**cfg)


def _model_pair(config, impl_ref="sdpa", impl="fa4", seed=0):
    # Each model gets its own config: from_config records the implementation on the config object.
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl_ref).eval()
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl).eval()
    ours.load_state_dict(ref.state_dict())
    assert ref.config._attn_implementation == impl_ref and ours.config._attn_implementation == impl
    assert ref.config is not ours.config
    return ref, ours


def _left_padded_batch(lengths, total, gen):
    ids = torch.randint(3, VOCAB, (len(lengths), total), generator=gen)
    mask = _left_padding_mask(lengths, total).long()
    return ids.masked_fill(mask == 0, 0), mask


@torch.no_grad()
def test_llama_logits_match_sdpa(backend):
    gen = torch.Generator().manual_seed(20)
    ref, ours = _model_pair(_llama_config())
    ids = torch.randint(3, VOCAB, (2, 33), generator=gen)
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)
    assert len(backend.fns("dense")) == ours.config.num_hidden_layers  # our path ran, once per layer
    assert all(c["k"].shape[-2] == 2 for c in backend.calls)  # 2 KV heads, not repeated


@torch.no_grad()
def test_llama_left_padding_logits_match_sdpa(backend):
    gen = torch.Generator().manual_seed(21)
    ref, ours = _model_pair(_llama_config())
    ids, mask = _left_padded_batch([30, 17, 4], 30, gen)
    lo, lr = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(lo[valid], lr[valid], atol=1e-4, rtol=1e-4)
    assert len(backend.fns("varlen")) == ours.config.num_hidden_layers and not backend.fns("dense")


@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_llama_greedy_generation_matches_sdpa(backend, cache_implementation, grad_mode):
    """Under no_grad and under inference_mode, whose tensors (the mask, the cache) have no version
    counter."""
    with grad_mode():
        _greedy_generation_matches_sdpa(backend, cache_implementation)


def _greedy_generation_matches_sdpa(backend, cache_implementation):
    gen = torch.Generator().manual_seed(22)
    ref, ours = _model_pair(_llama_config(), seed=1)
    ids, mask = _left_padded_batch([19, 11, 6], 19, gen)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    if cache_implementation:
        kw["cache_implementation"] = cache_implementation
    out_ref = ref.generate(ids, **kw)
    out = ours.generate(ids, **kw)
    assert out.shape == (3, 19 + 8)
    assert torch.equal(out, out_ref)
    # prefill and the 7 decode steps (single-query calls) of every layer went through us
    layers = ours.config.num_hidden_layers
    # (left padding: every decode step reads the cache in place; the prefill unpads to varlen, or with
    # a static cache, whose keys run past the prompt, reads the cache in place too)
    decode = [c for c in backend.calls if c["fn"] == "kvcache" and c["q"].shape[1] == 1]
    assert len(decode) == 7 * layers and len(backend.calls) == 8 * layers
    prefill = "kvcache" if cache_implementation == "static" else "varlen"
    assert [c["fn"] for c in backend.calls[:layers]] == [prefill] * layers
    # and without padding, generation uses the dense path (no mask) or the seen-length mask (static)
    backend.calls.clear()
    full = torch.randint(3, VOCAB, (2, 12), generator=gen)
    kw.pop("attention_mask")
    assert torch.equal(ours.generate(full, attention_mask=torch.ones_like(full), **kw),
                       ref.generate(full, attention_mask=torch.ones_like(full), **kw))


_OPAQUE_KVCACHE_RUNS = []


@torch.library.custom_op("fa4_adapter_test::kvcache_ref", mutates_args=())
def _kvcache_ref_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                    cache_leftpad: torch.Tensor, softmax_scale: float, causal: bool, window_left: int,
                    window_right: int, softcap: float) -> torch.Tensor:
    """The reference flash_attn_with_kvcache as an opaque op, like the real one: torch.compile sees
    its fake, not its body (a record of each run is kept, since a compiled graph replays it)."""
    _OPAQUE_KVCACHE_RUNS.append(q.shape)
    return RefBackend().flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, softmax_scale=softmax_scale,
        causal=causal, window_size=(window_left, window_right), softcap=softcap)


@_kvcache_ref_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, cache_leftpad, softmax_scale, causal, window_left, window_right, softcap):
    return q.new_empty(*q.shape[:-1], v_cache.shape[-1])


def _opaque_kvcache(q, k_cache, v_cache, cache_seqlens=None, cache_leftpad=None, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, learnable_sink=None, num_splits=0, **unused):
    assert learnable_sink is None and not unused
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _kvcache_ref_op(q, k_cache, v_cache, cache_seqlens, cache_leftpad, scale, causal, window_size[0],
                           window_size[1], softcap)


@pytest.mark.parametrize("padded", [False, True])
@torch.no_grad()
def test_compiled_static_cache_decode_is_one_graph_without_recompiles(backend, monkeypatch, padded):
    """generate() with a static cache compiles the decode step (transformers does so on a GPU; forced here
    on the CPU): with "fa4" the step must trace as one graph (fullgraph=True: no graph break), must not
    recompile as the sequence grows, and must give the tokens that eager SDPA gives."""
    monkeypatch.setattr(flash_attn4, "flash_attn_with_kvcache", _opaque_kvcache)
    gen = torch.Generator().manual_seed(26 + padded)
    ref, ours = _model_pair(_llama_config(), seed=3)
    if padded:
        ids, mask = _left_padded_batch([16, 9], 16, gen)
    else:
        ids = torch.randint(3, VOCAB, (2, 16), generator=gen)
        mask = torch.ones_like(ids)
    new_tokens = 12
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
              cache_implementation="static")
    compile_config = transformers.CompileConfig(fullgraph=True, backend="eager", mode=None)
    compile_config._compile_all_devices = True  # transformers compiles by itself on accelerators only
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _OPAQUE_KVCACHE_RUNS.clear()
    # transformers 5.17's generate passes the mask to the first decode step of an unpadded batch only
    # (later steps get none): one recompile there, from transformers' kwargs, never one per token
    graphs = 2 if _TRANSFORMERS_VERSION < (5, 18) and not padded else 1
    with torch._dynamo.config.patch(error_on_recompile=graphs == 1):  # a recompile for a later token raises
        out = ours.generate(ids, compile_config=compile_config, **kw)
        assert torch.equal(out, ref.generate(ids, **kw))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        # a second prompt of the same shape reuses the cache and the graph(s)
        ids2 = torch.randint(3, VOCAB, ids.shape, generator=gen).masked_fill(mask == 0, 0)
        assert torch.equal(ours.generate(ids2, compile_config=compile_config, **kw), ref.generate(ids2, **kw))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert not torch._dynamo.utils.counters["graph_break"]
    # every decode step of every layer ran our KV-cache path (the prefill runs eagerly, through it too)
    layers = ours.config.num_hidden_layers
    assert len(_OPAQUE_KVCACHE_RUNS) == 2 * new_tokens * layers
    assert not [c for c in backend.calls if c["fn"] != "kvcache"]


@torch.no_grad()
def test_llama_packed_sequences_match_separate_runs(backend):
    gen = torch.Generator().manual_seed(23)
    ref, ours = _model_pair(_llama_config())
    lens = [9, 14, 5]
    seqs = [torch.randint(3, VOCAB, (1, n), generator=gen) for n in lens]
    packed = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lens]).view(1, -1)
    logits = ours(packed, position_ids=position_ids).logits
    expected = torch.cat([ref(s).logits for s in seqs], dim=1)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert backend.calls and all(c["fn"] == "varlen" for c in backend.calls)
    # the same through FlashAttentionKwargs (cu_seq_lens + 0-d tensor max lengths)
    backend.calls.clear()
    cu = F.pad(torch.cumsum(torch.tensor(lens), 0), (1, 0)).to(torch.int32)
    mx = torch.tensor(max(lens))
    logits2 = ours(packed, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                   max_length_q=mx, max_length_k=mx).logits
    torch.testing.assert_close(logits2, expected, atol=1e-4, rtol=1e-4)
    assert all(type(c["max_seqlen_q"]) is int for c in backend.calls)


@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_padding_free_training_step_with_flattening_collator(backend, flash_kwargs):
    """DataCollatorWithFlattening packs a batch into one row (position_ids restart; with
    return_flash_attn_kwargs=True also cu_seq_lens / max_length): one training step's loss and every
    parameter's gradient must equal SDPA's on the sequences run one by one."""
    gen = torch.Generator().manual_seed(27 + flash_kwargs)
    ref, ours = _model_pair(_llama_config(), seed=4)
    lens = [11, 3, 17, 6]
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lens]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collator([{"input_ids": s.tolist()} for s in seqs])
    assert ("cu_seq_lens_q" in batch) is flash_kwargs
    ours.train()
    ours.zero_grad()
    loss = ours(**batch).loss  # transformers' loss: mean over the targets that are not -100
    loss.backward()
    ref.train()
    ref.zero_grad()
    total = sum(F.cross_entropy(ref(s[None]).logits[0, :-1], s[1:], reduction="sum") for s in seqs)
    ref_loss = total / sum(n - 1 for n in lens)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for (name, p), (_, p_ref) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-4, msg=name)
    layers = ours.config.num_hidden_layers
    assert [c["fn"] for c in backend.calls] == ["varlen"] * layers
    assert all(c["cu_seqlens_q"].tolist() == [0, 11, 14, 31, 37] and c["max_seqlen_q"] == 17 for c in backend.calls)


@torch.no_grad()
def test_llama4_chunked_attention_within_one_chunk_runs_and_past_it_raises(backend):
    """Chunked layers: inside one chunk they are causal attention (must match SDPA); past it the
    kernels cannot express the chunks, so fa4 raises as transformers' flash path does."""
    if not hasattr(transformers, "Llama4TextConfig"):
        pytest.skip("no Llama 4 in this transformers")
    cfg = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=8, num_local_experts=2,
        pad_token_id=0)
    torch.manual_seed(6)
    ref = transformers.Llama4ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    ours = transformers.Llama4ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="fa4").eval()
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(3, VOCAB, (2, 8))
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="chunked attention"):
        ours(torch.randint(3, VOCAB, (2, 9)))
    # the sliding-window mask call passes local_size too: it must not be mistaken for a chunk
    assert ta.padding_mask(1, 20, 20, config=types.SimpleNamespace(sliding_window=8), local_size=8) is None


def test_llama_training_with_dropout_raises(backend):
    _, ours = _model_pair(_llama_config(attention_dropout=0.1))
    ours.train()
    ids = torch.randint(3, VOCAB, (1, 8))
    with pytest.raises(NotImplementedError, match="dropout"):
        ours(ids)


@torch.no_grad()
def test_gemma2_softcap_scaling_sliding_window_match_eager(backend):
    gen = torch.Generator().manual_seed(24)
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=8, attn_logit_softcapping=2.0,
        query_pre_attn_scalar=20, final_logit_softcapping=None, pad_token_id=0,
    )
    ref, ours = _model_pair(cfg, impl_ref="eager")
    for layer in ref.model.layers:  # make the cap bite: larger q/k projections
        layer.self_attn.q_proj.weight.mul_(8)
    ours.load_state_dict(ref.state_dict())
    ids, mask = _left_padded_batch([27, 15], 27, gen)
    lo, lr = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(lo[valid], lr[valid], atol=1e-4, rtol=1e-4)
    windows = {c["window_size"] for c in backend.calls}
    assert windows == {(7, 0), (-1, -1)}  # one sliding layer, one full layer
    assert all(c["softcap"] == 2.0 and c["softmax_scale"] == pytest.approx(20 ** -0.5) for c in backend.calls)


@torch.no_grad()
def test_gpt_oss_sinks_match_eager(backend):
    gen = torch.Generator().manual_seed(25)
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        pad_token_id=0,
    )
    ref, ours = _model_pair(cfg, impl_ref="eager")
    for layer in ref.model.layers:
        layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=gen) * 2)
    ours.load_state_dict(ref.state_dict())
    ids, mask = _left_padded_batch([20, 13], 20, gen)
    lo, lr = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(lo[valid], lr[valid], atol=1e-4, rtol=1e-4)
    assert all(c["learnable_sink"] is not None for c in backend.calls)


# ----------------------------------------------------------------------------------------------
# The Hub string: transformers' own flash wrapper around our flash_attn_(varlen_)func
# ----------------------------------------------------------------------------------------------


# The package's real entry points, taken before any test substitutes them (both are exported: a
# missing one fails this module's import instead of skipping its tests).
_REAL_FUNCTIONS = {n: getattr(flash_attn4, n) for n in ("flash_attn_func", "flash_attn_varlen_func")}


def _public_functions():
    return dict(_REAL_FUNCTIONS)


def test_transformers_sees_every_option_in_our_varlen_signature():
    """transformers decides what to pass by reading flash_attn_varlen_func's parameter names."""
    from transformers import modeling_flash_attention_utils as mfau

    fns = _public_functions()
    process = mfau._lazy_define_process_function(fns["flash_attn_varlen_func"])
    supports = process.keywords["supports_mapping"]
    for name in ("softmax_scale", "window_size", "softcap", "learnable_sink", "max_seqlen_q", "max_seqlen_k"):
        assert supports.get(name), f"transformers would not pass {name!r} to our flash_attn_varlen_func"
    for fn in fns.values():
        params = inspect.signature(fn).parameters
        assert {"causal", "softmax_scale", "window_size", "softcap", "learnable_sink"} <= set(params)
    # s_aux goes in as learnable_sink (the FA4 name); the legacy name must not shadow it
    assert not supports.get("s_aux")


@pytest.fixture
def hub_kernel(monkeypatch, backend):
    """Make transformers' Hub loader return our package, with the reference behind its real signatures."""
    from transformers import modeling_flash_attention_utils as mfau
    from transformers.integrations import hub_kernels

    fns = _public_functions()
    module = types.ModuleType("flash_attn4_hub_stand_in")
    for name, real in fns.items():
        # transformers reads the real signature (inspect follows __wrapped__), the reference runs.
        setattr(module, name, functools.wraps(real)(functools.partial(getattr(backend, name))))
    requests = []

    def fake_get_kernel(repo_id, revision=None, version=None, allow_all_kernels=False, **kwargs):
        requests.append(dict(repo_id=repo_id, revision=revision, version=version))
        return module

    monkeypatch.setattr(hub_kernels, "get_kernel", fake_get_kernel)
    monkeypatch.setattr(hub_kernels, "is_kernels_available", lambda: True)
    monkeypatch.setattr(mfau, "_loaded_implementation", None)  # forget any previously loaded flash impl
    return requests


@torch.no_grad()
def test_hub_string_runs_transformers_flash_wrapper_on_our_functions(hub_kernel, backend):
    gen = torch.Generator().manual_seed(30)
    ref, ours = _model_pair(_llama_config(), impl=ta.HUB_ATTN_IMPLEMENTATION)
    assert hub_kernel and hub_kernel[0]["repo_id"] == ta.HUB_REPO_ID
    assert hub_kernel[0]["revision"] == f"v{ta.HUB_VERSION}"  # the "@v1" pins the branch in every version
    ids, mask = _left_padded_batch([25, 9], 25, gen)
    lo, lr = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(lo[valid], lr[valid], atol=1e-4, rtol=1e-4)
    assert backend.fns("varlen")
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(ours.generate(ids, **kw), ref.generate(ids, **kw))


@torch.no_grad()
def test_hub_string_sliding_window_model(hub_kernel, backend):
    """transformers' wrapper sends causal=True with window (w-1, w-1): causal must clip the right side."""
    gen = torch.Generator().manual_seed(31)
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=6, pad_token_id=0, max_position_embeddings=256,
    )
    ref, ours = _model_pair(cfg, impl=ta.HUB_ATTN_IMPLEMENTATION)
    ids = torch.randint(3, VOCAB, (2, 24), generator=gen)
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)
    assert {c["window_size"] for c in backend.calls} == {(5, 5)} and all(c["causal"] for c in backend.calls)


@torch.no_grad()
def test_continuous_batching_runs_on_our_varlen_through_the_hub_string(hub_kernel, backend):
    """generate_batch (continuous batching) accepts flash-named implementations only: the Hub string
    runs it on our flash_attn_varlen_func (transformers' paged decode fast path is for FA2/FA3 names
    only); "fa4" is refused by transformers (README: which name works on which path)."""
    if not hasattr(transformers.GenerationMixin, "generate_batch"):
        pytest.skip("this transformers has no generate_batch")
    gen = torch.Generator().manual_seed(32)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (7, 13, 4)]
    config = transformers.GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    _, fa4_model = _model_pair(_llama_config(), seed=5)
    # 5.22: "Implementation fa4 is not supported for continuous batching"; 5.17 renames it "paged|fa4"
    # first and then finds no such implementation ("... is not supported")
    with pytest.raises(ValueError, match="not supported"):
        fa4_model.generate_batch(prompts, generation_config=config)
    if _TRANSFORMERS_VERSION < (5, 18) and importlib.util.find_spec("psutil") is None:
        pytest.skip("transformers 5.17 sizes the paged cache from psutil's view of CPU memory")
    ref, ours = _model_pair(_llama_config(), impl=ta.HUB_ATTN_IMPLEMENTATION, seed=5)
    out = ours.generate_batch(prompts, generation_config=config)
    got = sorted(o.generated_tokens for o in out.values())
    expected = sorted(ref.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist() for p in prompts)
    assert got == expected
    assert backend.calls and {c["fn"] for c in backend.calls} == {"varlen"}


# ----------------------------------------------------------------------------------------------
# The adapter as it ships: inside the Hub build, imported under a unique module name
# ----------------------------------------------------------------------------------------------


def _import_built(variant: Path):
    name = "flash_attn4_built_" + hashlib.sha256(str(variant).encode()).hexdigest()[:12]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, variant / "__init__.py",
                                                      submodule_search_locations=[str(variant)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@torch.no_grad()
def test_adapter_from_the_hub_build_calls_its_own_package(hub_build, monkeypatch):
    built = _import_built(hub_build / "build" / "torch-cuda")
    adapter = importlib.import_module(built.__name__ + ".transformers_adapter")
    assert adapter is not ta and adapter.__file__ != ta.__file__
    rb = RefBackend()
    monkeypatch.setattr(built, "flash_attn_func", rb.flash_attn_func)
    monkeypatch.setattr(built, "flash_attn_varlen_func", rb.flash_attn_varlen_func)
    name = adapter.register("fa4_built")
    gen = torch.Generator().manual_seed(40)
    ref, ours = _model_pair(_llama_config(), impl=name)
    ids, mask = _left_padded_batch([21, 8], 21, gen)
    lo, lr = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(lo[valid], lr[valid], atol=1e-4, rtol=1e-4)
    # the built adapter reached the built package's functions (not the source tree's)
    assert len(rb.fns("varlen")) == ours.config.num_hidden_layers
