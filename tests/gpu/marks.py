"""Markers shared by the GPU test modules."""

import pytest

# Varlen backward is disabled (ops.VARLEN_BACKWARD_DISABLED) until its kernel path, which hit an
# "illegal instruction" on the H200, is fixed: these must raise; strict, so that enabling it fails them
# until the marker goes.
VARLEN_BACKWARD_DISABLED = pytest.mark.xfail(raises=NotImplementedError, strict=True,
                                             reason="varlen backward disabled (illegal instruction on the H200)")
