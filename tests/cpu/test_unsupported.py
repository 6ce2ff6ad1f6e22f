"""tests/unsupported.py (the list of refused combinations the GPU tests consult) against the code: the
public functions run on CPU tensors for every compile target, with the device query answering that
target's capability and compiling replaced by building the kernel object (its constructor's checks
run; nothing is compiled or launched). Every head dim the library takes (multiples of 8 in [8, 256],
equal, and the unequal pairs the GPU tests use) under every option of the public functions: a
NotImplementedError must come exactly where the list says, with a message the list names, and nowhere
else; when the code gains or loses a feature, this fails until the list follows.
"""

from __future__ import annotations

import re

import pytest
import torch

from flash_attn4 import compile_cache, device_info, dispatch, flash_attn_func, flash_attn_varlen_func, selfcheck
from flash_attn4 import validate
from flash_attn4.fa4_kernels.arch import Arch, kernels_for
from tests.unsupported import backward_refusals, forward_refusals, refusal_pattern

CAPABILITY = {Arch.SM90: (9, 0), Arch.SM100: (10, 0), Arch.SM103: (10, 3)}
HEAD_DIMS = [(d, d) for d in range(8, 257, 8)] + [(192, 128), (128, 64), (256, 128), (64, 8), (8, 64), (96, 16)]
PAGE_SIZE = 16
OPTIONS = {
    "plain": {}, "causal": dict(causal=True), "window": dict(window_size=(5, 2)), "softcap": dict(softcap=10.0),
    "sink": dict(sink=True), "gqa_packed": dict(hq=8), "varlen": dict(varlen=True),
    "seqused_k": dict(varlen=True, seqused_k=True), "seqused_q": dict(varlen=True, seqused_q=True),
    "paged": dict(paged=True), "num_splits_3": dict(num_splits=3), "num_splits_auto": dict(num_splits=0),
}


def _kernel_object(kind: str, cfg):
    """What compiling would start with: the arch's kernel class built for cfg (its checks run)."""
    passes = {"fwd": ("forward", "forward"), "bwd": ("backward", "backward")}
    if kind in passes:
        kernel, attr = passes[kind]
        entry = kernels_for(cfg.arch, kernel)
        entry.load(getattr(entry, attr))(cfg)
    return lambda *args: None


@pytest.fixture(params=list(CAPABILITY), ids=lambda a: a.value)
def target(request, monkeypatch):
    """The public functions on CPU tensors as if on a GPU of this arch; returns the arch."""
    arch = request.param
    info = device_info.DeviceInfo(index=0, name=f"test {arch.value} GPU", capability=CAPABILITY[arch], sm_count=132)
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(device_info, "get_device_info", lambda device: info)
    monkeypatch.setattr(dispatch, "arch_for_device",
                        lambda device, kernel="forward": dispatch.arch_for_capability(info.capability, info.name,
                                                                                      kernel))
    monkeypatch.setattr(compile_cache, "get_kernel", lambda kind, cfg, compile_fn: _kernel_object(kind, cfg))
    monkeypatch.setattr(selfcheck, "ensure_checked", lambda *args, **kwargs: None)
    return arch


def _call(d, dv, *, hq=4, causal=False, window_size=(-1, -1), softcap=0.0, sink=False, varlen=False,
          seqused_k=False, seqused_q=False, paged=False, num_splits=1, deterministic=False, requires_grad=False):
    """One forward through the public function the options need (random inputs, 2 sequences)."""
    hk, lens = 2, [3, 5]
    opts = dict(causal=causal, window_size=window_size, softcap=softcap, num_splits=num_splits,
                deterministic=deterministic, learnable_sink=torch.randn(hq) if sink else None)

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16).requires_grad_(requires_grad)

    if not (varlen or paged):
        return flash_attn_func(rand(2, 5, hq, d), rand(2, 7, hk, d), rand(2, 7, hk, dv), **opts)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    used = torch.tensor(lens, dtype=torch.int32)
    q = rand(8, hq, d)
    if paged:
        pages = torch.tensor([[0], [1]], dtype=torch.int32)
        k, v = rand(2, PAGE_SIZE, hk, d), rand(2, PAGE_SIZE, hk, dv)
        return flash_attn_varlen_func(q, k, v, cu, None, max_seqlen_q=5, seqused_k=used, page_table=pages, **opts)
    return flash_attn_varlen_func(q, rand(8, hk, d), rand(8, hk, dv), cu, cu, max_seqlen_q=5,
                                  seqused_k=used if seqused_k else None, seqused_q=used if seqused_q else None,
                                  **opts)


def _outcome(fn) -> str | None:
    """The NotImplementedError message fn raises, or None when it runs."""
    try:
        fn()
    except NotImplementedError as e:
        return str(e)
    return None


@pytest.mark.parametrize("option", list(OPTIONS))
def test_forward_refuses_exactly_what_the_list_names(target, option):
    opts = dict(OPTIONS[option])
    problem = dict(seqused_q=opts.get("seqused_q", False), paged=opts.get("paged", False),
                   num_splits=opts.get("num_splits", 1))
    disagreements = []
    for d, dv in HEAD_DIMS:
        pattern = refusal_pattern(forward_refusals(target, head_dim=d, head_dim_v=dv, **problem))
        message = _outcome(lambda: _call(d, dv, **opts))
        if pattern is None and message is not None:
            disagreements.append(f"d={d}/{dv}: not listed as unsupported, but raised: {message}")
        elif pattern is not None and message is None:
            disagreements.append(f"d={d}/{dv}: listed as unsupported ({pattern}) but ran")
        elif pattern is not None and not re.search(pattern, message):
            disagreements.append(f"d={d}/{dv}: raised {message!r}, which the listed reasons ({pattern}) do not match")
    assert not disagreements, f"{target.value} {option}:\n" + "\n".join(disagreements)


def test_the_grid_meets_every_kind_of_refusal_and_support():
    """The grid above is not vacuous: it holds refused and supported problems of every kind, on some arch."""
    reasons = {r for arch in CAPABILITY for d, dv in HEAD_DIMS for o in OPTIONS.values()
               for r in forward_refusals(arch, head_dim=d, head_dim_v=dv, seqused_q=o.get("seqused_q", False),
                                         paged=o.get("paged", False), num_splits=o.get("num_splits", 1))}
    assert len(reasons) == 1  # head dims below 16; the sm100 decode inputs run since its decode kernels
    assert not forward_refusals(Arch.SM90, head_dim=16, head_dim_v=16, seqused_q=True, paged=True, num_splits=3)


BACKWARD_OPTIONS = {**{name: OPTIONS[name] for name in ("plain", "causal", "window", "softcap", "sink", "gqa_packed",
                                                         "varlen", "seqused_k", "seqused_q", "paged")},
                    "deterministic": dict(deterministic=True), "causal_gqa_sink": dict(causal=True, hq=8, sink=True)}


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128), (72, 72), (256, 256), (120, 120), (56, 56),
                                  (128, 64), (64, 96)])
@pytest.mark.parametrize("option", list(BACKWARD_OPTIONS))
def test_backward_refuses_exactly_what_the_list_names(target, d, dv, option):
    """Forward then backward with inputs that require grad: refused (by the forward or by .backward())
    exactly where the list names a reason for either pass; on sm_100a before anything is compiled
    (the kernel objects stand in for compiling here, and the refusals come from the configuration)."""
    opts = dict(BACKWARD_OPTIONS[option])
    problem = dict(seqused_q=opts.get("seqused_q", False), paged=opts.get("paged", False))
    features = dict(window=opts.get("window_size", (-1, -1)) != (-1, -1), softcap=opts.get("softcap", 0.0) > 0,
                    varlen=opts.get("varlen", False), seqused_k=opts.get("seqused_k", False),
                    deterministic=opts.get("deterministic", False))
    pattern = refusal_pattern(forward_refusals(target, head_dim=d, head_dim_v=dv, **problem)
                              + backward_refusals(target, head_dim=d, head_dim_v=dv, **features, **problem))
    message = _outcome(lambda: _call(d, dv, requires_grad=True, **opts).float().sum().backward())
    if pattern is None:
        assert message is None, f"{target.value} backward d={d}/{dv}: not listed as unsupported, raised: {message}"
    else:
        assert message is not None and re.search(pattern, message), (
            f"{target.value} backward d={d}/{dv}: listed as unsupported ({pattern}), got {message!r}")


@pytest.mark.parametrize("arch", [Arch.SM100, Arch.SM103], ids=lambda a: a.value)
def test_the_backward_grid_runs_every_sm100_head_dim_and_option(arch):
    """Not vacuous: on sm_100a (and sm_103a, the same kernels) the grid above holds backward problems
    at every kind of head dim, each of which must run: the 1-CTA kernel's own (64, 96, 128, mixed),
    dims padded to them (56, 72, 120: zero-padded to 64, 96, 128), the serial kernel's 192 / 128 and
    the d = dv = 256 CTA pair, softcap included; and every option of BACKWARD_OPTIONS with no
    refusal (local windows, softcap, varlen, seqused_k, deterministic)."""
    from flash_attn4.fa4_kernels.sm100 import tiles as sm100_tiles

    grid = [(64, 64), (128, 128), (192, 128), (72, 72), (256, 256), (120, 120), (56, 56), (128, 64), (64, 96)]
    kernels = {sm100_tiles.backward_head_dims(d, dv) for d, dv in grid}
    assert {(192, 128), (256, 256), (96, 96), (64, 64), (128, 128), (128, 64)} <= kernels
    assert not [d for d in grid if backward_refusals(arch, head_dim=d[0], head_dim_v=d[1], softcap=True)]
    listed = {r for o in BACKWARD_OPTIONS.values()
              for r in backward_refusals(arch, window="window_size" in o, softcap="softcap" in o,
                                         varlen=o.get("varlen", False), seqused_k=o.get("seqused_k", False),
                                         deterministic=o.get("deterministic", False))}
    assert listed == set()
    covered = {k for o in BACKWARD_OPTIONS.values() for k in o}
    assert {"window_size", "softcap", "varlen", "seqused_k"} <= covered
