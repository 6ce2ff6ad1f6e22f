"""Hopper (sm_90a) kernels: TMA loads, WGMMA, warp-specialised producer/consumer warpgroups.

Looked up through the registry (fa4_kernels/arch.py: KERNELS); tiles.py holds the Hopper rules
and imports no DSL, so this package imports nothing on its own.
"""
