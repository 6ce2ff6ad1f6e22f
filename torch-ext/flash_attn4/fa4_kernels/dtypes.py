"""The CuTe DSL element types of the input dtypes the configurations name (config.DTYPES)."""

from __future__ import annotations

import cutlass

CUTLASS_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
