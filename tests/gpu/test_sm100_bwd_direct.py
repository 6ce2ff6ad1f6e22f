"""The sm100 backward kernel on a B200 or B300 (capability 10.0 or 10.3: compiled for sm_100a or
sm_103a), called directly, without the torch layer's dispatch and first-use self-check (the public
functions reach it through both: tests/gpu/test_bwd.py runs on a Blackwell GPU too): a failure here
points at the kernel, not at the layer around it.

The call sequence is ops.bwd's: LSE in log2 units and rowsum(dO * O) (ops._backward_rows' torch path),
the main kernel into a zeroed float32 dQ accumulator of the sm100 layout (fa4_kernels/sm100/dq_accum.py),
then the sm100 postprocessing. The forward's output and LSE come from the float32 reference. Gradients
are judged by test_bwd.py's rule (2x the low-precision reference's error plus rounding), on ragged
lengths (300 queries, 333 keys: partial blocks on both sides), MHA and GQA, causal or not, both dtypes;
local windows and softcap (batched) too.
Fresh random inputs every run (seed printed); dk/dv start NaN so unwritten rows fail.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.helpers import DEVICE, rand, seed_from_urandom
from tests.gpu.test_bwd import assert_grads_close, reference_grads
from tests.reference import attention_ref

pytestmark = [pytest.mark.gpu]


ARCHS = {(10, 0): "sm_100a", (10, 3): "sm_103a"}


def _need_sm100():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() not in ARCHS:
        pytest.skip("needs an sm_100 or sm_103 GPU (B200/GB200, B300/GB300): the kernel is compiled for sm_100a "
                    "and sm_103a")


@pytest.fixture(autouse=True)
def seed():
    return seed_from_urandom()


def run_sm100_backward(q, k, v, out, lse, dout, causal: bool, softmax_scale: float, window=(-1, -1),
                       softcap: float = 0.0):
    from flash_attn4 import ops
    from flash_attn4.fa4_kernels.arch import Arch
    from flash_attn4.fa4_kernels.compile import compile_backward, compile_backward_postprocess
    from flash_attn4.fa4_kernels.config import BackwardConfig
    from flash_attn4.fa4_kernels.sm100.dq_accum import accum_layout
    from flash_attn4.fa4_kernels.tiles import backward_tiles

    d, dv = q.shape[-1], v.shape[-1]
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[q.dtype]
    local = window != (-1, -1)  # the torch layer's rule: causal + window is local with right 0
    arch = Arch(ARCHS[torch.cuda.get_device_capability()])
    cfg = BackwardConfig(arch=arch, dtype=name, head_dim=d, head_dim_v=dv, causal=causal and not local,
                         local=local, has_softcap=softcap > 0,
                         **backward_tiles(arch, d, dv, causal and not local, local, softcap > 0))
    lse_log2, dpsum = ops._backward_rows(dout, out, lse, None, use_kernel=False)
    layout = accum_layout(cfg)
    batch, sq, hq, _ = q.shape
    blocks = -(-sq // cfg.tile_m)
    dq_accum = torch.zeros(batch, hq, blocks * layout.rows_per_block, layout.row, dtype=torch.float32, device=DEVICE)
    dk = torch.full_like(k, float("nan"))
    dv = torch.full_like(v, float("nan"))
    compile_backward(cfg)(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, None, None, None, None,
                          float(softmax_scale), float(softcap), int(window[0]), int(window[1]), int(k.shape[1]))
    dq = torch.full_like(q, float("nan"))
    compile_backward_postprocess(cfg.postprocess())(dq_accum, dq, None, float(softmax_scale), int(sq))
    torch.cuda.synchronize()
    return {"dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_sm100_backward_matches_the_reference(d, heads, causal, dtype):
    _need_sm100()
    hq, hk = heads
    batch, sq, sk = 2, 300, 333
    q, k, v = rand(batch, sq, hq, d, dtype=dtype), rand(batch, sk, hk, d, dtype=dtype), rand(batch, sk, hk, d, dtype=dtype)
    dout = rand(batch, sq, hq, d, dtype=dtype)
    scale = d ** -0.5
    out, lse = attention_ref(q.float(), k.float(), v.float(), softmax_scale=scale, causal=causal)
    got = run_sm100_backward(q, k, v, out.to(dtype), lse.float().contiguous(), dout, causal, scale)
    ref = reference_grads(q, k, v, dout, upcast=True, softmax_scale=scale, causal=causal)
    pt = reference_grads(q, k, v, dout, upcast=False, softmax_scale=scale, causal=causal)
    assert_grads_close(got, ref, pt, what=f"sm100 d={d} {hq}/{hk} causal={causal} {dtype}: ")


@pytest.mark.parametrize("window,softcap", [((70, 5), 0.0), ((100, 0), 0.0), ((-1, 40), 0.0), ((-1, -1), 5.0),
                                            ((150, 10), 3.0)])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_sm100_backward_local_and_softcap_match_the_reference(d, window, softcap):
    """Local windows (left and right, causal + window, right only) and softcap, GQA, ragged lengths
    with rows that see no key under the windows."""
    _need_sm100()
    hq, hk = 6, 2
    batch, sq, sk = 2, 300, 333
    q, k, v = rand(batch, sq, hq, d), rand(batch, sk, hk, d), rand(batch, sk, hk, d)
    dout = rand(batch, sq, hq, d)
    scale = d ** -0.5
    kw = dict(softmax_scale=scale, window_size=window, softcap=softcap)
    out, lse = attention_ref(q.float(), k.float(), v.float(), **kw)
    got = run_sm100_backward(q, k, v, out.to(q.dtype), lse.float().contiguous(), dout, False, scale, window,
                             softcap)
    ref = reference_grads(q, k, v, dout, upcast=True, **kw)
    pt = reference_grads(q, k, v, dout, upcast=False, **kw)
    assert_grads_close(got, ref, pt, what=f"sm100 d={d} window={window} softcap={softcap}: ")


@pytest.mark.parametrize("d,dv", [(128, 64), (64, 128), (96, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_sm100_backward_head_dim_v_unlike_head_dim(d, dv, causal):
    _need_sm100()
    hq, hk = 6, 2
    batch, sq, sk = 2, 300, 333
    q, k, v = rand(batch, sq, hq, d), rand(batch, sk, hk, d), rand(batch, sk, hk, dv)
    dout = rand(batch, sq, hq, dv)
    scale = d ** -0.5
    out, lse = attention_ref(q.float(), k.float(), v.float(), softmax_scale=scale, causal=causal)
    got = run_sm100_backward(q, k, v, out.to(q.dtype), lse.float().contiguous(), dout, causal, scale)
    ref = reference_grads(q, k, v, dout, upcast=True, softmax_scale=scale, causal=causal)
    pt = reference_grads(q, k, v, dout, upcast=False, softmax_scale=scale, causal=causal)
    assert_grads_close(got, ref, pt, what=f"sm100 d={d} dv={dv} causal={causal}: ")
