"""Compile targets, and which GPU capability runs which kernel family."""

from __future__ import annotations

import enum


class Arch(str, enum.Enum):
    """A CuTe-DSL compile target. The value is what CUTE_DSL_ARCH expects."""

    SM90 = "sm_90a"
    SM100 = "sm_100a"

    @classmethod
    def parse(cls, name: str) -> "Arch":
        for arch in cls:
            if name in (arch.value, arch.name.lower(), arch.value.rstrip("a")):
                return arch
        raise ValueError(f"unknown arch {name!r}; known: {[a.value for a in cls]}")

    @classmethod
    def for_capability(cls, major: int, minor: int) -> "Arch | None":
        """The kernel family for a compute capability, or None where we ship none."""
        if (major, minor) == (9, 0):
            return cls.SM90
        if major == 10:
            return cls.SM100
        return None

    def __str__(self) -> str:
        return self.value


# Kernel families that exist today; dispatch raises a clear error for the others.
IMPLEMENTED = {Arch.SM90: ("forward", "backward"), Arch.SM100: ()}
