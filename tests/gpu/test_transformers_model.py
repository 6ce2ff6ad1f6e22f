"""transformers models on the real kernels (GPU): attn_implementation="fa4" and the Hub string.

Small models built from configs (random weights, nothing downloaded), bf16 on CUDA. Tolerances follow
the FlashAttention convention: a bf16 run is compared with a float32 run of the same weights, and our
error may be at most twice the error of transformers' own bf16 attention (sdpa, or eager where sdpa
lacks a feature) plus a small absolute slack. Greedy generation must pick, at every step, a token
that the float32 model also ranks first up to that same bf16 noise, and must agree with the bf16
reference except where the float32 model itself sees a near tie. Training: one step's loss and every
parameter's gradient, fa4 (bf16) against an sdpa float32 model, held to twice the relative error of an
sdpa bf16 model (plain, left-padded and packed batches); those tests draw a fresh seed (printed).

Run: python -m pytest tests/gpu/test_transformers_model.py -m gpu -q
"""

from __future__ import annotations

import copy
import os
import types

import pytest
import torch

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")

import flash_attn4  # noqa: E402
from flash_attn4 import transformers_adapter as ta  # noqa: E402

DEVICE = "cuda"
DTYPE = torch.bfloat16
VOCAB = 256


@pytest.fixture(scope="module", autouse=True)
def registered():
    return ta.register()


def _llama_config(head_dim, **overrides):
    heads = 4
    cfg = dict(vocab_size=VOCAB, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
               num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=2, head_dim=head_dim,
               max_position_embeddings=512, initializer_range=0.05, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)
    cfg.update(overrides)
    return transformers.LlamaConfig(**cfg)


def _models(config, impl="fa4", ref_impl="sdpa", seed=0, tweak=None):
    """(float32 reference, bf16 reference, bf16 ours) with identical weights, in eval mode."""
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=ref_impl)
    if tweak is not None:
        with torch.no_grad():
            tweak(base)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
    ours.load_state_dict(base.state_dict())
    ref16 = copy.deepcopy(base)
    assert ours.config._attn_implementation == impl and ref16.config._attn_implementation == ref_impl
    return (base.to(DEVICE).eval(), ref16.to(DEVICE, DTYPE).eval(), ours.to(DEVICE, DTYPE).eval())


def _left_padded(lengths, total, gen):
    ids = torch.randint(3, VOCAB, (len(lengths), total), generator=gen)
    j = torch.arange(total).view(1, -1)
    mask = (j >= (total - torch.tensor(lengths)).view(-1, 1)).long()
    return ids.masked_fill(mask == 0, 0).to(DEVICE), mask.to(DEVICE)


def _assert_logits_close(ref32, ref16, ours, ids, mask=None, **kw):
    with torch.no_grad():
        l32 = ref32(ids, attention_mask=mask, **kw).logits.float()
        l16 = ref16(ids, attention_mask=mask, **kw).logits.float()
        lo = ours(ids, attention_mask=mask, **kw).logits.float()
    valid = mask.bool() if mask is not None else torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    assert torch.isfinite(lo[valid]).all()
    err_ours = (lo - l32)[valid].abs().max().item()
    err_ref = (l16 - l32)[valid].abs().max().item()
    slack = 1e-2 * l32[valid].abs().max().item()
    assert err_ours <= 2 * err_ref + slack, f"fa4 error {err_ours:.4g} vs bf16 reference error {err_ref:.4g}"
    return err_ref + slack


def _assert_greedy_ok(ref32, ids, mask, seq_ours, seq_ref16, tol):
    """Both bf16 continuations must be greedy under the float32 model up to tol; they may part ways only
    at a near tie of the float32 model."""
    prompt = ids.shape[1]
    new = seq_ours.shape[1] - prompt
    assert seq_ours.shape == seq_ref16.shape and new > 0
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], new)], dim=1)
    with torch.no_grad():
        logits = {name: ref32(seq, attention_mask=full_mask).logits.float()
                  for name, seq in (("ours", seq_ours), ("ref", seq_ref16))}
    for name, seq in (("ours", seq_ours), ("ref", seq_ref16)):
        step = logits[name][:, prompt - 1:-1]  # the logits that chose each new token
        chosen = step.gather(-1, seq[:, prompt:, None]).squeeze(-1)
        gap = step.max(-1).values - chosen
        assert (gap <= tol).all(), f"{name}: a generated token trails the float32 argmax by {gap.max():.4g} > {tol:.4g}"
    for b in range(seq_ours.shape[0]):
        diff = (seq_ours[b, prompt:] != seq_ref16[b, prompt:]).nonzero()
        if diff.numel():
            t = prompt + diff[0, 0].item()
            step = logits["ref"][b, t - 1]
            a, c = seq_ours[b, t].item(), seq_ref16[b, t].item()
            assert abs(step[a] - step[c]).item() <= tol, (
                f"row {b}: fa4 and the bf16 reference chose {a} and {c} at step {t - prompt}, not a near tie"
            )


@pytest.mark.parametrize("head_dim", [64, 128])
def test_llama_logits_without_and_with_left_padding(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    ref32, ref16, ours = _models(_llama_config(head_dim))
    ids = torch.randint(3, VOCAB, (2, 77), generator=gen).to(DEVICE)
    _assert_logits_close(ref32, ref16, ours, ids)
    ids, mask = _left_padded([130, 77, 5, 129], 130, gen)
    _assert_logits_close(ref32, ref16, ours, ids, mask)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_llama_greedy_generation(head_dim, cache_implementation):
    gen = torch.Generator().manual_seed(1000 + head_dim)
    ref32, ref16, ours = _models(_llama_config(head_dim), seed=1)
    ids, mask = _left_padded([40, 23, 9], 40, gen)
    tol = _assert_logits_close(ref32, ref16, ours, ids, mask)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    if cache_implementation:
        kw["cache_implementation"] = cache_implementation
    with torch.no_grad():
        seq_ours = ours.generate(ids, **kw)
        seq_ref16 = ref16.generate(ids, **kw)
    _assert_greedy_ok(ref32, ids, mask, seq_ours, seq_ref16, 2 * tol)


def test_llama_packed_sequences():
    gen = torch.Generator().manual_seed(7)
    ref32, ref16, ours = _models(_llama_config(128))
    lens = [33, 70, 1, 18]
    seqs = [torch.randint(3, VOCAB, (1, n), generator=gen).to(DEVICE) for n in lens]
    packed = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lens]).view(1, -1).to(DEVICE)
    with torch.no_grad():
        l32 = torch.cat([ref32(s).logits.float() for s in seqs], dim=1)
        l16 = torch.cat([ref16(s).logits.float() for s in seqs], dim=1)
        lo = ours(packed, position_ids=position_ids).logits.float()
    err_ours, err_ref = (lo - l32).abs().max().item(), (l16 - l32).abs().max().item()
    assert err_ours <= 2 * err_ref + 1e-2 * l32.abs().max().item()


# ---- training: one step's loss and parameter gradients ----

GRAD_EPS = 5e-3  # slack on the relative L2 error of a parameter's gradient


def _seed_from_urandom() -> int:
    s = int.from_bytes(os.urandom(4), "little")
    print(f"seed={s}")
    return s


def _token_loss_sum(logits, labels):
    """(sum of next-token cross entropies in float32, number of targets): logits[t] predicts labels[t + 1],
    targets equal to -100 are skipped, as in transformers' causal-LM loss."""
    logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    return loss, int((targets != -100).sum())


def _train_step(model, pieces):
    """One training step's loss (mean over all targets of all pieces) and every parameter's gradient (as
    float32). pieces: (input_ids, labels, forward kwargs), run one after the other and averaged together,
    so that separate per-sequence runs give the same loss as one packed run."""
    model.train()
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for ids, labels, kw in pieces:
        s, n = _token_loss_sum(model(ids, **kw).logits, labels)
        total, count = total + s, count + n
    loss = total / count
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient"
        grads[name] = p.grad.float()
    return loss.item(), grads


def _rel_l2(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _assert_training_step_close(ref32, ref16, ours, ref_pieces, our_pieces=None):
    """Loss within 1e-2 (relative) of the float32 model's; for every parameter,
    |g_fa4 - g_32| / |g_32| <= 2 * |g_sdpa16 - g_32| / |g_32| + GRAD_EPS (L2 norms over the tensor)."""
    l32, g32 = _train_step(ref32, ref_pieces)
    l16, g16 = _train_step(ref16, ref_pieces)
    lo, go = _train_step(ours, our_pieces if our_pieces is not None else ref_pieces)
    for name, g in (("float32 reference", g32), ("bf16 reference", g16)):
        bad = [n for n, t in g.items() if not torch.isfinite(t).all()]
        assert not bad, f"the {name} itself has non-finite gradients in {bad[:3]}"
    bad = [n for n, t in go.items() if not torch.isfinite(t).all()]
    assert not bad, f"fa4: non-finite gradients in {bad}"
    assert abs(lo - l32) <= 1e-2 * abs(l32), f"loss: fa4 {lo:.6g}, float32 {l32:.6g} (bf16 sdpa {l16:.6g})"
    failures = []
    for name in g32:
        err_ours, err_ref = _rel_l2(go[name], g32[name]), _rel_l2(g16[name], g32[name])
        if not err_ours <= 2 * err_ref + GRAD_EPS:
            failures.append(f"{name}: fa4 {err_ours:.3e} vs bf16 sdpa {err_ref:.3e}")
    assert not failures, "gradients further from float32 than 2x the bf16 reference + eps:\n" + "\n".join(failures)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.backward
def test_training_step_plain_batch(head_dim):
    seed = _seed_from_urandom()
    ref32, ref16, ours = _models(_llama_config(head_dim), seed=seed)
    ids = torch.randint(3, VOCAB, (3, 150)).to(DEVICE)
    _assert_training_step_close(ref32, ref16, ours, [(ids, ids, {})])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.backward
def test_training_step_left_padded_batch(head_dim):
    """attention_mask with left padding; labels -100 on padding and on the first real token of each row
    (its prediction would come from a padded position), so no padded position's output enters the loss."""
    seed = _seed_from_urandom()
    gen = torch.Generator().manual_seed(seed)
    ref32, ref16, ours = _models(_llama_config(head_dim), seed=seed)
    ids, mask = _left_padded([140, 97, 6, 139], 140, gen)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    _assert_training_step_close(ref32, ref16, ours, [(ids, labels, {"attention_mask": mask})])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.backward
def test_training_step_packed_sequences(head_dim):
    """Several sequences in one row with position_ids restarting at 0 (fa4 runs them as varlen); the
    references run each sequence on its own. Labels -100 at each sequence start so no target crosses a
    boundary: both sides then average the same per-token losses."""
    seed = _seed_from_urandom()
    gen = torch.Generator().manual_seed(seed)
    ref32, ref16, ours = _models(_llama_config(head_dim), seed=seed)
    lens = [41, 90, 1, 17, 64]
    seqs = [torch.randint(3, VOCAB, (1, n), generator=gen).to(DEVICE) for n in lens]
    packed = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lens]).view(1, -1).to(DEVICE)
    labels = packed.clone()
    starts = torch.tensor([0] + lens[:-1]).cumsum(0)
    labels[0, starts] = -100
    _assert_training_step_close(ref32, ref16, ours, [(s, s, {}) for s in seqs],
                                [(packed, labels, {"position_ids": position_ids})])


def test_training_with_attention_dropout_raises():
    _, _, ours = _models(_llama_config(64, attention_dropout=0.1))
    ours.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        ours(torch.randint(3, VOCAB, (1, 16)).to(DEVICE))


def test_gemma2_softcap_scaling_sliding_window():
    """Softcap, a non-default scale and alternating sliding/full layers; eager is the reference (sdpa has
    no softcap)."""
    gen = torch.Generator().manual_seed(11)
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=32, attn_logit_softcapping=5.0,
        query_pre_attn_scalar=48, final_logit_softcapping=None, pad_token_id=0, initializer_range=0.05,
    )

    def sharpen(model):  # larger q projections so that the cap changes the result
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)

    ref32, ref16, ours = _models(cfg, ref_impl="eager", tweak=sharpen)
    ids, mask = _left_padded([150, 100, 31], 150, gen)
    _assert_logits_close(ref32, ref16, ours, ids, mask)
    ids = torch.randint(3, VOCAB, (2, 97), generator=gen).to(DEVICE)
    _assert_logits_close(ref32, ref16, ours, ids)


# ---------------------------------------------------------------------------------------------
# The Hub string through transformers' own flash wrapper (the device has no `kernels` package:
# transformers' loader is pointed at this package instead)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def hub_string(monkeypatch):
    from transformers import modeling_flash_attention_utils as mfau
    from transformers.integrations import hub_kernels

    def get_kernel(repo_id, revision=None, version=None, allow_all_kernels=False, **kwargs):
        assert repo_id == ta.HUB_REPO_ID
        module = types.ModuleType("flash_attn4_hub")
        module.flash_attn_func = flash_attn4.flash_attn_func
        module.flash_attn_varlen_func = flash_attn4.flash_attn_varlen_func
        return module

    monkeypatch.setattr(hub_kernels, "get_kernel", get_kernel)
    monkeypatch.setattr(hub_kernels, "is_kernels_available", lambda: True)
    monkeypatch.setattr(mfau, "_loaded_implementation", None)
    return ta.HUB_ATTN_IMPLEMENTATION


def test_hub_string_llama(hub_string):
    gen = torch.Generator().manual_seed(21)
    ref32, ref16, ours = _models(_llama_config(128), impl=hub_string)
    ids = torch.randint(3, VOCAB, (2, 77), generator=gen).to(DEVICE)
    _assert_logits_close(ref32, ref16, ours, ids)
    ids, mask = _left_padded([90, 41], 90, gen)
    tol = _assert_logits_close(ref32, ref16, ours, ids, mask)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        _assert_greedy_ok(ref32, ids, mask, ours.generate(ids, **kw), ref16.generate(ids, **kw), 2 * tol)


def test_hub_string_sliding_window(hub_string):
    """transformers sends causal=True with window_size=(w - 1, w - 1): causal must clip the right side."""
    gen = torch.Generator().manual_seed(22)
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, sliding_window=48, pad_token_id=0, max_position_embeddings=512,
        initializer_range=0.05,
    )
    ref32, ref16, ours = _models(cfg, impl=hub_string)
    ids = torch.randint(3, VOCAB, (2, 200), generator=gen).to(DEVICE)
    _assert_logits_close(ref32, ref16, ours, ids)
    ids, mask = _left_padded([200, 120], 200, gen)
    _assert_logits_close(ref32, ref16, ours, ids, mask)


# ---------------------------------------------------------------------------------------------
# Generation on the KV-cache / split-KV path: 64 new tokens, dynamic and static caches, eager and
# compiled (the decode steps of "fa4" call flash_attn_with_kvcache on transformers' cache in place,
# or flash_attn_func with automatic split-KV when nothing is padded)
# ---------------------------------------------------------------------------------------------

NEW_TOKENS = 64


def _spy(monkeypatch):
    """Count the calls of the package's public functions (the adapter looks them up per call)."""
    calls = {}
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        real = getattr(flash_attn4, name)
        calls[name] = 0

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(flash_attn4, name, counted)
    return calls


def _generate(model, ids, mask, grad_mode=torch.no_grad, **kw):
    with grad_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             eos_token_id=None, output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, dim=1).float()


def _float32_step_logits(ref32, seq, mask, prompt):
    """The logits each generated token should have come from: the float32 model, teacher-forced."""
    full = torch.cat([mask, mask.new_ones(mask.shape[0], seq.shape[1] - prompt)], dim=1)
    with torch.no_grad():
        return ref32(seq, attention_mask=full).logits[:, prompt - 1:-1].float()


def _assert_generation_matches_sdpa(ref32, ref16, ids, mask, seq_o, logits_o, seq_r, logits_r):
    """Per-step logits: fa4's error against the float32 model (teacher-forced on fa4's own tokens) at
    most twice SDPA bf16's (on its tokens) plus slack; tokens: identical to SDPA's, or parting at a
    near tie of the float32 model (_assert_greedy_ok)."""
    prompt = ids.shape[1]
    l32_o = _float32_step_logits(ref32, seq_o, mask, prompt)
    l32_r = _float32_step_logits(ref32, seq_r, mask, prompt)
    err_o = (logits_o - l32_o).abs().max().item()
    err_r = (logits_r - l32_r).abs().max().item()
    slack = 1e-2 * l32_r.abs().max().item()
    assert torch.isfinite(logits_o).all()
    assert err_o <= 2 * err_r + slack, f"per-step logits: fa4 error {err_o:.4g} vs SDPA bf16 error {err_r:.4g}"
    _assert_greedy_ok(ref32, ids, mask, seq_o, seq_r, 2 * (err_r + slack))
    same = (seq_o == seq_r).all(dim=1)
    print(f"rows with identical tokens: {int(same.sum())}/{len(same)}; "
          f"max logit error fa4 {err_o:.3g}, sdpa {err_r:.3g}")


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
@pytest.mark.parametrize("lengths", [[61], [61, 40, 9, 61]], ids=["batch1", "batch4-left-padded"])
def test_generate_64_tokens_on_the_kv_cache_path(monkeypatch, cache_implementation, lengths):
    gen = torch.Generator().manual_seed(100 + len(lengths) + (cache_implementation == "static"))
    ref32, ref16, ours = _models(_llama_config(128), seed=5)
    layers = ours.config.num_hidden_layers
    ids, mask = _left_padded(lengths, max(lengths), gen)
    kw = dict(cache_implementation=cache_implementation, disable_compile=True)
    calls = _spy(monkeypatch)
    seq_o, logits_o = _generate(ours, ids, mask, **kw)
    spied = dict(calls)
    seq_r, logits_r = _generate(ref16, ids, mask, **kw)
    _assert_generation_matches_sdpa(ref32, ref16, ids, mask, seq_o, logits_o, seq_r, logits_r)
    # the path each step took: a static cache (keys past the tokens seen) or padding -> the KV-cache
    # call on the cache in place (the static prefill too); otherwise flash_attn_func (split-KV auto)
    padded, static = len(lengths) > 1, cache_implementation == "static"
    if static and padded:
        assert spied == dict(flash_attn_func=0, flash_attn_varlen_func=0,
                             flash_attn_with_kvcache=NEW_TOKENS * layers), spied
    elif static:  # the last step fills the cache: every key in use, no mask (5.22), flash_attn_func
        assert spied["flash_attn_varlen_func"] == 0 and spied["flash_attn_with_kvcache"] >= (NEW_TOKENS - 1) * layers
        assert spied["flash_attn_with_kvcache"] + spied["flash_attn_func"] == NEW_TOKENS * layers, spied
    elif padded:
        assert spied == dict(flash_attn_func=0, flash_attn_varlen_func=layers,
                             flash_attn_with_kvcache=(NEW_TOKENS - 1) * layers), spied
    else:
        assert spied == dict(flash_attn_func=NEW_TOKENS * layers, flash_attn_varlen_func=0,
                             flash_attn_with_kvcache=0), spied


@pytest.mark.parametrize("lengths, grad_mode", [([50], torch.no_grad), ([50, 31, 7, 50], torch.no_grad),
                                              ([50, 31, 7, 50], torch.inference_mode)],
                         ids=["batch1", "batch4-left-padded", "batch4-left-padded-inference-mode"])
def test_compiled_static_cache_generate_does_not_recompile(lengths, grad_mode):
    """generate() with a static cache compiles the decode step by itself on a GPU (inductor, CUDA graphs).
    With "fa4" it must trace as one graph (fullgraph=True) and never recompile as the sequence grows, nor
    for a second prompt of the same shape; the tokens and per-step logits as in the eager test. Also
    under torch.inference_mode, as pipelines and servers generate (its mask and cache tensors have no
    version counter)."""
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(200 + len(lengths))
    ref32, ref16, ours = _models(_llama_config(128), seed=6)
    torch._dynamo.reset()
    counters.clear()
    # The static cache has room to spare: where the last step fills a cache exactly and no row is
    # padded, transformers (5.17-5.22) hands flash-family implementations no mask for that step
    # (its flash mask function returns None for all-valid keys), one kwarg fewer: a recompile of
    # transformers' making that flash_attention_2 gets too, not one of ours.
    max_cache_len = max(lengths) + NEW_TOKENS + 8
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            ids, mask = _left_padded(lengths, max(lengths), gen)
            kw = dict(past_key_values=transformers.StaticCache(config=ours.config, max_cache_len=max_cache_len),
                      compile_config=transformers.CompileConfig(fullgraph=True))
            seq_o, logits_o = _generate(ours, ids, mask, grad_mode, **kw)
            assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
            seq_r, logits_r = _generate(ref16, ids, mask, cache_implementation="static", disable_compile=True)
            _assert_generation_matches_sdpa(ref32, ref16, ids, mask, seq_o, logits_o, seq_r, logits_r)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("flash_kwargs", [False, True])
@pytest.mark.backward
def test_training_step_flattening_collator(flash_kwargs):
    """Padding-free training as transformers documents it: DataCollatorWithFlattening packs the batch
    into one row (position_ids; with return_flash_attn_kwargs=True also cu_seq_lens / max_length).
    Loss and gradients against SDPA on the sequences one by one (_assert_training_step_close)."""
    seed = _seed_from_urandom()
    gen = torch.Generator().manual_seed(seed)
    ref32, ref16, ours = _models(_llama_config(128), seed=seed)
    lens = [77, 5, 130, 33]
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lens]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
             for k, v in collator([{"input_ids": s.tolist()} for s in seqs]).items()}
    labels = batch.pop("labels")
    ids = batch.pop("input_ids")
    pieces = [(s[None].to(DEVICE), s[None].to(DEVICE), {}) for s in seqs]
    _assert_training_step_close(ref32, ref16, ours, pieces, [(ids, labels, batch)])
