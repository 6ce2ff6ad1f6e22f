"""The torch.library custom ops that run the forward and backward kernels, their fake (meta)
implementations, and the forward's autograd formula (which calls the backward op). Eager calls
that nothing needs to trace skip the dispatcher: ``_route`` runs the ops' implementations directly,
a forward that records autograd inside ``_EagerForward`` (the same formula).

``fwd`` is functional (``mutates_args=()``): it allocates ``out`` and ``lse`` and returns both, so
``torch.compile(fullgraph=True)`` traces it as one opaque node (shapes from the fake implementation)
and CUDA-graph capture records the kernel launch. The kernel is launched through TVM-FFI: when a
torch CUDA tensor is an argument, tvm-ffi asks torch (DLPack exchange API: torch itself, or
torch-c-dlpack-ext) for the *current stream* of that tensor's device and hands it to the kernel as
the environment stream. So the kernel runs on ``torch.cuda.current_stream()`` - inside
``torch.cuda.stream(s)`` on ``s``, and during graph capture on the capture stream.

The op expects arguments already checked by ``validate`` (``interface`` does that); it only fixes
layouts the kernel cannot read (copies) and, when asked by FLASH_ATTN4_CHECK_CU_SEQLENS, checks
varlen metadata values.

Schema (all scalars are plain op arguments, never tensors):
    fwd(q, k, v, cu_seqlens_q?, cu_seqlens_k?, seqused_k?, learnable_sink?, softmax_scale: float,
        softcap: float, causal: bool, window_left: int, window_right: int, max_seqlen_q: int,
        max_seqlen_k: int, deterministic: bool, num_splits: int = 1) -> (out, lse)
    bwd(dout, q, k, v, out, lse, cu_seqlens_q?, cu_seqlens_k?, seqused_k?, softmax_scale, softcap, causal,
        window_left, window_right, max_seqlen_q, max_seqlen_k, deterministic) -> (dq, dk, dv)
``max_seqlen_k`` and ``deterministic`` only matter to the backward (the forward is deterministic);
``fwd`` takes them so that its autograd formula has them. ``num_splits``: 1 runs one CTA per output
tile; N > 1 shares each tile's KV blocks among N CTAs (split-KV: float32 partials, then the combine
kernel); 0 lets ``dispatch.num_splits_heuristic`` choose. The backward is the same either way (the
combined LSE is exact).
    combine(out_partial, lse_partial, out_dtype) -> (out, lse): flash_attn_combine's op.
``causal``/``window_*`` are canonical (``validate.canonical_mask``): local = not causal and a window
side >= 0. ``learnable_sink`` must already be float32.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import math
import sys
from typing import Callable, Optional

import torch

from . import compile_cache, device_info, dispatch, selfcheck, settings, validate
from ._ops import add_op_namespace_prefix
from .fa4_kernels.arch import Arch, kernels_for
from .fa4_kernels.config import WORKSPACE_ALIGN
from .fa4_kernels.tiles import has_split_kv

# The ops are defined with torch.library's low-level API rather than torch.library.custom_op: that
# wraps every implementation in torch._disable_dynamo, which imports torch._dynamo (about a second of
# CPU) on the first call of a process that never uses torch.compile. _outside_dynamo keeps the
# guard and pays for it only where dynamo is loaded.


def _unclaimed_namespace(base: str) -> str:
    """``base``, or ``base_2``, ``base_3``, ... when an earlier import of this same build (the same
    files under another module name: a Hub download and a LOCAL_KERNELS copy, or a package imported
    by path twice) already defined its ops there. torch.library refuses a second definition of an
    op, and reusing the first import's ops would run the first module's code under the second's
    name; a namespace of its own keeps each import self-contained."""
    namespace, n = base, 1
    while hasattr(getattr(torch.ops, namespace), "fwd"):
        n += 1
        namespace = f"{base}_{n}"
    return namespace


_NAMESPACE = _unclaimed_namespace(add_op_namespace_prefix("").split("::")[0])
_LIBRARY = torch.library.Library(_NAMESPACE, "FRAGMENT")


def _outside_dynamo(fn: Callable) -> Callable:
    """``fn`` run with dynamo's frame evaluation off, as custom_op's implementations run: an op
    called from eager code inside a torch.compile'd region (after a graph break) must not have
    its Python implementation traced. Without torch._dynamo in sys.modules nothing was ever
    compiled in this process, so no frame can be intercepted and ``fn`` runs as it is."""
    disabled = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal disabled
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = dynamo.disable(fn, recursive=True)
        return disabled(*args, **kwargs)

    return run


def _define_op(fn: Callable, mutates_args: tuple = (), name: Optional[str] = None):
    """Define an op typed like ``fn`` and named ``name`` (default: ``fn``'s; functional unless
    ``mutates_args`` names the arguments it writes in place) in this build's namespace, with ``fn``
    as its implementation on every device; returns the op."""
    name = name or fn.__name__
    _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
    _LIBRARY.impl(name, _outside_dynamo(fn), "CompositeExplicitAutograd")
    return getattr(getattr(torch.ops, _NAMESPACE), name).default

_PLAIN_TENSOR_TYPES = validate.PLAIN_TENSOR_TYPES


class _Route(enum.Enum):
    """How a call of an op (the forward, the backward, the KV-cache forward) runs: _route."""
    DIRECT = "the op's implementation, called directly"
    EAGER_AUTOGRAD = "the implementation inside _EagerForward, the op's autograd formula"
    THROUGH_OP = "the op, through the dispatcher"


def _route(*tensors: Optional[torch.Tensor]) -> _Route:
    """How a call runs. The dispatcher costs a third of a cached forward call's host time, so a call
    uses it only where something must see the op: torch.compile / export tracing, a dispatch mode
    (FakeTensorMode, FlopCounterMode), a functorch transform, or a tensor subclass (DTensor,
    FakeTensor; not nn.Parameter). Otherwise a call that records no autograd graph (grad off, or no
    input requires it) runs the implementation directly, and one that records a graph runs it
    inside _EagerForward, the op's own autograd formula without torch.library's wrapper.
    CUDA-graph capture records the same launches either way."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._are_functorch_transforms_active()):
        return _Route.THROUGH_OP
    grad, needs_grad = torch.is_grad_enabled(), False
    for t in tensors:
        if t is not None:
            if type(t) not in _PLAIN_TENSOR_TYPES:
                return _Route.THROUGH_OP
            needs_grad = needs_grad or (grad and t.requires_grad)
    return _Route.EAGER_AUTOGRAD if needs_grad else _Route.DIRECT


# Test hook: when True the ops fill out with NaN and lse with +inf (forward), dk and dv with NaN
# (backward) right after allocating them, so a test can tell "the kernel wrote every element" from
# "torch.empty happened to hold the right bytes".
# The tests set it with monkeypatch; nothing else should.
_poison_outputs_for_tests = False


def _output_shapes(q: torch.Tensor, v: torch.Tensor, varlen: bool) -> tuple[tuple, tuple]:
    if varlen:
        total_q, hq = q.shape[0], q.shape[1]
        return (total_q, hq, v.shape[-1]), (hq, total_q)
    b, sq, hq = q.shape[0], q.shape[1], q.shape[2]
    return (b, sq, hq, v.shape[-1]), (b, hq, sq)


def _is_local(causal: bool, window_left: int, window_right: int) -> bool:
    return not causal and (window_left >= 0 or window_right >= 0)


def _checked_forward(q: torch.Tensor, v: torch.Tensor, *, causal: bool, local: bool, has_softcap: bool,
                     varlen: bool, has_seqused_k: bool, has_sink: bool, qhead_per_kvhead: int, page_size: int = 0,
                     has_seqused_q: bool = False, split_kv: bool = False, pack_group: int = 0):
    """Device -> arch -> configuration -> compiled kernel (CPU tests replace the compile step),
    self-checked on its first use where selfcheck asks for it: (the configuration, its kernel), the
    configuration being the fallback that replaced the chosen one where that failed its check.
    ``split_kv``: the split-KV pipeline (SplitKVConfig: the split kernel and the combine, one call),
    else the ForwardConfig's kernel."""
    flags = dict(causal=causal, local=local, has_softcap=has_softcap, varlen=varlen, has_seqused_k=has_seqused_k,
                 has_sink=has_sink, qhead_per_kvhead=qhead_per_kvhead, page_size=page_size,
                 has_seqused_q=has_seqused_q, pack_group=pack_group)
    problem = (dispatch.arch_for_device(q.device), dispatch.dtype_name(q.dtype), q.shape[-1], v.shape[-1])
    if split_kv:
        cfg = selfcheck.substitute(dispatch.split_kv_config(*problem, **flags), q.device)
        forward, get_kernel = cfg.forward, compile_cache.get_split_kv_kernel
    else:
        cfg = forward = selfcheck.substitute(dispatch.forward_config(*problem, **flags), q.device)
        get_kernel = compile_cache.get_forward_kernel
    if forward.query_heads_per_group not in (1, qhead_per_kvhead):
        # The kernel folds exactly that many query heads into each KV head's rows.
        raise ValueError(f"ForwardConfig packs {forward.query_heads_per_group} query heads per KV head (pack_gqa="
                         f"{forward.pack_gqa}, pack_gqa_heads={forward.pack_gqa_heads}) but the inputs have "
                         f"{qhead_per_kvhead}")
    return _checked_kernel(cfg, q.device, get_kernel, _launch_forward)


def _checked_kernel(cfg, device: torch.device, get_kernel: Callable, launch: Callable):
    """(cfg, its compiled kernel) once the kernel has passed its first-use self-check on ``device``:
    on an architecture we have not run, it is checked against a PyTorch reference before it computes
    anything for the caller (selfcheck.py). A configuration with a fallback (CTA pairs: single
    CTAs) that computed wrong results is replaced on this device from now on (selfcheck.substitute
    returns the fallback), and the fallback is checked on its first use in turn. Not after a hang:
    the fallback would queue behind the hung kernel."""
    kernel = get_kernel(cfg)
    try:
        selfcheck.ensure_checked(cfg, device, kernel, launch)
    except selfcheck.SelfCheckError as error:
        fallback = dispatch.self_check_fallback(cfg)
        if fallback is None or error.hung:
            raise
        selfcheck.fall_back(cfg, fallback, device, error)
        cfg, kernel = fallback, get_kernel(fallback)
        selfcheck.ensure_checked(cfg, device, kernel, launch)
    return cfg, kernel


def _fill_empty_keys(out: torch.Tensor, lse: torch.Tensor, learnable_sink: Optional[torch.Tensor],
                     varlen: bool) -> None:
    """No key at all: every row is fully masked (out 0; lse -inf, or the sink logit with a sink)."""
    out.zero_()
    if learnable_sink is None:
        lse.fill_(float("-inf"))
    elif varlen:  # lse (hq, total_q)
        lse.copy_(learnable_sink[:, None].expand_as(lse))
    else:  # lse (b, hq, sq)
        lse.copy_(learnable_sink[None, :, None].expand_as(lse))


def _fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor],
    learnable_sink: Optional[torch.Tensor],
    softmax_scale: float,
    softcap: float,
    causal: bool,
    window_left: int,
    window_right: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    deterministic: bool,
    num_splits: int = 1,
    page_table: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    del deterministic  # for the backward (autograd saves the inputs)
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale, softcap, causal,
                    window_left, window_right, max_seqlen_q, max_seqlen_k, num_splits, page_table=page_table,
                    seqused_q=seqused_q)


fwd = _define_op(_fwd, name="fwd")


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale, softcap, causal, window_left,
            window_right, max_seqlen_q, max_seqlen_k, deterministic, num_splits=1, page_table=None, seqused_q=None,
            need_lse=True):
    """``fwd`` for the public functions, run as _route decides. ``need_lse=False``: the caller drops
    the LSE (then a direct call may return a view of scratch memory; a call that records autograd,
    which keeps the LSE, always allocates it)."""
    route = _route(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, page_table, seqused_q)
    if route is _Route.DIRECT:
        return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale, softcap, causal,
                        window_left, window_right, max_seqlen_q, max_seqlen_k, num_splits, page_table=page_table,
                        seqused_q=seqused_q, need_lse=need_lse)
    run = _EagerForward.apply if route is _Route.EAGER_AUTOGRAD else fwd
    return run(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale, softcap, causal,
               window_left, window_right, max_seqlen_q, max_seqlen_k, deterministic, num_splits, page_table, seqused_q)


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale, softcap, causal,
             window_left, window_right, max_seqlen_q, max_seqlen_k, num_splits,
             check_values: bool = True, page_table: Optional[torch.Tensor] = None,
             seqused_q: Optional[torch.Tensor] = None, need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """fwd's implementation, shared with fwd_kvcache. ``check_values=False`` skips the opt-in varlen
    value check (the KV-cache op checks its own metadata: its cu_seqlens_k are cache row offsets,
    which need not increase). ``page_table``: k and v are a paged cache (ForwardConfig.page_size),
    cu_seqlens_k is None and seqused_k holds the key lengths. ``seqused_q``: sequence b uses its first
    seqused_q[b] queries; the rows of out and lse past them are undefined (split-KV: merged from
    partials nobody wrote; else left as allocated). ``need_lse=False``: the caller drops the LSE,
    which a split-KV plan then writes into its workspace (_run_plan)."""
    if PLAN_CACHE:
        plan = _plan(q, k, v, cu_seqlens_q, seqused_k, learnable_sink, softcap, causal, window_left, window_right,
                     max_seqlen_q, max_seqlen_k, num_splits, page_table, seqused_q)
        if plan is not None:
            return _run_plan(plan, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale,
                             softcap, window_left, window_right, max_seqlen_q, check_values, page_table, seqused_q,
                             need_lse)
    # No plan: an empty problem, inputs whose layout the kernels cannot read, or the plan cache off.
    varlen = cu_seqlens_q is not None
    if _no_work(_output_shapes(q, v, varlen)[0], k, varlen):
        return _empty_forward(q, v, learnable_sink, varlen)
    q, k, v = validate.kernel_layout(q), validate.kernel_layout(k), validate.kernel_layout(v)
    plan = _build_plan(q, k, v, cu_seqlens_q, seqused_k, learnable_sink, softcap, causal, window_left, window_right,
                       max_seqlen_q, max_seqlen_k, num_splits, page_table, seqused_q)
    return _run_plan(plan, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale, softcap,
                     window_left, window_right, max_seqlen_q, check_values, page_table, seqused_q, need_lse)


def _no_work(out_shape: tuple, k, varlen: bool) -> bool:
    """No output element (no query row, or a zero-sized head or dim), or no key at all: nothing for a
    kernel to do (_empty_forward's outputs)."""
    return math.prod(out_shape) == 0 or k.shape[0] == 0 or (not varlen and k.shape[1] == 0)


def _empty_forward(q, v, learnable_sink, varlen: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """out and lse of a problem without work: no query row (empty tensors), or no key at all."""
    out_shape, lse_shape = _output_shapes(q, v, varlen)
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if out.numel():
        _fill_empty_keys(out, lse, learnable_sink, varlen)
    return out, lse


# ---- launch plans ----

# What a forward call derives from its static properties - output shapes, the kernel, the split count
# and its kernels - cached under a key of everything that derivation read: shapes, strides, dtype,
# device, pointer alignment (mod 16), which optional tensors are given, mask flags and the sequence
# bounds the split heuristic reads. A repeated call (decoding: the same shapes at every step and layer)
# then allocates its outputs and launches. Empty problems get no plan, and inputs that need a layout
# copy get no cached one (they run a plan made for their copies). Off: every call derives anew
# (the tests compare both). compile_cache.clear() forgets the plans with the kernels they hold.
PLAN_CACHE = True
MAX_PLANS = 1024
_PLANS: dict = {}
compile_cache._clear_hooks.append(_PLANS.clear)


class _Plan:
    """``kernel`` writes out and lse: the forward itself (``workspace_shape`` None), or the split-KV
    pipeline (fa4_kernels/split_kv.py: the split kernel into a float32 workspace of that shape,
    then the combine). A split-KV workspace has room for one more LSE past the first split's
    partials, which the kernels never touch: an LSE the caller drops is written there as the
    ``lse_view`` (size, stride, offset) of the workspace, one allocation fewer per decode step.
    ``guard``: the launch may need a device guard (a process with several GPUs)."""
    __slots__ = ("out_shape", "lse_shape", "device", "cfg", "kernel", "workspace_shape", "lse_view", "guard")


def _plan(q, k, v, cu_seqlens_q, seqused_k, learnable_sink, softcap, causal, window_left, window_right,
          max_seqlen_q, max_seqlen_k, num_splits, page_table, seqused_q) -> Optional[_Plan]:
    """The cached launch plan of this forward call, built on its first use; None where the general
    path serves it."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
           (q.data_ptr() | k.data_ptr() | v.data_ptr()) % validate.ALIGN_BYTES,
           None if cu_seqlens_q is None else cu_seqlens_q.shape[0], seqused_k is None, learnable_sink is None,
           None if page_table is None else page_table.shape[1], seqused_q is None, softcap > 0.0, causal,
           window_left, window_right, max_seqlen_q, max_seqlen_k, num_splits)
    plan = _PLANS.get(key, _PLANS)
    if plan is _PLANS:
        plan = _build_plan(q, k, v, cu_seqlens_q, seqused_k, learnable_sink, softcap, causal, window_left,
                           window_right, max_seqlen_q, max_seqlen_k, num_splits, page_table, seqused_q)
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _build_plan(q, k, v, cu_seqlens_q, seqused_k, learnable_sink, softcap, causal, window_left, window_right,
                max_seqlen_q, max_seqlen_k, num_splits, page_table, seqused_q) -> Optional[_Plan]:
    """_forward's decisions for this call as a _Plan (None: not one the plan covers)."""
    varlen = cu_seqlens_q is not None
    group = _padded_group(q, k, v, varlen, max_seqlen_q)
    if any(validate.needs_copy(t) for t in (q, k, v)):
        return None
    out_shape, lse_shape = _output_shapes(q, v, varlen)
    if _no_work(out_shape, k, varlen):
        return None
    flags = _forward_flags(q, k, seqused_k, learnable_sink, softcap, causal, window_left, window_right, varlen,
                           page_table, seqused_q, group)
    if num_splits != 1:
        if page_table is not None and max_seqlen_k < 0:  # as _forward: the longest sequence the table holds
            max_seqlen_k = page_table.shape[1] * k.shape[1]
        num_splits = _num_splits(num_splits, q, k, v.shape[-1], cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                                 window_left, window_right, flags)
    plan = _Plan()
    plan.out_shape, plan.lse_shape, plan.device = out_shape, lse_shape, q.device
    plan.workspace_shape = plan.lse_view = None
    plan.guard = q.device.type == "cuda" and q.device.index is not None and _several_gpus()
    if num_splits > 1:
        plan.cfg, plan.kernel = _checked_forward(q, v, **flags, split_kv=True)
        rows = math.prod(out_shape[:-1])
        partials = plan.cfg.workspace_shape(num_splits, rows)[1]  # a split's row without spare room
        # Whole WORKSPACE_ALIGN units of spare keep every row's partials where they were: the LSE fits
        # between split 0's partials and split 1's.
        spare = -(-rows // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
        plan.workspace_shape = plan.cfg.workspace_shape(num_splits, rows, spare=spare)
        strides = tuple(math.prod(lse_shape[i + 1:]) for i in range(len(lse_shape)))
        plan.lse_view = lse_shape, strides, partials
    else:
        plan.cfg, plan.kernel = _checked_forward(q, v, **flags)
    return plan


def _run_plan(plan: _Plan, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale, softcap,
              window_left, window_right, max_seqlen_q, check_values, page_table, seqused_q, need_lse=True):
    """_forward's allocations and launch as the plan decided them (q, k and v laid out). A decode
    step runs this once per layer, between the model's other ops, where every Python call on the way
    to the launch costs a multiple of its back-to-back time (scripts/host_time.py --in-model): hence
    one flat function, not a chain of helpers, one host call for a split-KV forward, and no LSE
    allocation where the caller drops it (plan.lse_view)."""
    device = plan.device
    out = q.new_empty(plan.out_shape)  # q's dtype and device (the plan's key holds both)
    workspace = None
    if plan.workspace_shape is None:
        lse = q.new_empty(plan.lse_shape, dtype=torch.float32)
    else:
        workspace = q.new_empty(plan.workspace_shape, dtype=torch.float32)
        lse = q.new_empty(plan.lse_shape, dtype=torch.float32) if need_lse else workspace.as_strided(*plan.lse_view)
    if cu_seqlens_q is not None or seqused_k is not None or seqused_q is not None or learnable_sink is not None:
        cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, page_table, seqused_q = _metadata_inputs(
            q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, max_seqlen_q, check_values, page_table,
            seqused_q)
    # The first-use self-check's verdict (one set lookup once settled; a failed check raises every call).
    selfcheck.ensure_checked(plan.cfg, device, plan.kernel, _launch_forward)
    if _poison_outputs_for_tests:  # an element the kernels leave unwritten (split-KV: its partials too) shows up
        _poison((out,) if workspace is None else (out, workspace), (lse,))
    with _device_guard(device) if plan.guard else _NO_GUARD:
        _launch(plan.kernel, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
                learnable_sink, softmax_scale, softcap, window_left, window_right, max_seqlen_q, workspace)
    return out, lse


def _poison(outs: tuple, rows: tuple) -> None:
    """_poison_outputs_for_tests: NaN in the outputs, +inf in the LSE-like row buffers."""
    for t in outs:
        t.fill_(float("nan"))
    for t in rows:
        t.fill_(float("inf"))


def _forward_flags(q, k, seqused_k, learnable_sink, softcap, causal, window_left, window_right, varlen, page_table,
                   seqused_q, pack_group: int) -> dict:
    """The problem class of a forward call: dispatch.forward_config's arguments besides arch, dtype
    and head dims."""
    return dict(causal=causal, local=_is_local(causal, window_left, window_right), has_softcap=softcap > 0.0,
                varlen=varlen, has_seqused_k=seqused_k is not None, has_sink=learnable_sink is not None,
                qhead_per_kvhead=q.shape[-2] // k.shape[-2], page_size=0 if page_table is None else k.shape[1],
                has_seqused_q=seqused_q is not None, pack_group=pack_group)


def _padded_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: bool, max_seqlen_q: int) -> int:
    """dispatch.padded_pack for this call: the padded group the kernel packs the head ratio in, or 0
    to run the heads as they are."""
    hq, hk = q.shape[-2], k.shape[-2]
    if hq == hk:
        return 0
    return dispatch.padded_pack(dispatch.arch_for_device(q.device), q.shape[-1], v.shape[-1], varlen, hq // hk,
                                max_seqlen_q)


def _kernel_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, max_seqlen_q,
                   check_values: bool = True, page_table: Optional[torch.Tensor] = None,
                   seqused_q: Optional[torch.Tensor] = None):
    """The inputs as the kernels take them: layout fixes (copies only where a stride or alignment
    needs one) and the optional varlen value check (with a paged cache: of cu_seqlens_q, and of the
    page table against seqused_k)."""
    q, k, v = validate.kernel_layout(q), validate.kernel_layout(k), validate.kernel_layout(v)
    return (q, k, v) + _metadata_inputs(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, max_seqlen_q,
                                        check_values, page_table, seqused_q)


def _metadata_inputs(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, max_seqlen_q, check_values,
                     page_table, seqused_q):
    """_kernel_inputs but for q, k and v (already laid out): the optional tensors, contiguous, and
    the opt-in value checks."""
    if cu_seqlens_q is None and seqused_k is None and seqused_q is None and learnable_sink is None:
        return None, cu_seqlens_k, None, None, page_table, None  # flash_attn_func's call: nothing to do
    checked = ((cu_seqlens_q is not None or page_table is not None) and check_values and settings.check_cu_seqlens()
               and not (q.is_cuda and torch.cuda.is_current_stream_capturing()))
    if cu_seqlens_q is not None:
        cu_seqlens_q = cu_seqlens_q.contiguous()
        if page_table is not None:
            if checked:
                validate.check_varlen_values(cu_seqlens_q, cu_seqlens_q, q.shape[0], q.shape[0], max_seqlen_q)
        else:
            cu_seqlens_k = cu_seqlens_k.contiguous()
            if checked:
                validate.check_varlen_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                                             seqused_k)
    if page_table is not None:  # batched or varlen queries alike
        page_table = page_table.contiguous()
        if checked:
            validate.check_page_table_values(page_table, seqused_k, k.shape[0], k.shape[1])
    if seqused_k is not None:
        seqused_k = seqused_k.contiguous()
    if seqused_q is not None:
        seqused_q = seqused_q.contiguous()
    if learnable_sink is not None:
        learnable_sink = learnable_sink.contiguous()
    return cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, page_table, seqused_q


def _launch_forward(kernel, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink,
                    softmax_scale, softcap, window_left, window_right, max_seqlen_q, check_values: bool = True,
                    page_table: Optional[torch.Tensor] = None, seqused_q: Optional[torch.Tensor] = None,
                    workspace: Optional[torch.Tensor] = None) -> None:
    """Run a compiled forward kernel into ``out``/``lse`` (allocated by the caller; for a split-KV
    pipeline with its ``workspace``) on the current stream of q's device, its inputs first made
    readable (layout copies, contiguous metadata): the first-use self-check's launch (selfcheck.py)."""
    q, k, v = validate.kernel_layout(q), validate.kernel_layout(k), validate.kernel_layout(v)
    cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, page_table, seqused_q = _metadata_inputs(
        q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, max_seqlen_q, check_values, page_table,
        seqused_q)
    with _device_guard(q.device):
        _launch(kernel, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
                learnable_sink, softmax_scale, softcap, window_left, window_right, max_seqlen_q, workspace)


def _launch(kernel, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, learnable_sink,
            softmax_scale, softcap, window_left, window_right, max_seqlen_q, workspace=None) -> None:
    """The forward kernels' call convention (ForwardConfig; a split-KV pipeline's takes its
    ``workspace`` after lse: fa4_kernels/split_kv.py): every forward launch, the caller's and the
    self-check's, goes through here, on inputs the kernel can read, under the caller's device guard."""
    scalars = (float(softmax_scale), float(softcap), int(window_left), int(window_right), int(max_seqlen_q))
    if workspace is None:
        kernel(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, learnable_sink,
               *scalars)
    else:
        kernel(q, k, v, out, lse, workspace, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
               learnable_sink, *scalars)


def _device_guard(device: torch.device):
    """Make ``device`` current for the launch when it is not already (multi-GPU processes)."""
    if (device.type == "cuda" and device.index is not None and _several_gpus()
            and device.index != torch.cuda.current_device()):
        return torch.cuda.device(device)
    return _NO_GUARD


_NO_GUARD = contextlib.nullcontext()  # reusable: nullcontext keeps no state


@functools.cache
def _several_gpus() -> bool:
    """Whether this process sees more than one GPU (fixed once CUDA is up): with one, every launch
    is on the current device, and a decode step's launches skip torch.cuda.current_device() (~1 us
    of Python each; 8% of the adapter's decode call under cProfile on the H100 host)."""
    return torch.cuda.device_count() > 1


@torch.library.register_fake(fwd)
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale, softcap,
              causal, window_left, window_right, max_seqlen_q, max_seqlen_k, deterministic, num_splits=1,
              page_table=None, seqused_q=None):
    out_shape, lse_shape = _output_shapes(q, v, cu_seqlens_q is not None)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


# ---- split-KV ----


def _num_splits(num_splits: int, q: torch.Tensor, k: torch.Tensor, head_dim_v: int,
                cu_seqlens_q: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, window_left: int,
                window_right: int, flags: dict) -> int:
    """The split count to run: an explicit one as it is (NotImplementedError where the kernel has no
    split-KV for the problem), 0 through dispatch.num_splits_heuristic (1 on an arch without
    split-KV)."""
    if num_splits > 1:
        return num_splits
    arch = dispatch.arch_for_device(q.device)
    if not has_split_kv(arch):
        return 1
    cfg = dispatch.forward_config(arch, dispatch.dtype_name(q.dtype), q.shape[-1], head_dim_v,
                                  **dict(flags, has_sink=False))
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    if flags["page_size"]:  # k holds pages: the bound is the caller's, or the table's capacity (_forward)
        seqlen_k = max_seqlen_k
    else:
        # Varlen without max_seqlen_k: every key sequence is at most the packed total (no device sync).
        seqlen_k = (max_seqlen_k if max_seqlen_k >= 0 else k.shape[0]) if varlen else k.shape[1]
    return dispatch.num_splits_heuristic(
        batch=batch, num_heads=q.shape[-2], num_heads_kv=k.shape[-2], seqlen_q=max_seqlen_q, seqlen_k=seqlen_k,
        tile_m=cfg.tile_m, tile_n=cfg.tile_n, pack_gqa=cfg.pack_gqa,
        num_sms=device_info.get_device_info(q.device).sm_count,
        window_left=window_left if flags["local"] else -1, window_right=window_right if flags["local"] else -1)


def _combine_kernel(device: torch.device, dtype: torch.dtype, head_dim_v: int):
    """flash_attn_combine's kernel (the split-KV forward's combine is part of its pipeline)."""
    name = "float32" if dtype == torch.float32 else dispatch.dtype_name(dtype)
    return compile_cache.get_combine_kernel(dispatch.combine_config(dispatch.arch_for_device(device), name,
                                                                    head_dim_v))


def _combine_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when the combine kernel can read it (unit-stride last dim, other strides multiples
    of 8 floats, 16-byte aligned), else a contiguous copy."""
    bad = t.stride(-1) != 1 or t.data_ptr() % 16 != 0 or any(s % 8 for s in t.stride()[:-1])
    return t.contiguous() if bad and t.numel() else t


@_define_op
def combine(out_partial: torch.Tensor, lse_partial: torch.Tensor,
            out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_combine (arguments checked by validate.check_combine): (num_splits, b, s, h, dv)
    and (num_splits, b, h, s) float32 partials -> out (b, s, h, dv) in out_dtype, lse (b, h, s)."""
    num_splits, b, sq, h, dv = out_partial.shape
    out = torch.empty((b, sq, h, dv), dtype=out_dtype, device=out_partial.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=out_partial.device)
    if out.numel() == 0:
        lse.fill_(float("-inf"))
        return out, lse
    out_partial = _combine_layout(out_partial)
    lse_partial = lse_partial if lse_partial.stride(-1) == 1 else lse_partial.contiguous()
    with _device_guard(out.device):
        _combine_kernel(out.device, out_dtype, dv)(out_partial, lse_partial, out, lse, None)
    return out, lse


@torch.library.register_fake(combine)
def _combine_fake(out_partial, lse_partial, out_dtype):
    _, b, sq, h, dv = out_partial.shape
    return out_partial.new_empty((b, sq, h, dv), dtype=out_dtype), out_partial.new_empty((b, h, sq))


# ---- backward ----

LOG2_E = 1.4426950408889634
_ROW_ALIGN = 4  # float32 rows of the LSE / rowsum buffers: TMA needs 16-byte strides


# The pre- and postprocessing as kernels (fa4_kernels/bwd_preprocess.py, the arch's bwd_postprocess), or as
# the torch ops they replace (kept as the tests' reference). The kernels match them on the H200
# (tests/gpu/test_bwd.py) and make the whole backward 1.03-1.25x faster (docs/perf.md).
PREPROCESS_KERNEL = True
POSTPROCESS_KERNEL = True


def _rowsum_dout_out(dout: torch.Tensor, out: torch.Tensor, varlen: bool) -> torch.Tensor:
    """rowsum(dout * out) per (head, query) in the LSE's layout: (hq, total) or (b, hq, sq)."""
    dpsum = (dout.float() * out.float()).sum(-1)  # (total, hq) or (b, sq, hq)
    return dpsum.t() if varlen else dpsum.transpose(1, 2)


def _backward_rows(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   cu_seqlens_q: Optional[torch.Tensor], use_kernel: bool,
                   arch: Optional[Arch] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse_log2, dpsum) in the kernel's float32 row buffers (BackwardConfig's docstring): the
    forward's LSE in log2 units (+inf where a row saw no key, so P = 0) and rowsum(dout * out);
    padding rows hold 0. Batched: the LSE's layout with rows padded to a multiple of 4; packed: each
    sequence's rows moved to their aligned start (_packed_rows). ``arch``: the backward's (default:
    out's device's)."""
    varlen = cu_seqlens_q is not None
    rows = lse.shape[-1]
    shape = (*lse.shape[:-1], -(-rows // _ROW_ALIGN) * _ROW_ALIGN)
    if use_kernel:
        lse_log2 = torch.empty(shape, dtype=torch.float32, device=lse.device)
        dpsum = torch.empty_like(lse_log2)
        arch = dispatch.arch_for_device(out.device, kernel="backward") if arch is None else arch
        cfg = dispatch.preprocess_config(arch, dispatch.dtype_name(out.dtype), out.shape[-1])
        batched = (lambda t: t.unsqueeze(0)) if varlen else (lambda t: t)  # packed = one long batch entry
        compile_cache.get_backward_preprocess_kernel(cfg)(
            batched(out), batched(dout), batched(lse), batched(dpsum), batched(lse_log2))
    else:
        lse_log2 = torch.zeros(shape, dtype=torch.float32, device=lse.device)
        lse_log2[..., :rows] = torch.where(torch.isinf(lse), float("inf"), lse * LOG2_E)
        dpsum = torch.zeros_like(lse_log2)
        dpsum[..., :rows] = _rowsum_dout_out(dout, out, varlen)
    if varlen:
        return _packed_rows(lse_log2[:, :rows], cu_seqlens_q), _packed_rows(dpsum[:, :rows], cu_seqlens_q)
    return lse_log2, dpsum


def _dq_accum_layout(cfg):
    """The arch's dQ accumulator layout for a BackwardConfig (registry: fa4_kernels/arch.py)."""
    entry = kernels_for(cfg.arch, "backward")
    return entry.load(entry.dq_accum_layout)(cfg)


def _dq_accum(q: torch.Tensor, cfg, cu_seqlens_q: Optional[torch.Tensor]) -> torch.Tensor:
    """The zeroed float32 dQ accumulator the backward kernel reduce-adds into, in the arch's blocked
    order (its dq_accum_layout, fa4_kernels/arch.py): (b, hq, blocks * rows_per_block, row) batched,
    (hq, block_offset(total, batch) * rows_per_block, row) packed."""
    layout = _dq_accum_layout(cfg)
    if cu_seqlens_q is not None:
        blocks = layout.block_offset(q.shape[0], cu_seqlens_q.shape[0] - 1)
        shape = (q.shape[1], blocks * layout.rows_per_block, layout.row)
    else:
        blocks = -(-q.shape[1] // cfg.tile_m)
        shape = (q.shape[0], q.shape[2], blocks * layout.rows_per_block, layout.row)
    return torch.zeros(shape, dtype=torch.float32, device=q.device)


def _dq_accum_index(cfg, q: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor]) -> torch.Tensor:
    """For every element of dQ (q's shape), its position in the flattened dq_accum: the torch
    reference of the postprocessing kernel's reordering, from the layout's block_order. No device sync."""
    layout, tile_m, d = _dq_accum_layout(cfg), cfg.tile_m, cfg.head_dim
    device, block = q.device, tile_m * d
    order = torch.tensor(layout.block_order(), device=device)
    in_block = torch.empty_like(order)
    in_block[order] = torch.arange(block, device=device)  # (row * d + col) -> position in the block
    col = torch.arange(d, device=device)
    if cu_seqlens_q is None:
        batch, sq, hq = q.shape[:3]
        token = torch.arange(sq, device=device)
        blocks = -(-sq // tile_m)
        head_block = (torch.arange(batch, device=device)[:, None] * hq + torch.arange(hq, device=device)) * blocks
        start = (head_block[:, None, :] + (token // tile_m)[None, :, None]) * block  # (b, sq, hq)
    else:
        total, hq = q.shape[:2]
        batch = cu_seqlens_q.shape[0] - 1
        starts = cu_seqlens_q[:-1].long()
        seq = torch.repeat_interleave(torch.arange(batch, device=device), cu_seqlens_q[1:] - cu_seqlens_q[:-1],
                                      output_size=total)
        token = torch.arange(total, device=device) - starts[seq]  # within its sequence
        first = layout.block_offset(starts, torch.arange(batch, device=device))[seq]
        blocks = layout.block_offset(total, batch)
        start = (torch.arange(hq, device=device)[None, :] * blocks + (first + token // tile_m)[:, None]) * block
    return start[..., None] + in_block[(token % tile_m)[..., None] * d + col].unsqueeze(-2)


def _dq_from_accum(dq_accum: torch.Tensor, cfg, q: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                   max_seqlen_q: int, softmax_scale: float, use_kernel: bool, poison: bool = False) -> torch.Tensor:
    """dQ = dq_accum * softmax_scale in the input dtype and q's layout, through the postprocessing
    kernel or its torch reference (``poison``: the kernel's output starts as NaN)."""
    if not use_kernel:
        return (dq_accum.view(-1)[_dq_accum_index(cfg, q, cu_seqlens_q)] * softmax_scale).to(q.dtype)
    dq = torch.full_like(q, float("nan")) if poison else torch.empty_like(q)
    if cu_seqlens_q is None:
        max_seqlen_q = q.shape[1]
    compile_cache.get_backward_postprocess_kernel(cfg.postprocess())(
        dq_accum, dq, cu_seqlens_q, float(softmax_scale), int(max_seqlen_q))
    return dq


def _packed_rows(rows: torch.Tensor, cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """(hq, total_q) rows in token order -> the kernel's packed layout, sequence b from
    packed_row_offset(cu_seqlens_q[b], b) on, zeros between. No device sync."""
    from .fa4_kernels.seqlen import packed_row_offset

    batch, total = cu_seqlens_q.shape[0] - 1, rows.shape[-1]
    starts = cu_seqlens_q[:-1].long()
    shift = packed_row_offset(starts, torch.arange(batch, device=rows.device)) - starts
    index = torch.arange(total, device=rows.device) + torch.repeat_interleave(
        shift, cu_seqlens_q[1:] - cu_seqlens_q[:-1], output_size=total)
    packed = rows.new_zeros(rows.shape[0], packed_row_offset(total, batch))
    return packed.index_copy_(1, index, rows)


def _bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor],
    softmax_scale: float,
    softcap: float,
    causal: bool,
    window_left: int,
    window_right: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    deterministic: bool,
    dlse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of ``fwd`` (kernel call convention: BackwardConfig's docstring): the
    preprocessing kernel (LSE in log2 units, rowsum(dout * out)), the main kernel (dk, dv, and dQ
    into a zeroed fp32 accumulator), the postprocessing kernel (dq in the input dtype).

    ``dlse`` (float32, lse's layout): the loss's gradient through the returned LSE. Since
    d lse_i / d s_ij = P_ij, it adds P_ij * dlse_i to dS_ij = P_ij (dP_ij - D_i): the kernels run
    unchanged with D_i - dlse_i in place of D_i = rowsum(dO * O)_i."""
    if q.numel() == 0 or k.numel() == 0:
        return (torch.zeros_like(q), torch.zeros(k.shape, dtype=k.dtype, device=k.device),
                torch.zeros(v.shape, dtype=v.dtype, device=v.device))
    q, k, v, dout = (validate.kernel_layout(t) for t in (q, k, v, dout))
    cfg = selfcheck.substitute(dispatch.backward_config(
        dispatch.arch_for_device(q.device, kernel="backward"), dispatch.dtype_name(q.dtype), q.shape[-1],
        v.shape[-1], causal=causal, local=_is_local(causal, window_left, window_right),
        has_softcap=softcap > 0.0, varlen=cu_seqlens_q is not None, has_seqused_k=seqused_k is not None,
        deterministic=deterministic), q.device)
    # The self-check runs the whole backward (pre- and postprocessing included).
    cfg, kernel = _checked_kernel(cfg, q.device, compile_cache.get_backward_kernel, BACKWARD_LAUNCH)
    return _launch_backward(kernel, cfg, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                            softmax_scale, softcap, window_left, window_right, max_seqlen_q, max_seqlen_k, dlse,
                            poison=_poison_outputs_for_tests)


bwd = _define_op(_bwd, name="bwd")


def _launch_backward(kernel, cfg, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, softmax_scale,
                     softcap, window_left, window_right, max_seqlen_q, max_seqlen_k, dlse=None,
                     poison: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of a BackwardConfig with its compiled main kernel: the preprocessing (LSE in log2
    units, rowsum(dout * out)), the main kernel (dk, dv, and dQ into a zeroed fp32 accumulator), the
    postprocessing (dq in the input dtype), on the current stream of q's device. ``bwd`` and the
    first-use self-check (selfcheck.py) both launch through here. ``poison``: dq (and dk, dv where
    the kernel writes them whole, i.e. without seqused_k) start as NaN, so that an element left
    unwritten shows up."""
    varlen = cu_seqlens_q is not None
    # The kernel writes dK / dV of every key of every sequence (zeros where no query sees the key),
    # except keys past seqused_k, which must read 0.
    alloc = torch.zeros if seqused_k is not None else torch.empty
    dk = alloc(k.shape, dtype=k.dtype, device=k.device)
    dv = alloc(v.shape, dtype=v.dtype, device=v.device)
    if poison and seqused_k is None:  # what the kernel leaves unwritten shows up
        dk.fill_(float("nan"))
        dv.fill_(float("nan"))
    dq_accum = _dq_accum(q, cfg, cu_seqlens_q)
    semaphore = None
    if cfg.deterministic:
        batch, hq = (cu_seqlens_q.shape[0] - 1, q.shape[1]) if varlen else (q.shape[0], q.shape[2])
        m_blocks = -(-max_seqlen_q // cfg.tile_m)
        semaphore = torch.zeros(batch, hq, m_blocks, 2, dtype=torch.int32, device=q.device)
    if varlen:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
        if max_seqlen_k < 0:  # not given to the forward: the longest key sequence sizes the grid
            max_seqlen_k = validate.longest_sequence(cu_seqlens_k, k.shape[0])
    else:
        max_seqlen_k = k.shape[1]
    if seqused_k is not None:
        seqused_k = seqused_k.contiguous()
    with _device_guard(q.device):  # the kernels launch on the current device's stream
        lse_log2, dpsum = _backward_rows(dout, validate.kernel_layout(out), lse, cu_seqlens_q, PREPROCESS_KERNEL,
                                         cfg.arch)
        if dlse is not None:
            dlse = dlse.float()
            if varlen:  # the rows of each sequence at their aligned start, zero padding between
                dpsum = dpsum - _packed_rows(dlse, cu_seqlens_q)
            else:
                dpsum[..., :dlse.shape[-1]] -= dlse
        kernel(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, cu_seqlens_q, cu_seqlens_k, seqused_k, semaphore,
               float(softmax_scale), float(softcap), int(window_left), int(window_right), int(max_seqlen_k))
        dq = _dq_from_accum(dq_accum, cfg, q, cu_seqlens_q, max_seqlen_q, softmax_scale, POSTPROCESS_KERNEL,
                            poison)
    return dq, dk, dv


@torch.library.register_fake(bwd)
def _bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, softmax_scale, softcap, causal,
              window_left, window_right, max_seqlen_q, max_seqlen_k, deterministic, dlse=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _padded_head_dims(tensors, width: int):
    """The tensors with their last dim zero-padded to ``width`` (those already that wide as they are)."""
    return [t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in tensors]


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale, softcap, causal, left, right,
     max_seqlen_q, max_seqlen_k, deterministic, *_num_splits_and_pages) = inputs  # the same for any split
    out, lse = output
    ctx.set_materialize_grads(False)  # an unused lse gradient arrives as None
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink)
    ctx.options = (softmax_scale, softcap, causal, left, right, max_seqlen_q, max_seqlen_k, deterministic)
    # Forward-only inputs: a paged cache (page_table) and padded queries (seqused_q).
    ctx.forward_only = [name for name, t in zip(("page_table", "seqused_q"), _num_splits_and_pages[1:]) if t is not None]


def _sink_grad(grad_out, out, lse, learnable_sink, varlen: bool, grad_lse=None) -> torch.Tensor:
    """d loss / d sink_h = sum over rows of P(sink) * (dlse - rowsum(dO * O)), with P(sink) =
    exp(sink - lse): the sink is a logit without a value, so its dP is 0; through the returned LSE
    it contributes P(sink) * dlse."""
    dpsum = _rowsum_dout_out(grad_out, out, varlen)  # lse's layout
    if grad_lse is not None:
        dpsum = dpsum - grad_lse.float()
    sink = learnable_sink[:, None] if varlen else learnable_sink[None, :, None]
    dsink = -(torch.exp(sink - lse) * dpsum)
    return dsink.sum(-1) if varlen else dsink.sum((0, 2))


def backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, softmax_scale, softcap, causal,
             window_left, window_right, max_seqlen_q, max_seqlen_k, deterministic, dlse=None):
    """``bwd`` for every head dim the forward takes (the autograd formula's and the torch attention
    provider's backward): head dims the arch's backward has no kernel for run zero-padded to the
    smallest it has (dispatch.backward_head_dims: multiples of 16 from 32 on sm90; on sm100 its
    kernels' classes, e.g. 80 at 96, 160 or 192 / 192 at 256). Zero columns of Q and K add nothing to
    Q K^T, zero columns of V, O and dO nothing to dO V^T or rowsum(dO * O), and the padded gradient
    columns are dropped; the price is the copies and the padded work."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    arch = dispatch.arch_for_device(q.device, kernel="backward")
    kernel_dim, kernel_dim_v = dispatch.backward_head_dims(arch, head_dim, head_dim_v)
    qp, kp = _padded_head_dims((q, k), kernel_dim)
    vp, outp, grad_outp = _padded_head_dims((v, out, grad_out), kernel_dim_v)
    # Autograd runs this with grad off: directly, unless something must see the op (_route).
    run = _bwd if _route(grad_outp, qp, kp, vp, outp, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                         dlse) is _Route.DIRECT else bwd
    dq, dk, dv = run(grad_outp, qp, kp, vp, outp, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, softmax_scale,
                     softcap, causal, window_left, window_right, max_seqlen_q, max_seqlen_k, deterministic, dlse)
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim_v]


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink = ctx.saved_tensors
    if grad_out is None and grad_lse is None:
        return (None,) * 18
    if ctx.forward_only:
        raise NotImplementedError(f"flash-attn4: no backward with {' and '.join(ctx.forward_only)} (a paged KV "
                                  f"cache, padded queries): that forward is for inference")
    if grad_out is None:  # only the LSE was used: dO = 0
        grad_out = torch.zeros_like(out)
    dlse = None if grad_lse is None else grad_lse.float().contiguous()
    dq, dk, dv = backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, *ctx.options, dlse)
    dsink = None
    if learnable_sink is not None and ctx.needs_input_grad[6]:
        dsink = _sink_grad(grad_out, out, lse, learnable_sink, cu_seqlens_q is not None, grad_lse)
    return (dq, dk, dv, None, None, None, dsink) + (None,) * 11


torch.library.register_autograd(fwd, _backward, setup_context=_setup_context)


class _EagerForward(torch.autograd.Function):
    """fwd's autograd formula (_setup_context, _backward) for an eager call (_route): what
    register_autograd builds for the op, less two costs per call. torch.library's wrapper refills
    the op's default arguments from its schema, whose argument list torch rebuilds at each index
    (quadratic in fwd's 18 arguments); and a Function with a separate setup_context binds its
    arguments to forward's signature through inspect. Together ~100 us a call on the development
    CPU, 11x the no-grad call, so forward sets up its context itself and takes all 18 arguments
    positionally."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _fwd(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    backward = staticmethod(_backward)


# What the backward's first-use self-check runs: the whole backward and the sink's gradient, looked up
# here at each call (so that tests can replace either).
BACKWARD_LAUNCH = selfcheck.BackwardLaunch(
    gradients=lambda *args, **kwargs: _launch_backward(*args, **kwargs),
    sink_gradient=lambda *args, **kwargs: _sink_grad(*args, **kwargs))


# ---- KV cache (flash_attn_with_kvcache) ----


def _packed_cache(cache: torch.Tensor) -> torch.Tensor:
    """(b_cache, s_cache, h, d) as the varlen kernel's packed (b_cache * s_cache, h, d) keys: a view when
    the batch stride is s_cache times the row stride (a contiguous cache, or any head/dim permutation
    within a row), else a copy (correct, since the append has already happened, but it reads and
    writes the whole cache on every call)."""
    b_cache, s_cache = cache.shape[0], cache.shape[1]
    return cache.reshape(b_cache * s_cache, *cache.shape[2:])


def _keys_used(page_table: Optional[torch.Tensor], page_size: int, s_new: int,
               cache_seqlens: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """seqused_k of a KV-cache call when no append computed it: cache_seqlens + s_new, or without
    cache_seqlens the whole capacity (a paged sequence's table row; None for a contiguous cache,
    whose batched forward then reads every key). On the device, no sync."""
    if cache_seqlens is not None:
        return cache_seqlens + s_new if s_new else cache_seqlens
    if page_table is None:
        return None
    return _offsets(page_table.shape[0], 0, page_table.device, base=page_table.shape[1] * page_size)


def _kvcache_metadata(q: torch.Tensor, b_cache: int, s_cache: int, s_new: int,
                      cache_seqlens: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],
                      cache_leftpad: Optional[torch.Tensor], ends: Optional[torch.Tensor] = None):
    """The varlen kernel's metadata for a KV-cache call, computed on the device without a sync:
    (cu_seqlens_q, cu_seqlens_k, seqused_k). Batch entry b's keys are cache row rows[b]
    (cache_batch_idx, else b) from position leftpad[b] (0 without cache_leftpad) to ends[b] =
    cache_seqlens[b] + s_new (s_cache without cache_seqlens; ``ends`` when the append computed it),
    so in the packed cache cu_seqlens_k[b] = rows[b] * s_cache + leftpad[b] and seqused_k[b] =
    ends[b] - leftpad[b]. cu_seqlens_k[batch] is the packed total: with seqused_k the kernel reads only
    cu_seqlens_k[b] (seqlen.SeqlenInfo), so the entries need not increase (cache_batch_idx may permute).
    Only for calls with cache_batch_idx or cache_leftpad: without both fwd_kvcache runs the batched
    kernel, which needs none of this."""
    batch, sq, device = q.shape[0], q.shape[1], q.device
    cu_seqlens_q = _offsets(batch + 1, sq, device)
    # Constants from _offsets where they can be: each tensor op here is a launch per call and layer.
    if ends is None:
        ends = (_offsets(batch, 0, device, base=s_cache) if cache_seqlens is None
                else cache_seqlens + s_new if s_new else cache_seqlens)
    starts = _offsets(batch, s_cache, device) if cache_batch_idx is None else cache_batch_idx * s_cache
    seqused_k = ends
    if cache_leftpad is not None:
        starts = starts + cache_leftpad
        seqused_k = ends - cache_leftpad
    cu_seqlens_k = torch.cat([starts, _offsets(1, 0, device, base=b_cache * s_cache)])
    return cu_seqlens_q, cu_seqlens_k, seqused_k.to(torch.int32)


_OFFSETS: dict = {}


def _offsets(n: int, step: int, device: torch.device, *, base: int = 0, last: Optional[int] = None,
             dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``dtype`` (int32) [base, base + step, ..., base + (n - 1) * step], then ``last`` if given: cu_seqlens of
    equal-length sequences, cache-row starts, constant lengths. A decode loop asks for the same ones
    at every step, so each is made once per process (a blocking copy: complete before any stream
    reads it) and never written; where a CUDA graph's memory is being allocated they are made fresh
    instead (_keepable_now)."""
    key = (n, step, base, last, device, dtype)
    t = _OFFSETS.get(key)
    if t is not None:
        return t
    if not _keepable_now(device):
        t = torch.arange(n, dtype=dtype, device=device) * step + base
        return t if last is None else torch.cat([t, t.new_full((1,), last)])
    if len(_OFFSETS) >= 1024:
        _OFFSETS.clear()
    values = [base + i * step for i in range(n)] + ([] if last is None else [last])
    t = _OFFSETS[key] = torch.tensor(values, dtype=dtype, device=device)
    return t


def _keepable_now(device: torch.device) -> bool:
    """Whether a tensor made now on ``device`` may be kept past this call. Not during CUDA-graph
    capture (a host-to-device copy cannot be captured, and the graph keeps what it captured), nor
    while torch.compile's CUDA-graph trees warm up or record a graph: their private memory pool
    takes every allocation then, and a tensor it holds that is not one of the graph's outputs makes
    them fail ("tensor(s) in the cudagraph pool not tracked as outputs"; static-cache generate in
    transformers compiles its decode step this way). Unknown states count as not keepable."""
    if device.type != "cuda":
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:  # never imported: no graph trees in this process
        return True
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        manager = trees.get_manager(index, create_if_none_exists=False)
        return manager is None or not (manager.in_warmup or manager.in_recording)
    except Exception:  # noqa: BLE001 - a private API: if it moved, keep nothing rather than guess
        return False


# Device types the append kernel runs on (scripts/host_time.py --noop adds "cpu", with no-op kernels).
APPEND_KERNEL_DEVICES = ("cuda",)


def _append_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache_seqlens: torch.Tensor, rows: Optional[torch.Tensor],
               page_table: Optional[torch.Tensor]) -> torch.Tensor:
    """Token t of entry b written into the caches at position cache_seqlens[b] + t, in place: cache row
    rows[b] (b when ``rows`` is None), or with a ``page_table`` the page it names for that position.
    Returns seqused_k = cache_seqlens + s_new, the forward's key counts. One launch of the append
    kernel (fa4_kernels/kv_append.py, which writes seqused_k too) where the layouts allow it (unit
    head-dim strides, 16-byte aligned rows, contiguous metadata), else torch's index_put_ (any
    strides). No sync either way: CUDA-graph capturable with cache_seqlens changing between replays.
    Duplicate rows: one of the writers wins (as in FlashAttention)."""
    if k.device.type in APPEND_KERNEL_DEVICES and _append_kernel_takes(k, v, k_cache, v_cache, cache_seqlens, rows,
                                                                        page_table):
        seqused_k = torch.empty_like(cache_seqlens)
        cfg = dispatch.append_config(dispatch.arch_for_device(k.device), dispatch.dtype_name(k.dtype), k.shape[-1],
                                     v.shape[-1], page_table is not None, rows is not None)
        with _device_guard(k.device):
            compile_cache.get_append_kernel(cfg)(k, v, k_cache, v_cache, cache_seqlens, rows, page_table, seqused_k)
        return seqused_k
    pos = cache_seqlens.long()[:, None] + torch.arange(k.shape[1], device=k.device)
    if page_table is not None:
        page_size = k_cache.shape[1]
        index = (page_table.long().gather(1, pos // page_size), pos % page_size)
    else:
        row = torch.arange(k.shape[0], device=k.device) if rows is None else rows.long()
        index = (row[:, None].expand_as(pos), pos)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)
    return cache_seqlens + k.shape[1]


def _append_kernel_takes(k, v, k_cache, v_cache, *metadata) -> bool:
    """Whether the append kernel's call convention holds: 16-byte aligned rows with a unit head-dim
    stride and the other strides in whole 16 bytes (any contiguous tensor: head dims are multiples of
    8), the int32 metadata (validate checked the dtypes) contiguous; None: absent."""
    for t in (k, v, k_cache, v_cache):
        if t.data_ptr() % 16 or not t.is_contiguous() and (t.stride(-1) != 1
                                                            or any(stride % 8 for stride in t.stride()[:-1])):
            return False
    return all(t is None or t.is_contiguous() for t in metadata)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
            interleaved: bool) -> torch.Tensor:
    """x (b, s, h, d) with its first rotary_dim = 2 * cos.shape[1] dims rotated by the angles of rows
    ``pos`` (b, s) of cos/sin (seqlen_ro, rotary_dim / 2): pairs (2i, 2i + 1) when ``interleaved``
    (GPT-J), else (i, i + rotary_dim / 2) (GPT-NeoX); computed in float32, rounded to x's dtype."""
    half = cos.shape[1]
    c = cos[pos].float().unsqueeze(2)  # (b, s, 1, half)
    s = sin[pos].float().unsqueeze(2)
    xr = x[..., :2 * half].float()
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., :half], xr[..., half:])
    r1, r2 = x1 * c - x2 * s, x1 * s + x2 * c
    rotated = torch.stack((r1, r2), dim=-1).flatten(-2) if interleaved else torch.cat((r1, r2), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _kvcache_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    rotary_cos: Optional[torch.Tensor],
    rotary_sin: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    cache_batch_idx: Optional[torch.Tensor],
    cache_leftpad: Optional[torch.Tensor],
    page_table: Optional[torch.Tensor],
    learnable_sink: Optional[torch.Tensor],
    softmax_scale: float,
    softcap: float,
    causal: bool,
    window_left: int,
    window_right: int,
    num_splits: int,
    return_lse: bool,
    rotary_interleaved: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """flash_attn_with_kvcache (arguments checked by validate.check_kvcache; cache_seqlens an int32
    tensor or None): append k, v to the caches in place, then attend: without cache_batch_idx and
    cache_leftpad through the batched forward over the caches themselves with seqused_k =
    cache_seqlens + s_new, else through the varlen forward over the packed cache without copying it
    (_kvcache_metadata). With rotary_cos/sin (validate.check_kvcache:
    only with k) the new keys are rotated at positions cache_seqlens + t before the append, q at
    cache_seqlens + i when causal or local, else all at cache_seqlens (FlashAttention's rule). With a
    ``page_table`` the caches are paged (validate.check_page_table): the append goes to the pages and
    the batched forward reads them through the table (ForwardConfig.page_size; seqused_k the whole
    row of the table without cache_seqlens). Returns out (b, sq, hq, dv) and lse (b, hq, sq) float32
    when ``return_lse``, else None (no transpose copy; the op returns an empty tensor there)."""
    batch, sq, hq, d = q.shape
    paged = page_table is not None
    s_cache = k_cache.shape[1] * (page_table.shape[1] if paged else 1)  # a sequence's capacity
    s_new = 0 if k is None else k.shape[1]
    positional = causal or window_left >= 0 or window_right >= 0  # q's rotary positions advance per token
    if settings.check_cu_seqlens() and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        # Before the append writes anything (one sync; opt-in).
        validate.check_kvcache_values(cache_seqlens, cache_batch_idx, cache_leftpad, s_new, k_cache.shape[0],
                                      s_cache, sq if positional else 1,
                                      None if rotary_cos is None else rotary_cos.shape[0])
        if paged:
            validate.check_page_table_values(page_table, _keys_used(page_table, k_cache.shape[1], s_new, cache_seqlens),
                                             k_cache.shape[0], k_cache.shape[1])
    if rotary_cos is not None:
        steps = torch.arange(max(sq, s_new), device=q.device)
        start = cache_seqlens.long()[:, None]
        k = _rotary(k, rotary_cos, rotary_sin, start + steps[:s_new], rotary_interleaved)
        q_pos = start + steps[:sq] if positional else start.expand(batch, sq)
        q = _rotary(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
    appended = None  # cache_seqlens + s_new, as the append returns it
    if k is not None and k.numel():
        appended = _append_kv(k_cache, v_cache, k, v, cache_seqlens, None if paged else cache_batch_idx, page_table)
    # Decoding's common case (entry b on cache row b from position 0, or on its row of the page table:
    # validate refuses cache_batch_idx and cache_leftpad there): the batched forward over the cache itself
    # with seqused_k = cache_seqlens + s_new, no packed-varlen metadata (_kvcache_metadata) to build.
    if cache_batch_idx is None and cache_leftpad is None:
        seqused_k = appended if appended is not None else _keys_used(page_table, k_cache.shape[1], s_new, cache_seqlens)
        out, lse = _forward(q, k_cache, v_cache, None, None, seqused_k, learnable_sink, softmax_scale, softcap, causal,
                            window_left, window_right, sq, s_cache, num_splits, check_values=False,
                            page_table=page_table, need_lse=return_lse)
        return out, lse if return_lse else None
    cu_seqlens_q, cu_seqlens_k, seqused_k = _kvcache_metadata(
        q, k_cache.shape[0], s_cache, s_new, cache_seqlens, cache_batch_idx, cache_leftpad, appended)
    out, lse = _forward(q.reshape(batch * sq, hq, d), _packed_cache(k_cache), _packed_cache(v_cache),
                        cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale, softcap, causal,
                        window_left, window_right, sq, s_cache, num_splits, check_values=False, need_lse=return_lse)
    out = out.view(batch, sq, hq, v_cache.shape[-1])
    if not return_lse:
        return out, None
    return out, lse.view(hq, batch, sq).transpose(0, 1).contiguous()  # (hq, total_q) -> (b, hq, sq)


def fwd_kvcache(*args):
    """The op: _kvcache_forward, with an empty float32 LSE when not ``return_lse`` (an op returns
    tensors). Its schema is _kvcache_forward's arguments (the signature below), two tensors out."""
    out, lse = _kvcache_forward(*args)
    return out, out.new_empty((0,), dtype=torch.float32) if lse is None else lse


fwd_kvcache.__signature__ = inspect.signature(_kvcache_forward).replace(
    return_annotation="tuple[torch.Tensor, torch.Tensor]")
fwd_kvcache = _define_op(fwd_kvcache, mutates_args=("k_cache", "v_cache"))


def forward_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                    page_table, learnable_sink, *options):
    """``fwd_kvcache`` for flash_attn_with_kvcache: the op, or its implementation directly where
    nothing needs the dispatcher and no autograd graph is recorded (_Route.DIRECT; the LSE is then
    None unless asked for). The cache op has no autograd formula: a KV cache is inference state."""
    tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
               page_table, learnable_sink)
    run = _kvcache_forward if _route(*tensors) is _Route.DIRECT else fwd_kvcache
    return run(*tensors, *options)


@torch.library.register_fake(fwd_kvcache)
def _fwd_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                      cache_leftpad, page_table, learnable_sink, softmax_scale, softcap, causal, window_left, window_right,
                      num_splits, return_lse, rotary_interleaved):
    batch, sq, hq, _ = q.shape
    lse_shape = (batch, hq, sq) if return_lse else (0,)
    return q.new_empty((batch, sq, hq, v_cache.shape[-1])), q.new_empty(lse_shape, dtype=torch.float32)
