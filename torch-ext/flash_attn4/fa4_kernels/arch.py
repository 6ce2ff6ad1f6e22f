"""Compile targets, which GPU capability runs which kernel family, and which kernels each target has.

``KERNELS`` is the one table of what exists per architecture: for each ``Arch``, the sub-package of
fa4_kernels that holds its kernels and rules, and the kernel classes in it. Nothing outside an
arch's sub-package imports from it directly; shared code (tiles, compile, the torch layer) looks the
arch up here. Modules are imported on first use: the rules are plain Python, the kernels import the
DSL, which takes seconds.

An arch's sub-package provides:
- ``tiles.py``, its rules, plain Python (no DSL import):
  ``forward_tiles(head_dim, head_dim_v, causal, local, page_size=0)`` and
  ``forward_schedule(head_dim, head_dim_v, varlen, qhead_per_kvhead)``: ForwardConfig overrides;
  ``FORWARD_KERNEL_SET``: the problem classes CI compiles (``fa4_kernels.compile.kernel_set``), each a
  dict of ``d``, ``dv``, ``dtype``, ``qhead_per_kvhead``, ``pack_group`` and ForwardConfig flags
  (defaults: 128, 128, bfloat16, 1, 0; ``pack_group``: the ratio packed in padded groups);
  optionally ``FORWARD_SPLIT_KV`` and ``FORWARD_PADDED_PACK`` (True: the forward has the split-KV
  variant, packs padded GQA groups);
  optionally ``check_forward(cfg)``: raises ValueError for a ForwardConfig this arch's kernel
  cannot build (ForwardConfig runs it when constructed);
  with a backward also ``backward_tiles(head_dim, head_dim_v, causal, local, has_softcap)``,
  ``BACKWARD_KERNEL_SET`` (dicts of ``d``, ``dv`` and BackwardConfig flags) and optionally
  ``check_backward(cfg)`` / ``check_postprocess(cfg)``.
- the kernel classes named in its ``ArchKernels`` entry, ``"module:Class"`` within the sub-package,
  each constructed from its config and called with the call convention documented on the config.
"""

from __future__ import annotations

import enum
import functools
import importlib
from dataclasses import dataclass
from typing import Optional


class Arch(str, enum.Enum):
    """A CuTe-DSL compile target. The value is what CUTE_DSL_ARCH expects."""

    SM90 = "sm_90a"
    SM100 = "sm_100a"
    SM103 = "sm_103a"  # Blackwell Ultra: the sm100 kernels, compiled for it (sm_100a code does not run there)

    @classmethod
    def parse(cls, name: str) -> "Arch":
        for arch in cls:
            if name in (arch.value, arch.name.lower(), arch.value.rstrip("a")):
                return arch
        raise ValueError(f"unknown arch {name!r}; known: {[a.value for a in cls]}")

    @classmethod
    def for_capability(cls, major: int, minor: int) -> "Arch | None":
        """The kernel family for a compute capability, or None where we ship none."""
        return {(9, 0): cls.SM90, (10, 0): cls.SM100, (10, 3): cls.SM103}.get((major, minor))

    @property
    def family(self) -> str:
        """The GPU family in words, for messages."""
        return _FAMILIES[self][0]

    @property
    def devices(self) -> str:
        """The capabilities and GPUs that run this target, for messages."""
        return _FAMILIES[self][1]

    def __str__(self) -> str:
        return self.value


_FAMILIES = {Arch.SM90: ("Hopper", "sm_90 (H100/H200)"),
             Arch.SM100: ("Blackwell", "sm_100 (B200/GB200)"),
             Arch.SM103: ("Blackwell Ultra", "sm_103 (B300/GB300)")}


@dataclass(frozen=True)
class ArchKernels:
    """What one compile target ships: ``package`` is its sub-package of fa4_kernels; the others name
    kernel classes (``"module:Class"`` within the package) or, for ``dq_accum_layout``, a function;
    None where the arch has no such kernel."""

    package: str
    forward: str
    backward: Optional[str] = None
    # dQ from the backward's float32 accumulator, in the input dtype (PostprocessConfig).
    bwd_postprocess: Optional[str] = None
    # cfg (anything with tile_m and head_dim: BackwardConfig, PostprocessConfig) -> the layout of the
    # backward's dQ accumulator, which the torch layer allocates and the postprocessing reads back:
    # ``row`` (floats per row), ``rows_per_block`` (rows per query block), ``block_offset(token_offset,
    # batch)`` (a varlen sequence's first query block), ``block_order()`` (for each float of a query
    # block in order, its row * head_dim + col in the block's dQ).
    dq_accum_layout: Optional[str] = None
    # The rules module within the package: one package's kernels can serve several targets whose
    # rules differ (sm_103a: sm_100a's kernels, its own forward softmax schedule).
    rules_module: str = "tiles"
    # Whether the developers have run this target's kernels through the GPU test suite. Targets not
    # run (no such GPU here) check each kernel configuration against PyTorch on first use
    # (torch-ext/flash_attn4/selfcheck.py). Set it once a GPU of the family has passed the suite.
    run_by_us: bool = True
    # Whether the torch layer may send user calls to the backward (``kernels``, IMPLEMENTED, which
    # dispatch reads). False: the backward kernels exist for the CI compile and the static checks
    # only (``compiled_kernels``), for a target whose backward cannot be checked on first use yet.
    # sm_100a's and sm_103a's backward reach users through their first-use self-check (run_by_us=False).
    backward_user_ready: bool = True

    @property
    def kernels(self) -> tuple[str, ...]:
        """The passes users get: "forward", and "backward" where the arch has one ready for them."""
        return ("forward",) + (("backward",) if self.backward and self.backward_user_ready else ())

    @property
    def compiled_kernels(self) -> tuple[str, ...]:
        """The passes that exist and compile (CI, static checks), ready for users or not."""
        return ("forward",) + (("backward",) if self.backward else ())

    def rules(self):
        """The arch's tiles.py (tile and schedule rules, kernel sets, config checks)."""
        return _arch_module(self.package, self.rules_module)

    def load(self, name: str):
        """The object ``"module:attribute"`` of the arch's package (imports the module)."""
        module, _, attribute = name.partition(":")
        return getattr(_arch_module(self.package, module), attribute)


@functools.lru_cache(maxsize=None)
def _arch_module(package: str, module: str):
    """An arch package's module, imported on first use. Cached: the torch layer looks rules and
    layouts up on every backward call, and importlib resolves a relative name anew each time."""
    return importlib.import_module(f".{package}.{module}", __package__)


KERNELS: dict[Arch, ArchKernels] = {
    Arch.SM90: ArchKernels("sm90", forward="fwd:FlashAttentionForwardSm90", backward="bwd:FlashAttentionBackwardSm90",
                           bwd_postprocess="bwd_postprocess:BackwardPostprocessSm90",
                           dq_accum_layout="dq_accum:accum_layout"),
    Arch.SM100: ArchKernels("sm100", forward="fwd:FlashAttentionForwardSm100", backward="bwd_pair256:backward_kernel",
                            bwd_postprocess="bwd_postprocess:BackwardPostprocessSm100",
                            dq_accum_layout="dq_accum:accum_layout", run_by_us=False),
    Arch.SM103: ArchKernels("sm100", forward="fwd:FlashAttentionForwardSm100", backward="bwd_pair256:backward_kernel",
                            bwd_postprocess="bwd_postprocess:BackwardPostprocessSm100",
                            dq_accum_layout="dq_accum:accum_layout", rules_module="tiles_sm103", run_by_us=False),
}

# Targets whose kernels have never run on a GPU of ours: the first-use self-check runs on these.
NOT_RUN_BY_US = frozenset(arch for arch, entry in KERNELS.items() if not entry.run_by_us)

# Kernel passes per arch ("forward", "backward"); empty for a target without kernels. dispatch
# raises a clear error for those.
IMPLEMENTED: dict[Arch, tuple[str, ...]] = {arch: KERNELS[arch].kernels if arch in KERNELS else () for arch in Arch}


def describe_implemented() -> str:
    """What exists, for error messages: 'sm_90a: forward, backward'."""
    return "; ".join(f"{arch.value}: {', '.join(entry.kernels)}" for arch, entry in KERNELS.items()) or "nothing"


def supported_devices(implemented: dict[Arch, tuple[str, ...]] = IMPLEMENTED) -> str:
    """The GPU families with kernels, for messages: 'sm_90 (H100/H200)', with the passes where an
    arch has not all of them ('... (forward only)')."""
    families = [arch.devices + ("" if set(kernels) >= {"forward", "backward"} else f" ({', '.join(kernels)} only)")
                for arch, kernels in implemented.items() if kernels]
    return " or ".join(families) or "none"


def kernels_for(arch: Arch, kernel: str = "forward", *, compiled: bool = False) -> ArchKernels:
    """The registry entry of ``arch``; NotImplementedError naming the arch and what exists when it
    has no ``kernel`` ("forward" or "backward") pass for users (``compiled``: that exists at all,
    for the compile tools and static checks)."""
    entry = KERNELS.get(arch)
    if entry is None or kernel not in (entry.compiled_kernels if compiled else entry.kernels):
        raise NotImplementedError(f"flash-attn4: no {kernel} kernel for {arch} ({Arch(arch).family}) yet; "
                                  f"implemented: {describe_implemented()}")
    return entry
