"""The barrier protocol of the sm100 backward at d = dv = 256 (sm100/bwd_pair256.py), executed on
the CPU with the mbarrier model of tests/cpu/test_sm100_protocol.py, as the d = 128 pair's replay
does (tests/cpu/test_sm100_bwd_protocol.py, whose helpers this reuses).

What differs from the d = 128 pair and is replayed here: the Q/dO buffers take two TMA phases per
step on the one-stage qdo ring (Q, dO query halves for S^T / dP^T, then Q^T, dO^T head-dim halves
for dK / dV), released by the MMA warp after S^T / dP^T and after dV / dK; P^T and dS^T live in
shared memory (overwritten by the next step's compute threads); every compute thread writes dS into
the dQ operand of the CTA of its query half (both CTAs, both warpgroups feed each dQ operand); dQ has
TMEM columns of its own. Checked, for 0 to 7 steps in every role priority order (either CTA first):
every role of both CTAs finishes, and every hand-off sees its producer:
- S^T / dP^T of step i read the phase-1 contents of step i in both CTAs; dV / dK the phase-2 ones;
- a load phase overwrites the buffers only after the MMAs that read the previous contents issued;
- dV_i / dK_i / dQ_i read P^T, dS^T and dS of step i from every compute warpgroup of both CTAs;
- the compute threads overwrite P^T, dS^T, dS only after the MMAs of the previous step that read
  them issued, and read S^T / dP^T of their own step;
- S^T_(i+1) overwrites S^T / dP^T only after every compute warpgroup read them; dQ_i overwrites
  dQ_(i-1) only after both dQ warpgroups read it; dK / dV are final when read out.
MMAs read and write at issue (one thread issues them in order; commits signal completion).
Varlen / seqused_k (``tail``): the even CTA's MMA warp runs bwd_pair.pair_zero_kv_tail first (its
own wait for both CTAs' K/V, only where the pair has steps, then the zeroing of both CTAs' rows);
the odd CTA's block may lie wholly past the keys (it takes the pair's masked steps and stores no
dK / dV, but waits for dK/dV final like the even one), and a pair past its sequence has no step.
"""

from __future__ import annotations

import pytest

from tests.cpu.test_sm100_bwd_protocol import (GROUPS, PAIR_ORDERS, WARPGROUP, WARPS_PER_GROUP, make_pair_pipelines,
                                               pair_arrive_tx, pair_commit)
from tests.cpu.test_sm100_protocol import consumer, interleave, producer

CTAS = 2
PHASES = ("Q, dO", "Q^T, dO^T")  # the two loads of one step into the Q and dO buffers


def load256(pp, mem, cta, n, log, faults=()):
    """FlashAttentionBackwardSm100Pair256.pair_load (+ load_phase) of CTA ``cta``. ``faults``:
    'phase2_unacquired' loads Q^T, dO^T without waiting for the release of Q, dO."""
    p, m = pp[cta], mem[cta]
    qdo_state, rows_state = producer(1), producer(1)
    if n > 0:
        kv_state = producer(1)
        yield from p["kv"].producer_acquire(kv_state)
        p["kv"].data[0] = "KV"
        pair_arrive_tx(pp, "kv", kv_state, cta)
    for i in range(n):
        yield from p["qdo"].producer_acquire(qdo_state)
        assert m["dKV"] == list(range(i)), f"CTA {cta} loads Q, dO of step {i} over Q^T, dO^T still unread"
        p["qdo"].data[0] = (PHASES[0], i)
        pair_arrive_tx(pp, "qdo", qdo_state, cta)
        qdo_state = qdo_state.advanced()
        yield from p["rows"].producer_acquire(rows_state)
        p["rows"].data[0] = ("rows", i)
        p["rows"].commit(rows_state)
        rows_state = rows_state.advanced()
        if "phase2_unacquired" not in faults:
            yield from p["qdo"].producer_acquire(qdo_state)
        assert m["S"] == i, f"CTA {cta} loads Q^T, dO^T of step {i} over Q, dO before S^T / dP^T read them"
        p["qdo"].data[0] = (PHASES[1], i)
        pair_arrive_tx(pp, "qdo", qdo_state, cta)
        qdo_state = qdo_state.advanced()
    if n > 0:
        yield from p["qdo"].producer_acquire(qdo_state)  # producer_tail
    log.append(f"{cta}:load")


def mma256(pp, mem, n, log, faults=(), tail=False):
    """FlashAttentionBackwardSm100Pair256.pair_mma (the even CTA's MMA warp), after pair_zero_kv_tail
    where the pair holds its sequence's key end (``tail``). ``faults``: 'phase2_unwaited' issues
    dV / dK without waiting for Q^T, dO^T; 'tail_without_steps' the zeroing's K/V wait without the
    steps guard."""
    qdo_state, sdp_state, dq_state = consumer(1), producer(1), producer(1)

    def both_alive():
        assert not any(m["exited"] for m in mem), "an MMA reads the shared memory of a CTA that has exited"

    if tail and (n > 0 or "tail_without_steps" in faults):
        yield from pp[0]["kv"].consumer_wait(consumer(1))
        assert [p["kv"].data[0] for p in pp] == ["KV", "KV"], "pair_zero_kv_tail ran before both CTAs' K/V landed"
        for p in pp:  # its own rows and, through shared::cluster addresses, the odd CTA's
            p["kv"].data[0] = "KV, tail zeroed"
    if n > 0:
        yield from pp[0]["kv"].consumer_wait(consumer(1))
        assert [p["kv"].data[0] for p in pp] == ["KV, tail zeroed" if tail else "KV"] * CTAS, \
            "S^T issued on a CTA's unzeroed K/V tail"
        yield from pp[0]["sdp"].producer_acquire(sdp_state)
    for i in range(n):
        yield from pp[0]["qdo"].consumer_wait(qdo_state)
        both_alive()
        assert [p["qdo"].data[0] for p in pp] == [(PHASES[0], i)] * CTAS, "S^T / dP^T on another load"
        for m in mem:
            assert m["S_read"] == [i - 1 if i else None] * GROUPS, "S^T overwritten before every warpgroup read it"
            m["S"] = i
        pair_commit(pp, "sdp", sdp_state)
        sdp_state = sdp_state.advanced()
        pair_commit(pp, "qdo", qdo_state, "release")
        qdo_state = qdo_state.advanced()

        yield from pp[0]["sdp"].producer_acquire(sdp_state)
        if "phase2_unwaited" not in faults:
            yield from pp[0]["qdo"].consumer_wait(qdo_state)
        both_alive()
        assert [p["qdo"].data[0] for p in pp] == [(PHASES[1], i)] * CTAS, "dV / dK on another load"
        for c, m in enumerate(mem):
            assert m["P"] == [i] * GROUPS and m["dS_t"] == [i] * GROUPS, f"dV/dK_{i} on CTA {c}'s {m['P']}"
            m["dKV"].append(i)
        pair_commit(pp, "qdo", qdo_state, "release")
        qdo_state = qdo_state.advanced()

        yield from pp[0]["dq"].producer_acquire(dq_state)
        both_alive()
        for c, m in enumerate(mem):
            assert i == 0 or m["dQ_read"] == i - 1, "dQ_i overwrites dQ_(i-1) before it was read out"
            assert all(v == i for v in m["ds"].values()) and len(m["ds"]) == CTAS * GROUPS, \
                f"dQ_{i} on CTA {c}'s dS parts {m['ds']}"
            m["dQ"], m["dQ_issued"] = i, i
        pair_commit(pp, "dq", dq_state)
        dq_state = dq_state.advanced()
    if n > 0:
        pair_commit(pp, "dkv", producer(1))
    log.append("0:mma")


def compute256(pp, mem, cta, w, n, log):
    """FlashAttentionBackwardSm100Pair256.pair_compute and pair_store_dkv of warpgroup w (its threads
    of both query halves write dS into both CTAs' dQ operands), and for warpgroup 0 the TMEM free."""
    p, m = pp[cta], mem[cta]
    sdp_state, rows_state = consumer(1), consumer(1)
    for i in range(n):
        yield from p["rows"].consumer_wait(rows_state)
        yield from p["sdp"].consumer_wait(sdp_state)
        assert p["rows"].data[0] == ("rows", i), "LSE/D of another block"
        assert m["S"] == i, f"CTA {cta} compute {w} read S^T/dP^T of {m['S']}, wanted {i}"
        m["S_read"][w] = i
        assert m["dKV"] == list(range(i)), "P^T / dS^T overwritten before dV / dK of the last step issued"
        m["P"][w], m["dS_t"][w] = i, i
        for half in range(CTAS):  # this CTA's keys, query half h: CTA h's dQ operand
            assert mem[half]["dQ_issued"] == (i - 1 if i else None), "dS overwritten before dQ read it"
            mem[half]["ds"][(cta, w)] = i
        pp[0]["sdp"].release(sdp_state, WARPGROUP)
        p["rows"].release(rows_state, WARPS_PER_GROUP)
        sdp_state, rows_state = sdp_state.advanced(), rows_state.advanced()
    if n > 0:
        yield from p["dkv"].consumer_wait(consumer(1))
        assert m["dKV"] == list(range(n)), "dK/dV read before the last step's MMAs"
    log.append(f"{cta}:compute{w}")
    if w == 0:  # TMEM_FREE, then the pair's dealloc handshake
        yield lambda: f"{cta}:compute1" in log and f"{cta}:dq" in log
        pp[1 - cta]["dealloc"].arrive()
        yield lambda: p["dealloc"].passed(0)
        m["exited"] = True


def reduce_dq256(pp, mem, cta, n, log):
    """bwd_pair.pair_reduce_dq (unchanged) of CTA ``cta``."""
    p, m = pp[cta], mem[cta]
    dq_state = consumer(1)
    for i in range(n):
        yield from p["dq"].consumer_wait(dq_state)
        assert m["dQ"] == i, f"CTA {cta}'s dQ warpgroup read dQ of step {m['dQ']}, wanted {i}"
        m["dQ_read"] = i
        pp[0]["dq"].release(dq_state, WARPGROUP)
        dq_state = dq_state.advanced()
    log.append(f"{cta}:dq")


def run256(n, order, odd_first, pipelines=make_pair_pipelines, faults=(), tail=False, odd_steps=None):
    """Both CTAs' roles; ``odd_steps``: the odd CTA's steps where they differ from the even one's
    (a fault: the pair's step count is the even CTA's MMA warp's, for both)."""
    from tests.cpu.test_sm100_bwd_protocol import odd_cta_zeroes_its_own_tail

    pp = pipelines()
    mem = [dict(S=None, S_read=[None] * GROUPS, P=[None] * GROUPS, dS_t=[None] * GROUPS, ds={}, dQ=None,
                dQ_issued=None, dQ_read=None, dKV=[], exited=False) for _ in range(CTAS)]
    log = []
    roles = {"0:mma": mma256(pp, mem, n, log, faults, tail and "odd_cta_zeroes" not in faults)}
    if "odd_cta_zeroes" in faults:
        roles["1:mma"] = odd_cta_zeroes_its_own_tail(pp, log)
    for c, steps in enumerate((n, n if odd_steps is None else odd_steps)):
        roles[f"{c}:load"] = load256(pp, mem, c, steps, log, faults)
        roles[f"{c}:dq"] = reduce_dq256(pp, mem, c, steps, log)
        for w in range(GROUPS):
            roles[f"{c}:compute{w}"] = compute256(pp, mem, c, w, steps, log)
    interleave(roles, order, f"pair256, steps={n}, tail={tail}, faults={faults}", odd_first)
    assert all(m["exited"] for m in mem), "a CTA of the pair never freed its TMEM"
    return log


@pytest.mark.parametrize("steps", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("tail", [False, True], ids=["no_tail", "tail"])
def test_pair256_every_role_finishes_and_every_hand_off_sees_its_producer(steps, tail):
    """With ``tail``: the varlen pair holding its sequence's key end, its odd 64-key block possibly
    wholly past the keys (the same roles: masked steps, no dK/dV store, the dK/dV wait kept).
    steps=0: an empty pair (past its sequence's keys: varlen grids are sized for the longest; or no
    query block sees it)."""
    for order, odd_first in PAIR_ORDERS:
        log = run256(steps, order, odd_first, tail=tail)
        assert sorted(log) == sorted(["0:mma"] + [f"{c}:{r}" for c in range(CTAS)
                                                  for r in ("load", "dq", "compute0", "compute1")])


@pytest.mark.parametrize("fault,steps,odd_steps", [("tail_without_steps", 0, None), ("odd_cta_zeroes", 2, None),
                                                   ("odd_steps_differ", 2, 0), ("odd_steps_differ", 0, 2)])
def test_the_pair256_model_catches_tail_and_step_faults(fault, steps, odd_steps):
    """Not vacuous for varlen pairs: the zeroing's K/V wait in an empty pair (nothing loaded: the
    MMA warp hangs), the odd CTA zeroing its own rows on its own kv barrier (no TMA completes it),
    and the CTAs taking different step counts (an odd block past the keys taking none while the
    MMAs issued for both wait for its compute threads, or the reverse): each caught."""
    faults = () if fault == "odd_steps_differ" else (fault,)
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        for order, odd_first in PAIR_ORDERS:
            run256(steps, order, odd_first, faults=faults, tail=True, odd_steps=odd_steps)


def test_pair256_shares_the_pairs_step_count_and_zeroing():
    """What the varlen replay relies on: the d = 256 pair takes bwd_pair's cluster-uniform step rule
    (pair_tile_work, on its 64-key blocks) and zeroing (pair_zero_kv_tail, guarded by the steps)
    unchanged, and the d = 128 pair's kernel body, which calls the zeroing in the even CTA's MMA
    branch before pair_mma (this class's); a CTA past the keys stores nothing but waits for dK/dV
    final (the pair's last MMAs read its shared memory)."""
    import inspect

    from flash_attn4.fa4_kernels.sm100 import bwd_pair, bwd_pair256

    cls, base = bwd_pair256.FlashAttentionBackwardSm100Pair256, bwd_pair.FlashAttentionBackwardSm100Pair
    assert cls.pair_tile_work is base.pair_tile_work and cls.pair_zero_kv_tail is base.pair_zero_kv_tail
    assert cls.CTA_KEYS == bwd_pair256.KEYS == 64 and base.CTA_KEYS == bwd_pair.TILE_N
    assert cls.kernel is base.kernel
    kernel = inspect.getsource(cls.kernel)
    assert kernel.count("self.pair_tile_work(*tile_args)") == 3  # every role: the same steps
    leader = kernel.index("if rank == PAIR_LEADER:")
    assert leader < kernel.index("self.pair_zero_kv_tail(") < kernel.index("self.pair_mma(")
    for hook in ("pair_shared_tiles", "pair_tmem_layouts", "pair_load", "pair_mma", "pair_compute", "pair_store_dkv"):
        assert f"self.{hook}(" in kernel and getattr(cls, hook) is not getattr(base, hook), hook
    store = inspect.getsource(cls.pair_store_dkv)
    assert "elif has_steps:" in store and store.count("pipes.dkv.consumer_wait(") == 2


@pytest.mark.parametrize("fault", ["phase2_unacquired", "phase2_unwaited", "sdp_one_cta", "dq_one_cta",
                                   "tx_one_cta"])
def test_the_pair256_model_catches_faults(fault):
    """Not vacuous: Q^T / dO^T loaded without waiting for the release of Q / dO (over S^T's
    operands), dV / dK issued without waiting for Q^T / dO^T, the sdp empty barrier counting one
    CTA's compute threads, dq one CTA's dQ warpgroup, the full barriers one CTA's bytes: each hangs
    or hands some role the wrong step in some order."""
    kwargs = dict(sdp_one_cta=dict(sdp_empty=GROUPS * WARPGROUP), dq_one_cta=dict(dq_empty=WARPGROUP),
                  tx_one_cta=dict(tx_ctas=1)).get(fault, {})
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        for order, odd_first in PAIR_ORDERS:
            run256(3, order, odd_first, pipelines=lambda: make_pair_pipelines(**kwargs), faults=(fault,))


def test_pair256_replays_the_kernels_counts_and_phases():
    """The model's counts and phases are the kernel's: sdp and dkv count both CTAs' compute threads,
    dq both dQ warpgroups (bwd_pair.make_pair_pipelines, which the kernel uses), one qdo stage, two
    load phases per step of equal bytes (the kernel raises at trace time otherwise), each released
    by the MMA warp once."""
    import inspect

    from flash_attn4.fa4_kernels.sm100 import bwd_pair256

    cls = bwd_pair256.FlashAttentionBackwardSm100Pair256
    assert cls.make_pair_pipelines is bwd_pair256.FlashAttentionBackwardSm100Pair.make_pair_pipelines
    load_src, mma_src = inspect.getsource(cls.pair_load), inspect.getsource(cls.pair_mma)
    assert load_src.count("self.load_phase(") == 2
    assert mma_src.count("pipes.qdo.consumer_wait(") == 2 and mma_src.count("pipes.qdo.consumer_release(") == 2
    assert "mbar_qdo: cute.struct.MemRange[cutlass.Int64, 2]" in inspect.getsource(cls.__call__)  # one stage
    pp = make_pair_pipelines()
    assert pp[0]["sdp"].empty[0].count == CTAS * GROUPS * WARPGROUP and pp[0]["dq"].empty[0].count == CTAS * WARPGROUP
