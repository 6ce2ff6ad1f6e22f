"""Blackwell (sm_100 family) kernels: TMA loads, tcgen05 MMAs with accumulators in tensor memory,
warp-specialised load / MMA / softmax / correction roles."""
