"""The sm100 backward's barrier protocol, executed on the CPU.

As tests/cpu/test_sm100_protocol.py does for the forward (whose mbarrier model this reuses): the
backward's roles (fa4_kernels/sm100/bwd.py: load, mma, compute warpgroups 0 and 1, the dQ
warpgroup) replayed as Python coroutines making the kernel's pipeline calls with its states, stage
counts and arrival counts, interleaved in every priority order, for one and two Q/dO stages, dQ in
its own TMEM columns (d = 64) or over dP^T's (d = 128), and 0 to 7 query-block steps, with and
without the tail tile's zeroing (zero_kv_tail). Checked:

- every role finishes (a stuck role is a hang on a B200);
- every hand-off sees its producer: the MMA issues dV/dK/dQ of step i only on P^T and dS^T of step i
  from both compute warpgroups; it overwrites dP^T's columns with dQ_i only after both read dP^T_i,
  and dP^T_(i+1) only after the dQ warpgroup read dQ_i out; the compute warps read S^T/dP^T and
  LSE/D of their own step; the dQ warpgroup reads dQ_i; dK/dV are final when the epilogue reads them.

MMAs are modelled as reading and writing at issue (one thread issues them in order; completion is
what the commits signal). A change to the kernel's pipeline use must be mirrored here; each coroutine
names the method it follows.
"""

from __future__ import annotations

import itertools

import pytest

from flash_attn4.fa4_kernels.sm100 import bwd as sm100_bwd
from flash_attn4.fa4_kernels.sm100 import tiles as sm100_tiles
from tests.cpu.test_sm100_protocol import Mbarrier, Pipeline, State, consumer, interleave, producer

WARPGROUP = sm100_bwd.WARPGROUP
GROUPS = sm100_bwd.COMPUTE_GROUPS
WARPS_PER_GROUP = WARPGROUP // sm100_bwd.WARP


def make_pipelines(stages, sdp_empty=GROUPS * WARPGROUP):
    """FlashAttentionBackwardSm100.make_pipelines: kv and qdo (TMA -> UMMA: one arrive_expect_tx, one
    tcgen05.commit release), rows (TMA -> compute: lane 0 of each compute warp releases), sdp and
    dkv (one commit; every compute thread releases), dq (one commit; every dQ thread releases)."""
    return dict(kv=Pipeline(1, 1, 1), qdo=Pipeline(stages, 1, 1),
                rows=Pipeline(stages, 1, GROUPS * WARPS_PER_GROUP), sdp=Pipeline(1, 1, sdp_empty),
                dq=Pipeline(1, 1, WARPGROUP), dkv=Pipeline(1, 1, GROUPS * WARPGROUP))


def load(p, stages, n, log):
    """FlashAttentionBackwardSm100.load: K/V once, per step Q/dO and LSE/D, then producer_tail."""
    qdo_state, rows_state = producer(stages), producer(stages)
    if n > 0:
        kv_state = producer(1)
        yield from p["kv"].producer_acquire(kv_state)
        p["kv"].data[0] = "KV"
        p["kv"].commit(kv_state)
    for i in range(n):
        yield from p["qdo"].producer_acquire(qdo_state)
        p["qdo"].data[qdo_state.index] = ("QdO", i)
        p["qdo"].commit(qdo_state)
        qdo_state = qdo_state.advanced()
        yield from p["rows"].producer_acquire(rows_state)
        p["rows"].data[rows_state.index] = ("rows", i)
        p["rows"].commit(rows_state)
        rows_state = rows_state.advanced()
    if n > 0:  # PipelineTmaUmma.producer_tail: every stage handed back
        for _ in range(stages):
            yield from p["qdo"].producer_acquire(qdo_state)
            qdo_state = qdo_state.advanced()
    log.append("load")


def mma(p, mem, stages, n, dq_over_dp, log, dq_acquire_early=None, tail=False, tail_needs_steps=True):
    """FlashAttentionBackwardSm100.mma (``dq_acquire_early``: where the dq stage is acquired, the
    kernel's choice by default: before S^T/dP^T when dQ shares dP^T's columns), after zero_kv_tail
    where the tile holds its sequence's key end (``tail``): its own wait for K/V, only where the CTA
    has steps (``tail_needs_steps=False``: without that guard), then the zeroing; mma's wait then
    passes on the same phase."""
    early = dq_over_dp if dq_acquire_early is None else dq_acquire_early
    qdo_state, sdp_state, dq_state = consumer(stages), producer(1), producer(1)
    if tail and (n > 0 or not tail_needs_steps):
        yield from p["kv"].consumer_wait(consumer(1))
        assert p["kv"].data[0] == "KV", "zero_kv_tail ran before K/V landed"
        p["kv"].data[0] = "KV, tail zeroed"
    if n > 0:
        yield from p["kv"].consumer_wait(consumer(1))
        assert p["kv"].data[0] == ("KV, tail zeroed" if tail else "KV"), "S^T issued on K/V's unzeroed tail"
        yield from p["sdp"].producer_acquire(sdp_state)
    for i in range(n):
        yield from p["qdo"].consumer_wait(qdo_state)
        assert p["qdo"].data[qdo_state.index] == ("QdO", i), "Q/dO stage holds another block"
        if early:
            yield from p["dq"].producer_acquire(dq_state)
        if i > 0:  # S^T and dP^T overwrite P^T_(i-1) (read by dV_(i-1) at its issue) and, aliased, dQ_(i-1)
            assert not dq_over_dp or mem["dQ_read"] == i - 1, "dP^T overwrites dQ before it was read out"
        mem["S"], mem["dP"] = i, i
        p["sdp"].commit(sdp_state)
        sdp_state = sdp_state.advanced()
        yield from p["sdp"].producer_acquire(sdp_state)
        assert mem["P"] == [i] * GROUPS, f"dV_{i} issued on P^T of steps {mem['P']}"
        assert mem["dS"] == [i] * GROUPS, f"dK_{i} issued on dS^T of steps {mem['dS']}"
        mem["dKV"].append(i)
        p["qdo"].release(qdo_state)
        qdo_state = qdo_state.advanced()
        if not early:
            yield from p["dq"].producer_acquire(dq_state)
        assert i == 0 or mem["dQ_read"] == i - 1, "dQ_i overwrites dQ_(i-1) before it was read out"
        if dq_over_dp:
            assert mem["dP_read"] == [i] * GROUPS, "dQ overwrites dP^T before both warpgroups read it"
            mem["dP"] = ("dQ", i)
        mem["dQ"] = i
        p["dq"].commit(dq_state)
        dq_state = dq_state.advanced()
    if n > 0:
        p["dkv"].commit(producer(1))
    log.append("mma")


def compute(p, mem, w, stages, n, log):
    """FlashAttentionBackwardSm100.compute (+ chunk_gradients) and store_dkv, warpgroup w."""
    sdp_state, rows_state = consumer(1), consumer(stages)
    for i in range(n):
        yield from wait_step(p, rows_state, sdp_state, i)
        assert mem["S"] == i and mem["dP"] == i, f"compute {w} read S^T/dP^T of {mem['S']}/{mem['dP']}, wanted {i}"
        mem["P"][w], mem["dS"][w], mem["dP_read"][w] = i, i, i
        p["sdp"].release(sdp_state, WARPGROUP)
        p["rows"].release(rows_state, WARPS_PER_GROUP)
        sdp_state, rows_state = sdp_state.advanced(), rows_state.advanced()
    yield from store_dkv(p, mem, w, n, log)


def wait_step(p, rows_state, sdp_state, i):
    """A compute warpgroup's waits at the start of step i: LSE/D, then "S/dP full" ("S full")."""
    yield from p["rows"].consumer_wait(rows_state)
    yield from p["sdp"].consumer_wait(sdp_state)
    assert p["rows"].data[rows_state.index] == ("rows", i), "LSE/D of another block"


def store_dkv(p, mem, w, n, log):
    """FlashAttentionBackwardSm100.store_dkv's wait: dK/dV final after the last step's MMAs."""
    if n > 0:
        yield from p["dkv"].consumer_wait(consumer(1))
        assert mem["dKV"] == list(range(n)), "dK/dV read before the last step's MMAs"
    log.append(f"compute{w}")


def reduce_dq(p, mem, n, log):
    """FlashAttentionBackwardSm100.reduce_dq."""
    dq_state = consumer(1)
    for i in range(n):
        yield from p["dq"].consumer_wait(dq_state)
        assert mem["dQ"] == i, f"the dQ warpgroup read dQ of step {mem['dQ']}, wanted {i}"
        mem["dQ_read"] = i
        p["dq"].release(dq_state, WARPGROUP)
        dq_state = dq_state.advanced()
    log.append("dq")


def replay(p, stages, n, order, mma_role, compute_role, label):
    """The 1-CTA roles over pipelines ``p`` in role ``order``: load and reduce_dq, with the MMA
    warp's and the compute warpgroups' coroutines made by ``mma_role(mem, log)`` and
    ``compute_role(mem, w, log)``; returns the finish log."""
    mem = dict(S=None, dP=None, P=[None] * GROUPS, S_read=[None] * GROUPS, dS=[None] * GROUPS,
               dP_read=[None] * GROUPS, dQ=None, dQ_read=None, dKV=[])
    log = []
    roles = {"load": load(p, stages, n, log), "mma": mma_role(mem, log), "dq": reduce_dq(p, mem, n, log)}
    for w in range(GROUPS):
        roles[f"compute{w}"] = compute_role(mem, w, log)
    interleave(roles, order, label)
    return log


def run(stages, n, dq_over_dp, order, pipelines=make_pipelines, dq_acquire_early=None, tail=False,
        tail_needs_steps=True):
    p = pipelines(stages)
    return replay(p, stages, n, order,
                  lambda mem, log: mma(p, mem, stages, n, dq_over_dp, log, dq_acquire_early, tail, tail_needs_steps),
                  lambda mem, w, log: compute(p, mem, w, stages, n, log),
                  f"stages={stages}, steps={n}, dq_over_dp={dq_over_dp}")


ROLE_ORDERS = [list(o) for o in itertools.permutations(["load", "mma", "compute", "dq"])]


@pytest.mark.parametrize("stages", sorted({1, sm100_tiles.BWD_MAX_STAGES}))
@pytest.mark.parametrize("steps", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("dq_over_dp", [False, True])
@pytest.mark.parametrize("tail", [False, True], ids=["no_tail", "tail"])
def test_every_role_finishes_and_every_hand_off_sees_its_producer(stages, steps, dq_over_dp, tail):
    for order in ROLE_ORDERS:
        log = run(stages, steps, dq_over_dp, order, tail=tail)
        assert sorted(log) == sorted(["load", "mma", "dq"] + [f"compute{w}" for w in range(GROUPS)])


@pytest.mark.parametrize("d", sm100_tiles.BWD_HEAD_DIMS)
def test_the_kernel_plans_use_the_replayed_cases(d):
    """The kernel's own plans are among the replayed: its stage count and its dQ placement (over dP^T
    where S^T, dP^T, dK, dV and dQ do not fit 512 columns side by side: d = 96 with two stages, 128
    with one)."""
    from flash_attn4 import dispatch
    from flash_attn4.fa4_kernels.arch import Arch

    from flash_attn4.fa4_kernels.sm100 import bwd_pair

    picked = dispatch.backward_config(Arch.SM100, "bfloat16", d, d, causal=False, local=False, has_softcap=False,
                                      varlen=False, has_seqused_k=False, deterministic=False)
    cfg = dispatch.self_check_fallback(picked) or picked  # the 1-CTA kernel (a pair's fallback)
    plan = sm100_bwd.FlashAttentionBackwardSm100(cfg)
    assert cfg.num_stages in {1, sm100_tiles.BWD_MAX_STAGES} and cfg.cluster_m == 1
    assert plan.dq_over_dp == (2 * cfg.tile_n + 3 * d > sm100_bwd.TMEM_COLUMNS) == (d > 64)
    if picked.cluster_m == 2:  # the pair kernel: one Q/dO stage, dQ over dP^T (run_pair's model)
        pair = bwd_pair.backward_kernel(picked)
        assert picked.num_stages == 1 and pair.dq_over_dp and pair.tmem_dq == pair.tmem_dp


def test_the_model_catches_a_wrong_count():
    """Not vacuous: the sdp empty barrier counting one compute warpgroup only lets the MMA issue dV
    before the other warpgroup wrote its P^T (or overwrite S^T under it)."""
    with pytest.raises(AssertionError):
        for order in ROLE_ORDERS:
            run(2, 3, False, order, pipelines=lambda s: make_pipelines(s, sdp_empty=WARPGROUP))


def test_the_model_catches_a_tail_wait_without_steps():
    """Not vacuous: a tile past its sequence's keys (or one no query block sees) has no step and its
    load warp loads no K/V; zero_kv_tail waiting for them there hangs the MMA warp: caught."""
    with pytest.raises(pytest.fail.Exception, match="deadlock"):
        run(1, 0, True, ROLE_ORDERS[0], tail=True, tail_needs_steps=False)


def test_the_model_catches_dq_acquired_late_over_dp():
    """With dQ over dP^T's columns, acquiring the dq stage only before the dQ MMA (the d = 64 order)
    lets dP^T_(i+1) overwrite dQ_i before the dQ warpgroup read it: caught."""
    with pytest.raises(AssertionError, match="dP\\^T overwrites dQ"):
        for order in ROLE_ORDERS:
            run(1, 3, True, order, dq_acquire_early=False)


# ---- CTA pairs (cluster_m = 2, sm100/bwd_pair.py) ----------------------------------------------------
# Two CTAs, each with its own barriers, load warp, two compute warpgroups and dQ warpgroup; the even
# CTA's MMA warp issues for both. The kv and qdo full barriers of the even CTA count its expect-tx
# arrival and both CTAs' TMA bytes; every commit reaches both CTAs (multicast); the sdp empty barrier
# of the even CTA counts both CTAs' compute threads, the dq one both dQ warpgroups; rows stays per
# CTA. Compute warpgroup w of CTA c writes dS of c's keys for query half w into CTA w's dQ operand
# (ds[w][c]); the dQ MMA reads all four parts. Each CTA's allocator warp frees TMEM after its CTA's
# compute and dQ warpgroups are done (the TMEM_FREE barrier) and the peer arrived (the handshake); a
# freed CTA has exited, and the MMA must never read its shared memory or TMEM after that.

def make_pair_pipelines(sdp_empty=2 * GROUPS * WARPGROUP, dq_empty=2 * WARPGROUP, tx_ctas=2):
    """FlashAttentionBackwardSm100Pair.make_pair_pipelines, per CTA (one Q/dO stage)."""
    full = 1 + tx_ctas
    return [dict(kv=Pipeline(1, full, 1), qdo=Pipeline(1, full, 1), rows=Pipeline(1, 1, GROUPS * WARPS_PER_GROUP),
                 sdp=Pipeline(1, 1, sdp_empty), dq=Pipeline(1, 1, dq_empty), dkv=Pipeline(1, 1, GROUPS * WARPGROUP),
                 dealloc=Mbarrier(1))
            for _ in range(2)]


def pair_arrive_tx(pp, pipe, state, cta):
    """A CTA's load: the even CTA's expect-tx arrival, and each CTA's bytes on the even CTA's barrier."""
    if cta == 0:
        pp[0][pipe].commit(state)
    pp[0][pipe].commit(state)


def pair_commit(pp, pipe, state, kind="commit", ctas=(0, 1)):
    for c in ctas:
        getattr(pp[c][pipe], kind)(state)


def pair_load(pp, cta, n, log):
    """FlashAttentionBackwardSm100Pair.pair_load of CTA ``cta``."""
    p = pp[cta]
    qdo_state, rows_state = producer(1), producer(1)
    if n > 0:
        kv_state = producer(1)
        yield from p["kv"].producer_acquire(kv_state)
        p["kv"].data[0] = "KV"
        pair_arrive_tx(pp, "kv", kv_state, cta)
    for i in range(n):
        yield from p["qdo"].producer_acquire(qdo_state)
        p["qdo"].data[0] = ("QdO", i)
        pair_arrive_tx(pp, "qdo", qdo_state, cta)
        qdo_state = qdo_state.advanced()
        yield from p["rows"].producer_acquire(rows_state)
        p["rows"].data[0] = ("rows", i)
        p["rows"].commit(rows_state)
        rows_state = rows_state.advanced()
    if n > 0:
        yield from p["qdo"].producer_acquire(qdo_state)
    log.append(f"{cta}:load")


def pair_mma(pp, mem, n, log, faults=(), tail=False):
    """FlashAttentionBackwardSm100Pair.pair_mma (the even CTA's MMA warp), after pair_zero_kv_tail
    where the pair holds its sequence's key end (``tail``): its own wait for both CTAs' K/V (only
    where the pair has steps), then the zeroing of both CTAs' rows; pair_mma's wait then passes on
    the same phase. ``faults``: 'release_to_even_cta' the qdo release reaches the even CTA only (no
    multicast); 'tail_without_steps' the zeroing's wait without the steps guard."""
    qdo_state, sdp_state, dq_state = consumer(1), producer(1), producer(1)
    release_ctas = (0,) if "release_to_even_cta" in faults else (0, 1)

    def both_alive():
        assert not any(m["exited"] for m in mem), "an MMA reads the shared memory of a CTA that has exited"

    if tail and (n > 0 or "tail_without_steps" in faults):
        yield from pp[0]["kv"].consumer_wait(consumer(1))
        assert [p["kv"].data[0] for p in pp] == ["KV", "KV"], "pair_zero_kv_tail ran before both CTAs' K/V landed"
        for p in pp:  # its own rows and, through shared::cluster addresses, the odd CTA's
            p["kv"].data[0] = "KV, tail zeroed"
    if n > 0:
        yield from pp[0]["kv"].consumer_wait(consumer(1))
        assert [p["kv"].data[0] for p in pp] == ["KV, tail zeroed" if tail else "KV"] * 2, \
            "S^T issued on a CTA's unzeroed K/V tail"
        yield from pp[0]["sdp"].producer_acquire(sdp_state)
    for i in range(n):
        yield from pp[0]["qdo"].consumer_wait(qdo_state)
        assert [p["qdo"].data[0] for p in pp] == [("QdO", i)] * 2, "a CTA's Q/dO half holds another block"
        yield from pp[0]["dq"].producer_acquire(dq_state)
        both_alive()
        for m in mem:  # dP^T_i overwrites dQ_(i-1) (over dP^T's columns) in both CTAs
            assert i == 0 or m["dQ_read"] == i - 1, "dP^T overwrites dQ before it was read out"
            m["S"], m["dP"] = i, i
        pair_commit(pp, "sdp", sdp_state)
        sdp_state = sdp_state.advanced()
        yield from pp[0]["sdp"].producer_acquire(sdp_state)
        both_alive()
        for c, m in enumerate(mem):
            assert m["P"] == [i] * GROUPS and m["dS_t"] == [i] * GROUPS, f"dV/dK_{i} on CTA {c}'s step {m['P']}"
            m["dKV"].append(i)
        pair_commit(pp, "qdo", qdo_state, "release", release_ctas)
        qdo_state = qdo_state.advanced()
        for c, m in enumerate(mem):
            assert m["ds"] == [i, i], f"dQ_{i} on CTA {c}'s dS parts of steps {m['ds']}"
            assert m["dP_read"] == [i] * GROUPS, "dQ overwrites dP^T before both warpgroups read it"
            m["dP"], m["dQ"] = ("dQ", i), i
        pair_commit(pp, "dq", dq_state)
        dq_state = dq_state.advanced()
    if n > 0:
        pair_commit(pp, "dkv", producer(1))
    log.append("0:mma")


def pair_compute(pp, mem, cta, w, n, log):
    """FlashAttentionBackwardSm100Pair.pair_compute (+ pair_chunk), the dK/dV wait of the kernel's
    compute branch or store_dkv, and for warpgroup 0 (the allocator warp's) the TMEM free."""
    p, m = pp[cta], mem[cta]
    sdp_state, rows_state = consumer(1), consumer(1)
    for i in range(n):
        yield from p["rows"].consumer_wait(rows_state)
        yield from p["sdp"].consumer_wait(sdp_state)
        assert p["rows"].data[0] == ("rows", i), "LSE/D of another block"
        assert m["S"] == i and m["dP"] == i, f"CTA {cta} compute {w} read S^T/dP^T of {m['S']}/{m['dP']}"
        m["P"][w], m["dS_t"][w], m["dP_read"][w] = i, i, i
        mem[w]["ds"][cta] = i  # this CTA's keys, query half w: CTA w's dQ operand
        pp[0]["sdp"].release(sdp_state, WARPGROUP)
        p["rows"].release(rows_state, WARPS_PER_GROUP)
        sdp_state, rows_state = sdp_state.advanced(), rows_state.advanced()
    if n > 0:
        yield from p["dkv"].consumer_wait(consumer(1))
        assert m["dKV"] == list(range(n)), "dK/dV read before the last step's MMAs"
    log.append(f"{cta}:compute{w}")
    if w == 0:  # TMEM_FREE: this CTA's other compute warpgroup and dQ warpgroup are done
        yield lambda: f"{cta}:compute1" in log and f"{cta}:dq" in log
        pp[1 - cta]["dealloc"].arrive()
        yield lambda: p["dealloc"].passed(0)
        m["exited"] = True


def pair_reduce_dq(pp, mem, cta, n, log):
    """FlashAttentionBackwardSm100Pair.pair_reduce_dq of CTA ``cta``."""
    p, m = pp[cta], mem[cta]
    dq_state = consumer(1)
    for i in range(n):
        yield from p["dq"].consumer_wait(dq_state)
        assert m["dQ"] == i, f"CTA {cta}'s dQ warpgroup read dQ of step {m['dQ']}, wanted {i}"
        m["dQ_read"] = i
        pp[0]["dq"].release(dq_state, WARPGROUP)
        dq_state = dq_state.advanced()
    log.append(f"{cta}:dq")


def odd_cta_zeroes_its_own_tail(pp, log):
    """A wrong design of pair_zero_kv_tail: the odd CTA's (idle) MMA warp zeroing its own rows after
    waiting on its own kv barrier, which no TMA completes (both CTAs' bytes land on the even CTA's)."""
    yield from pp[1]["kv"].consumer_wait(consumer(1))
    pp[1]["kv"].data[0] = "KV, tail zeroed"
    log.append("1:mma")


def run_pair(n, order, odd_first, pipelines=make_pair_pipelines, faults=(), tail=False, odd_steps=None):
    """Both CTAs' roles; ``odd_steps``: the odd CTA's steps where they differ from the even one's
    (a fault: the pair's step count is the even CTA's MMA warp's, for both)."""
    pp = pipelines()
    mem = [dict(S=None, dP=None, P=[None] * GROUPS, dS_t=[None] * GROUPS, dP_read=[None] * GROUPS,
                ds=[None, None], dQ=None, dQ_read=None, dKV=[], exited=False) for _ in range(2)]
    log = []
    roles = {"0:mma": pair_mma(pp, mem, n, log, faults, tail and "odd_cta_zeroes" not in faults)}
    if "odd_cta_zeroes" in faults:
        roles["1:mma"] = odd_cta_zeroes_its_own_tail(pp, log)
    for c, steps in enumerate((n, n if odd_steps is None else odd_steps)):
        roles[f"{c}:load"] = pair_load(pp, c, steps, log)
        roles[f"{c}:dq"] = pair_reduce_dq(pp, mem, c, steps, log)
        for w in range(GROUPS):
            roles[f"{c}:compute{w}"] = pair_compute(pp, mem, c, w, steps, log)
    interleave(roles, order, f"pair, steps={n}, tail={tail}", odd_first)
    assert all(m["exited"] for m in mem), "a CTA of the pair never freed its TMEM"
    return log


PAIR_ORDERS = [(order, odd_first) for order in ROLE_ORDERS for odd_first in (False, True)]


@pytest.mark.parametrize("steps", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("tail", [False, True], ids=["no_tail", "tail"])
def test_pair_every_role_of_both_ctas_finishes_and_every_hand_off_sees_both_ctas(steps, tail):
    """With ``tail``: the pair that holds its sequence's key end (varlen, seqused_k), its odd block
    possibly wholly past the keys; the odd CTA's roles are the same either way (its masked steps are
    the pair's steps; it skips only its dK/dV stores). steps=0: a pair past its sequence's keys
    (varlen grids are sized for the longest) or one no query block sees."""
    for order, odd_first in PAIR_ORDERS:
        log = run_pair(steps, order, odd_first, tail=tail)
        assert sorted(log) == sorted(["0:mma"] + [f"{c}:{r}" for c in range(2)
                                                  for r in ("load", "dq", "compute0", "compute1")])


@pytest.mark.parametrize("fault,steps,odd_steps", [("tail_without_steps", 0, None), ("odd_cta_zeroes", 2, None),
                                                   ("odd_steps_differ", 2, 0), ("odd_steps_differ", 0, 2)])
def test_the_pair_model_catches_tail_and_step_faults(fault, steps, odd_steps):
    """Not vacuous for varlen pairs: the zeroing's K/V wait in a pair without steps (nothing loaded:
    the MMA warp hangs), the odd CTA zeroing its own rows on its own kv barrier (no TMA completes
    it: hangs), and the two CTAs of a pair taking different step counts (an odd block past the keys
    taking none while the even block's MMAs, issued for both, wait for its compute threads; or the
    reverse): each hangs or hands some role the wrong step."""
    faults = () if fault == "odd_steps_differ" else (fault,)
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        for order, odd_first in PAIR_ORDERS:
            run_pair(steps, order, odd_first, faults=faults, tail=True, odd_steps=odd_steps)


def test_pair_step_count_is_cluster_uniform():
    """What the faults above rely on the kernel for: pair_tile_work computes the steps from the
    pair's blocks and its sequence alone (never from the CTA's own block), so both CTAs of a pair,
    varlen or not, take the same step count; and the zeroing runs in the even CTA's MMA branch after
    the steps guard."""
    import inspect

    from flash_attn4.fa4_kernels.sm100 import bwd_pair

    src = inspect.getsource(bwd_pair.FlashAttentionBackwardSm100Pair.pair_tile_work)
    body = src[src.index('"""', src.index('"""') + 3):]
    assert "n_block" not in body.replace("n_block = pair * CTAS + rank", "").replace(
        "TileWork(seqlen, mask, blocks, per_head * qhead_per_kvhead, n_block,", ""), body
    zero = inspect.getsource(bwd_pair.FlashAttentionBackwardSm100Pair.pair_zero_kv_tail)
    assert "if work.num_steps > 0:" in zero
    kernel = inspect.getsource(bwd_pair.FlashAttentionBackwardSm100Pair.kernel)
    leader = kernel.index("if rank == PAIR_LEADER:")
    assert leader < kernel.index("self.pair_zero_kv_tail(") < kernel.index("self.pair_mma(")


@pytest.mark.parametrize("fault", ["sdp_one_cta", "dq_one_cta", "tx_one_cta", "release_to_even_cta"])
def test_the_pair_model_catches_pair_faults(fault):
    """Not vacuous: the sdp empty barrier counting one CTA's compute threads (the MMA would read the
    peer's dS or P^T early), dq counting one CTA's dQ warpgroup (dP^T over the peer's unread dQ),
    the full barriers counting one CTA's bytes, or the qdo release reaching the even CTA only: each
    hangs or hands some role the wrong step for some interleaving."""
    kwargs = dict(sdp_one_cta=dict(sdp_empty=GROUPS * WARPGROUP), dq_one_cta=dict(dq_empty=WARPGROUP),
                  tx_one_cta=dict(tx_ctas=1)).get(fault, {})
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        for order, odd_first in PAIR_ORDERS:
            run_pair(3, order, odd_first, pipelines=lambda: make_pair_pipelines(**kwargs), faults=(fault,))


def test_pair_barrier_counts_are_the_kernels():
    """The model's counts are the pair kernel's: sdp and dkv count both CTAs' compute threads (its
    ``compute`` group), dq both dQ warpgroups, and the TMA transaction bytes are both CTAs'."""
    from pathlib import Path

    from flash_attn4.fa4_kernels.sm100 import bwd_pair

    src = Path(bwd_pair.__file__).read_text()
    assert "CooperativeGroup(thread, CTAS * COMPUTE_GROUPS * WARPGROUP)" in src
    assert "CooperativeGroup(thread, CTAS * WARPGROUP)" in src
    assert "return CTAS * sum(cute.size_in_bytes" in src
    pp = make_pair_pipelines()
    assert pp[0]["sdp"].empty[0].count == bwd_pair.CTAS * GROUPS * WARPGROUP
    assert pp[0]["dq"].empty[0].count == bwd_pair.CTAS * WARPGROUP


# ---- The serial schedule (head dims 192 / 128, sm100/bwd_serial.py) ----------------------------------
# The 1-CTA kernel's pipelines, with "sdp" handed back and forth twice per step: "S full" -> "P^T
# written, S^T read" -> "dP full" -> "dS^T written, P^T and dP^T read". TMEM regions modelled: S^T's
# upper half (which dP^T and then dQ overwrite), each warpgroup's P^T words (overwritten by the next S^T
# and by dQ), dP^T and dQ.

def serial_mma(p, mem, n, log, faults=()):
    """FlashAttentionBackwardSm100Serial.mma (``faults``: "dp_before_p" issues dP^T without waiting for
    the first release, "dq_late" acquires the dq stage only before the dQ MMA)."""
    qdo_state, sdp_state, dq_state = consumer(1), producer(1), producer(1)
    if n > 0:
        yield from p["kv"].consumer_wait(consumer(1))
        yield from p["sdp"].producer_acquire(sdp_state)
    for i in range(n):
        yield from p["qdo"].consumer_wait(qdo_state)
        assert p["qdo"].data[qdo_state.index] == ("QdO", i), "Q/dO stage holds another block"
        if "dq_late" not in faults:
            yield from p["dq"].producer_acquire(dq_state)
        assert i == 0 or mem["dQ_read"] == i - 1, "S^T overwrites dQ before it was read out"
        mem["S"], mem["P"] = i, [("S", i)] * GROUPS  # S^T over P^T's words and the columns dQ used
        p["sdp"].commit(sdp_state)
        sdp_state = sdp_state.advanced()
        if "dp_before_p" not in faults:
            yield from p["sdp"].producer_acquire(sdp_state)  # P^T written, S^T read
        assert mem["S_read"] == [i] * GROUPS, "dP^T overwrites S^T before both warpgroups read it"
        mem["S"], mem["dP"] = ("dP", i), i
        p["sdp"].commit(sdp_state)
        sdp_state = sdp_state.advanced()
        assert mem["P"] == [i] * GROUPS, f"dV_{i} issued on P^T {mem['P']}"
        if "dp_before_p" in faults:
            yield from p["sdp"].producer_acquire(sdp_state)
        yield from p["sdp"].producer_acquire(sdp_state)  # dS^T written, P^T and dP^T read
        assert mem["dS"] == [i] * GROUPS, f"dK_{i} issued on dS^T of steps {mem['dS']}"
        mem["dKV"].append(i)
        p["qdo"].release(qdo_state)
        qdo_state = qdo_state.advanced()
        if "dq_late" in faults:
            yield from p["dq"].producer_acquire(dq_state)
        assert mem["dP_read"] == [i] * GROUPS, "dQ overwrites P^T / dP^T before both warpgroups read them"
        mem["dP"], mem["P"], mem["dQ"] = ("dQ", i), [("dQ", i)] * GROUPS, i
        p["dq"].commit(dq_state)
        dq_state = dq_state.advanced()
    if n > 0:
        p["dkv"].commit(producer(1))
    log.append("mma")


def serial_compute(p, mem, w, n, log):
    """FlashAttentionBackwardSm100Serial.compute (phase 1, phase 2) and store_dkv, warpgroup w."""
    sdp_state, rows_state = consumer(1), consumer(1)
    for i in range(n):
        yield from wait_step(p, rows_state, sdp_state, i)  # LSE/D, "S full"
        assert mem["S"] == i, f"compute {w} read S^T of {mem['S']}, wanted {i}"
        mem["S_read"][w], mem["P"][w] = i, i
        p["sdp"].release(sdp_state, WARPGROUP)
        sdp_state = sdp_state.advanced()
        yield from p["sdp"].consumer_wait(sdp_state)  # "dP full"
        assert mem["dP"] == i and mem["P"][w] == i, f"compute {w} read dP^T {mem['dP']} / P^T {mem['P'][w]}"
        mem["dP_read"][w], mem["dS"][w] = i, i
        p["sdp"].release(sdp_state, WARPGROUP)
        p["rows"].release(rows_state, WARPS_PER_GROUP)
        sdp_state, rows_state = sdp_state.advanced(), rows_state.advanced()
    yield from store_dkv(p, mem, w, n, log)


def run_serial(n, order, pipelines=make_pipelines, faults=()):
    p = pipelines(1)
    return replay(p, 1, n, order, lambda mem, log: serial_mma(p, mem, n, log, faults),
                  lambda mem, w, log: serial_compute(p, mem, w, n, log), f"serial, steps={n}, faults={faults}")


@pytest.mark.parametrize("steps", [0, 1, 2, 3, 7])
def test_serial_every_role_finishes_and_every_hand_off_sees_its_producer(steps):
    for order in ROLE_ORDERS:
        log = run_serial(steps, order)
        assert sorted(log) == sorted(["load", "mma", "dq"] + [f"compute{w}" for w in range(GROUPS)])


@pytest.mark.parametrize("fault", ["sdp_one_group", "dp_before_p", "dq_late"])
def test_the_serial_model_catches_serial_faults(fault):
    """Not vacuous: an sdp empty barrier counting one compute warpgroup, dP^T issued before the
    first release (over S^T still being read), and the dq stage acquired only before the dQ MMA
    (the next S^T over dQ not yet read out) are each caught in some order."""
    pipelines = (lambda s: make_pipelines(s, sdp_empty=WARPGROUP)) if fault == "sdp_one_group" else make_pipelines
    faults = () if fault == "sdp_one_group" else (fault,)
    with pytest.raises(AssertionError):
        for order in ROLE_ORDERS:
            run_serial(3, order, pipelines=pipelines, faults=faults)


def test_serial_kernel_plan_is_the_replayed_one():
    """The serial kernel is the 1-CTA kernel with one Q/dO stage and dQ over S^T's columns: what
    run_serial replays (its pipelines are make_pipelines(1))."""
    from flash_attn4 import dispatch
    from flash_attn4.fa4_kernels.arch import Arch
    from flash_attn4.fa4_kernels.sm100 import bwd_pair, bwd_serial

    for d, dv in sm100_tiles.BWD_SERIAL_HEAD_DIMS:
        cfg = dispatch.backward_config(Arch.SM100, "bfloat16", d, dv, causal=True, local=False, has_softcap=False,
                                       varlen=False, has_seqused_k=False, deterministic=False)
        plan = bwd_pair.backward_kernel(cfg)
        assert isinstance(plan, bwd_serial.FlashAttentionBackwardSm100Serial) and cfg.num_stages == 1
        assert plan.tmem_dq == plan.tmem_s and plan.tmem_s < plan.tmem_dp < plan.tmem_s + cfg.tile_m
