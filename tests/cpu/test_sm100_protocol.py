"""The sm100 forward's barrier protocol, executed on the CPU.

No GPU here runs the Blackwell kernel, and a wrong mbarrier count or phase does not show in SASS: it
hangs, or lets a role read a buffer before it is written. This test replays the kernel's roles
(fa4_kernels/sm100/fwd.py: load, mma, softmax, correction) as Python coroutines that make the same
pipeline calls with the same states, stage indices and advances, over mbarriers modelled as the
hardware defines them (arrival count, phase parity), and checks, for every shape of the schedule
(one or two query tiles, K/V ring depths, 0 to 7 KV blocks; and for persistent CTAs, several
tiles in a row, some without KV blocks, with the pipeline states carried from tile to tile):

- every role finishes (no deadlock: a stuck role is a hang on a B200);
- each buffer hand-off sees the right producer's data: the MMA reads P_t(j) and O_t rescaled for j,
  the correction reads tile t's factor of block j, the ring's K/V stages hold the block the MMA wants.

CTA pairs (cluster_m = 2, cta_group::2): two CTAs, each with its own barriers, load, softmax and
correction roles and its own S, P and O; the even CTA's MMA warp issues for both. Its q/kv full
barriers count the even CTA's expect-tx arrival and both CTAs' TMA bytes; its s empty barrier
counts both CTAs' softmax and correction threads; every MMA commit (q/kv released, S full, O full)
reaches both CTAs' barriers; the correction warps end with the TMEM dealloc handshake (each arrives
on its peer's barrier and waits on its own). The MMA asserts both CTAs' operands are the block it
wants (Q, K and V halves, P and O rescaled in each CTA's tensor memory).

The roles here are written from the kernel's code, call for call; a change to the kernel's pipeline
use must be mirrored here (the test names the method each coroutine follows).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from flash_attn4.fa4_kernels.sm100 import fwd as sm100_fwd
from flash_attn4.fa4_kernels.sm100 import tiles as sm100_tiles

WARPGROUP = sm100_fwd.WARPGROUP


class Mbarrier:
    """An mbarrier: ``count`` arrivals complete the current phase. try_wait.parity(p) succeeds once
    the phase of parity p has completed, i.e. when the current phase's parity differs from p (so a
    fresh barrier passes a wait for parity 1 at once: how producers start)."""

    def __init__(self, count: int):
        self.count, self.pending, self.completed = count, 0, 0

    def arrive(self, n: int = 1):
        self.pending += n
        assert self.pending <= self.count, "more arrivals than the barrier's count in one phase"
        if self.pending == self.count:
            self.pending, self.completed = 0, self.completed + 1

    def passed(self, parity: int) -> bool:
        return self.completed % 2 != parity


class State:
    """cutlass.pipeline.PipelineState: index within the stages and the phase parity."""

    def __init__(self, stages, index=0, phase=0):
        self.stages, self.index, self.phase = stages, index, phase

    def advanced(self, steps=1):
        s = State(self.stages, self.index, self.phase)
        for _ in range(steps):
            s.index += 1
            if s.index == s.stages:
                s.index, s.phase = 0, s.phase ^ 1
        return s


def producer(stages):
    return State(stages, 0, 1)


def consumer(stages):
    return State(stages, 0, 0)


class Pipeline:
    """full/empty barrier pairs per stage, with the arrival counts the kernel's pipelines use."""

    def __init__(self, stages, full_count, empty_count):
        self.full = [Mbarrier(full_count) for _ in range(stages)]
        self.empty = [Mbarrier(empty_count) for _ in range(stages)]
        self.data = [None] * stages

    # Each wait is a generator step: the scheduler resumes the role once the barrier has passed.
    def producer_acquire(self, s):
        yield lambda: self.empty[s.index].passed(s.phase)

    def consumer_wait(self, s):
        yield lambda: self.full[s.index].passed(s.phase)

    def commit(self, s, n=1):
        self.full[s.index].arrive(n)

    def release(self, s, n=1):
        self.empty[s.index].arrive(n)


def make_pipelines(q_tiles, kv_stages, ctas=1):
    """FlashAttentionForwardSm100.make_pipelines, per CTA: q, kv (TMA -> UMMA: one arrive_expect_tx,
    the TMA's bytes modelled as completing with it; released by one tcgen05.commit), s and o
    (UMMA -> threads: one commit; s released by softmax t and the correction warpgroup, 128 threads
    each), stats (softmax warpgroup -> correction warpgroup, 128 threads each way). A pair
    (``ctas`` = 2): the even CTA's q/kv full barriers complete on its expect-tx arrival and each
    CTA's TMA bytes (1 + ctas events), its s and o empty barriers count both CTAs' threads; plus
    each CTA's TMEM dealloc barrier (one arrival: the peer's allocator warp)."""
    full = 1 if ctas == 1 else 1 + ctas
    return [dict(q=Pipeline(q_tiles, full, 1), kv=Pipeline(kv_stages, full, 1),
                 s=Pipeline(q_tiles, 1, 2 * WARPGROUP * ctas), o=Pipeline(q_tiles, 1, WARPGROUP * ctas),
                 stats=Pipeline(2 * q_tiles, WARPGROUP, WARPGROUP), dealloc=Mbarrier(1))
            for _ in range(ctas)]


def tma_arrivals(p, pipe, state, cta):
    """A load's arrivals on the full barrier: the even CTA's expect-tx (with its bytes, one event
    without pairs); in a pair each CTA's bytes land on the even CTA's barrier too."""
    ctas = len(p)
    if cta == 0:
        p[0][pipe].commit(state)
    if ctas > 1:
        p[0][pipe].commit(state)


def multicast(p, pipe, state, kind):
    """A tcgen05.commit of the MMA warp: on every CTA of the pair (on its own CTA without pairs)."""
    for cta in p:
        getattr(cta[pipe], kind)(state)


# A CTA's work: the KV block count of each tile it walks, in order. One CTA per tile runs one of
# them with fresh states; a persistent CTA (cfg.persistent_ctas) runs several, its states carried.
# Faults the model can inject (``bugs``), each a plausible way to get the cross-tile phases wrong:
#   "tail_advances_s"   the MMA's last P V moves the s state on, as a single-tile kernel may
#   "o_always_advances" the correction moves o on for a tile without KV blocks (no O commit)
#   "q_never_released"  the MMA warp never gives Q's stages back


def load(pp, cta, q_tiles, kv_stages, tiles, persistent, log, bugs=()):
    """FlashAttentionForwardSm100.load (+ load_kv, kernel's load branch) of CTA ``cta``: per tile
    with blocks, Q tiles, K_0, then K_i, V_(i-1), then V_last; after the last tile producer_tail
    on kv (and on q with persistent CTAs). It waits on its own CTA's empty barriers and writes its
    own shared memory; the bytes count on the even CTA's full barrier (tma_arrivals)."""
    p = pp[cta]
    q_state, kv_state = producer(q_tiles), producer(kv_stages)

    def load_kv(state, what):
        yield from p["kv"].producer_acquire(state)
        p["kv"].data[state.index] = what
        tma_arrivals(pp, "kv", state, cta)
        return state.advanced()

    for tile, n in enumerate(tiles):
        if n > 0:
            for t in range(q_tiles):
                yield from p["q"].producer_acquire(q_state)
                p["q"].data[q_state.index] = ("Q", tile, t)
                tma_arrivals(pp, "q", q_state, cta)
                q_state = q_state.advanced()
                if t == 0:
                    kv_state = yield from load_kv(kv_state, ("K", tile, 0))
            for i in range(1, n):
                kv_state = yield from load_kv(kv_state, ("K", tile, i))
                kv_state = yield from load_kv(kv_state, ("V", tile, i - 1))
            kv_state = yield from load_kv(kv_state, ("V", tile, n - 1))
    # producer_tail (PipelineTmaUmma): wait for every stage's last release.
    for pipe, state, stages in (("kv", kv_state, kv_stages),) + ((("q", q_state, q_tiles),) if persistent else ()):
        for _ in range(stages):
            yield from p[pipe].producer_acquire(state)
            state = state.advanced()
    log.append(("load done", cta))


def mma(pp, tms, q_tiles, kv_stages, tiles, persistent, log, bugs=()):
    """FlashAttentionForwardSm100.mma per tile (the MMA warp of CTA 0, which issues for a pair):
    S_t(0); with one CTA, the wait for V_0 of zero_v_tail; then per block i: O_t += P_t(i-1) V_(i-1),
    S_t(i); Q's stages released (persistent);
    then the last P V (its s wait does not advance s) and O's commit. It waits on CTA 0's
    barriers; its commits reach every CTA (multicast); its MMAs read every CTA's operands."""
    p = pp[0]
    q_state, kv_state, s_state, o_state = consumer(q_tiles), consumer(kv_stages), producer(q_tiles), producer(q_tiles)

    def pv(t, v_state, tile, block):
        for c, (pc, tm) in enumerate(zip(pp, tms)):
            assert pc["kv"].data[v_state.index] == ("V", tile, block), f"CTA {c}'s V stage holds another block"
            assert tm["P"][t] == (tile, block), f"CTA {c}'s P_{t} is not block {block}'s of tile {tile}"
            assert tm["O_rescaled"][t] == (tile, block), f"CTA {c}'s O_{t} not rescaled for block {block}"
            if block == 0:  # O_t starts afresh: the previous tile's O_t must have been read out
                assert tm["O_final"][t] is None, f"CTA {c}'s O_{t} of tile {tm['O_final'][t]} overwritten"
            tm["O"][t] = (tile, block)

    def qk(t, k_state, tile, block):
        for c, (pc, tm) in enumerate(zip(pp, tms)):
            assert pc["q"].data[t] == ("Q", tile, t), f"CTA {c}'s Q stage {t} holds {pc['q'].data[t]}"
            assert pc["kv"].data[k_state.index] == ("K", tile, block), f"CTA {c}'s K stage holds another block"
            tm["S"][t] = (tile, block)

    for tile, n in enumerate(tiles):
        if n == 0:
            continue
        q_first, k_state = q_state, kv_state
        for t in range(q_tiles):
            yield from p["q"].consumer_wait(q_state)
            if t == 0:
                yield from p["kv"].consumer_wait(k_state)
            yield from p["s"].producer_acquire(s_state)
            qk(t, k_state, tile, 0)
            multicast(pp, "s", s_state, "commit")
            s_state = s_state.advanced()
            q_state = q_state.advanced()
        multicast(pp, "kv", k_state, "release")
        kv_state = k_state.advanced()
        if len(pp) == 1:
            # zero_v_tail (one CTA): V_0 is waited for early and its rows past the keys zeroed; the
            # model takes the case where every tile's first block reaches past them.
            v_first = kv_state.advanced() if n > 1 else kv_state
            yield from p["kv"].consumer_wait(v_first)
            assert p["kv"].data[v_first.index] == ("V", tile, 0), "zero_v_tail: V_0's stage holds another block"
        for i in range(1, n):
            k_state, v_state = kv_state, kv_state.advanced()
            yield from p["kv"].consumer_wait(k_state)
            for t in range(q_tiles):
                yield from p["s"].producer_acquire(s_state)
                if t == 0:
                    yield from p["kv"].consumer_wait(v_state)
                pv(t, v_state, tile, i - 1)
                qk(t, k_state, tile, i)
                multicast(pp, "s", s_state, "commit")
                s_state = s_state.advanced()
            multicast(pp, "kv", k_state, "release")
            multicast(pp, "kv", v_state, "release")
            kv_state = v_state.advanced()
        if persistent and "q_never_released" not in bugs:
            for t in range(q_tiles):
                multicast(pp, "q", q_first.advanced(t), "release")
        for t in range(q_tiles):
            yield from p["s"].producer_acquire(s_state.advanced(t))
            if t == 0:
                yield from p["kv"].consumer_wait(kv_state)
            pv(t, kv_state, tile, n - 1)
            for tm in tms:
                tm["O_final"][t] = tile
            multicast(pp, "o", o_state, "commit")
            o_state = o_state.advanced()
        if "tail_advances_s" in bugs:
            s_state = s_state.advanced(q_tiles)
        multicast(pp, "kv", kv_state, "release")
        kv_state = kv_state.advanced()
    log.append(("mma done",))


def softmax(pp, tm, cta, t, q_tiles, tiles, log, bugs=()):
    """FlashAttentionForwardSm100.softmax (+ softmax_step) of CTA ``cta``: tile t's own stages of s
    (t) and stats (t, t + q_tiles), advanced by q_tiles per block and after the final statistics,
    across tiles; its releases of s go to CTA 0 (the MMA warp's)."""
    p = pp[cta]
    s_state = State(q_tiles, t, 0)
    stats_state = State(2 * q_tiles, t, 1)
    for tile, n in enumerate(tiles):
        for i in range(n):
            yield from p["s"].consumer_wait(s_state)
            assert tm["S"][t] == (tile, i), f"softmax {t} read S of {tm['S'][t]}, wanted tile {tile} block {i}"
            yield from p["stats"].producer_acquire(stats_state)
            p["stats"].data[stats_state.index] = ("factor", tile, t, i)
            p["stats"].commit(stats_state, WARPGROUP)
            tm["P"][t] = (tile, i)
            pp[0]["s"].release(s_state, WARPGROUP)
            s_state = s_state.advanced(q_tiles)
            stats_state = stats_state.advanced(q_tiles)
        yield from p["stats"].producer_acquire(stats_state)
        p["stats"].data[stats_state.index] = ("final", tile, t)
        p["stats"].commit(stats_state, WARPGROUP)
        stats_state = stats_state.advanced(q_tiles)
    log.append(("softmax done", t))


def correction(pp, tm, cta, q_tiles, tiles, log, bugs=()):
    """FlashAttentionForwardSm100.correction per tile, of CTA ``cta``: per block and query tile the
    factor, O's rescale, the release of S's stage (to CTA 0's barrier); then each query tile's
    1/rowsum and final O (o moves on only for a tile with KV blocks, the only ones the MMA warp
    commits O for); in a pair, last, the TMEM dealloc handshake (TmemAllocator.free)."""
    p = pp[cta]
    stats_state, s_state, o_state = consumer(2 * q_tiles), consumer(q_tiles), consumer(q_tiles)
    for tile, n in enumerate(tiles):
        for i in range(n):
            for t in range(q_tiles):
                yield from p["stats"].consumer_wait(stats_state)
                assert p["stats"].data[stats_state.index] == ("factor", tile, t, i), \
                    "correction read another tile's factors"
                p["stats"].release(stats_state, WARPGROUP)
                if i > 0:
                    assert tm["O"][t] == (tile, i - 1), f"O_{t} does not hold block {i - 1}'s P V yet"
                tm["O_rescaled"][t] = (tile, i)
                pp[0]["s"].release(s_state, WARPGROUP)
                stats_state, s_state = stats_state.advanced(), s_state.advanced()
        for t in range(q_tiles):
            yield from p["stats"].consumer_wait(stats_state)
            assert p["stats"].data[stats_state.index] == ("final", tile, t)
            p["stats"].release(stats_state, WARPGROUP)
            stats_state = stats_state.advanced()
            if n > 0:
                yield from p["o"].consumer_wait(o_state)
                assert tm["O"][t] == (tile, n - 1), f"final O_{t} is {tm['O'][t]}, not tile {tile}'s last block"
                tm["O_final"][t] = None  # read out (store_o waits for its TMEM loads)
            if n > 0 or "o_always_advances" in bugs:
                o_state = o_state.advanced()
    if len(pp) > 1:  # free: arrive on the peer's dealloc barrier, wait for the peer's arrival
        pp[1 - cta]["dealloc"].arrive()
        yield lambda: p["dealloc"].passed(0)
        tm["freed"] = True
    log.append(("correction done", cta))


def run(q_tiles, kv_stages, tiles, order, persistent=None, bugs=(), ctas=1, odd_first=False):
    """Interleave the roles over the CTA's ``tiles`` (KV blocks per tile; an int: one tile) in the
    given preference order (each step resumes the first role whose wait has passed; ``odd_first``:
    a pair's odd CTA before the even one); returns the log, or fails on a deadlock. ``persistent``
    defaults to more than one tile. ``ctas`` = 2: a CTA pair walking the same tiles."""
    tiles = [tiles] if isinstance(tiles, int) else list(tiles)
    persistent = len(tiles) > 1 if persistent is None else persistent
    assert persistent or len(tiles) == 1, "one CTA per tile walks one tile"
    p = make_pipelines.__globals__["make_pipelines"](q_tiles, kv_stages, ctas)
    tms = [{key: [None] * q_tiles for key in ("S", "P", "O", "O_rescaled", "O_final")} for _ in range(ctas)]
    log = []
    roles = {"0:mma": mma(p, tms, q_tiles, kv_stages, tiles, persistent, log, bugs)}
    for c in range(ctas):
        roles[f"{c}:load"] = load(p, c, q_tiles, kv_stages, tiles, persistent, log, bugs)
        roles[f"{c}:correction"] = correction(p, tms[c], c, q_tiles, tiles, log, bugs)
        for t in range(q_tiles):
            roles[f"{c}:softmax{t}"] = softmax(p, tms[c], c, t, q_tiles, tiles, log, bugs)
    interleave(roles, order, f"q_tiles={q_tiles}, stages={kv_stages}, tiles={tiles}, ctas={ctas}", odd_first)
    assert all(tm.get("freed", ctas == 1) for tm in tms), "a CTA of the pair never freed its TMEM"
    return log


def interleave(roles: dict, order, what: str, odd_first: bool = False) -> None:
    """Run the role generators (each yields the predicate its wait needs) to their end: every step
    resumes the first role in ``order`` (names without their CTA and warpgroup digit) whose wait
    has passed, CTA 0's first (``odd_first``: CTA 1's); fails on a deadlock, naming ``what`` was
    replayed."""
    def priority(name):  # "<cta>:<role>", or "<role>" alone (CTA 0; the backward's replay names them so)
        cta, _, role = name.rpartition(":")
        cta = int(cta or 0)
        return order.index(role.rstrip("01")), -cta if odd_first else cta

    waiting = {name: (lambda: True) for name in roles}
    while roles:
        for name in sorted(roles, key=priority):
            if waiting[name]():
                try:
                    waiting[name] = next(roles[name])
                except StopIteration:
                    del roles[name]
                break
        else:
            pytest.fail(f"deadlock with {sorted(roles)} waiting ({what})")


ROLE_ORDERS = [list(o) for o in itertools.permutations(["load", "mma", "softmax", "correction"])]


def finishes(log, q_tiles, ctas=1):
    return sorted(e[0] for e in log) == sorted(["mma done"] + ctas * (["load done", "correction done"]
                                                                      + ["softmax done"] * q_tiles))


@pytest.mark.parametrize("q_tiles", [1, 2])
@pytest.mark.parametrize("kv_stages", [sm100_tiles.MIN_KV_STAGES, 3, sm100_tiles.MAX_KV_STAGES])
@pytest.mark.parametrize("num_blocks", [0, 1, 2, 3, 7])
def test_every_role_finishes_and_every_hand_off_sees_its_producer(q_tiles, kv_stages, num_blocks):
    for order in ROLE_ORDERS:  # every priority among the roles: the hardware's interleaving is free
        assert finishes(run(q_tiles, kv_stages, num_blocks, order), q_tiles)
        # a persistent CTA that got a single tile (grid = tiles) releases Q and waits for it
        assert finishes(run(q_tiles, kv_stages, [num_blocks], order, persistent=True), q_tiles)


# Persistent CTAs: several tiles per CTA, with every phase parity, tiles without KV blocks (a
# sequence with no keys) between and at both ends, and more tiles than stages of any ring.
PERSISTENT_TILES = [(1, 1), (2, 2, 2), (3, 1, 2, 1), (1, 0, 2), (0, 3, 0, 0, 1), (7, 1, 1, 3), (2,) * 5, (1,) * 7,
                    (0, 0), (5, 0, 4)]


@pytest.mark.parametrize("q_tiles", [1, 2])
@pytest.mark.parametrize("kv_stages", [sm100_tiles.MIN_KV_STAGES, 3, sm100_tiles.MAX_KV_STAGES])
@pytest.mark.parametrize("tiles", PERSISTENT_TILES, ids=lambda t: "-".join(map(str, t)))
def test_persistent_ctas_carry_every_phase_across_tiles(q_tiles, kv_stages, tiles):
    for order in ROLE_ORDERS:
        assert finishes(run(q_tiles, kv_stages, tiles, order), q_tiles)


@pytest.mark.parametrize("bug,tiles", [("tail_advances_s", (2, 2)), ("o_always_advances", (1, 0, 1)),
                                       ("q_never_released", (1, 1))])
def test_the_model_catches_cross_tile_phase_faults(bug, tiles):
    """Each way of carrying a state wrongly from one tile to the next hangs or hands a role the wrong
    tile's data in the model, for some interleaving: so the persistent test above is not vacuous."""
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        for q_tiles in (1, 2):
            for order in ROLE_ORDERS:
                run(q_tiles, 2, tiles, order, bugs=(bug,))


def test_the_model_catches_a_wrong_count():
    """The model is not vacuous: with the S pipeline's empty barrier expecting only the softmax's
    arrivals (the correction's 128 forgotten), the MMA overwrites S before O was rescaled."""
    original = make_pipelines.__globals__["make_pipelines"]

    def wrong(q_tiles, kv_stages, ctas=1):
        p = original(q_tiles, kv_stages, ctas)
        p[0]["s"] = Pipeline(q_tiles, 1, WARPGROUP)
        return p

    make_pipelines.__globals__["make_pipelines"] = wrong
    try:
        with pytest.raises(AssertionError):
            for order in ROLE_ORDERS:
                run(2, 2, 3, order)
    finally:
        make_pipelines.__globals__["make_pipelines"] = original


def test_the_model_catches_a_wrong_stage_stride():
    """Softmax t advancing its stats stage by 1 instead of q_tiles (so two tiles would write each
    other's factors) is caught."""
    def softmax_wrong(pp, tm, cta, t, q_tiles, tiles, log, bugs=()):
        p = pp[cta]
        s_state, stats_state = State(q_tiles, t, 0), State(2 * q_tiles, t, 1)
        for tile, n in enumerate(tiles):
            for i in range(n):
                yield from p["s"].consumer_wait(s_state)
                yield from p["stats"].producer_acquire(stats_state)
                p["stats"].data[stats_state.index] = ("factor", tile, t, i)
                p["stats"].commit(stats_state, WARPGROUP)
                tm["P"][t] = (tile, i)
                p["s"].release(s_state, WARPGROUP)
                s_state, stats_state = s_state.advanced(q_tiles), stats_state.advanced(1)
            yield from p["stats"].producer_acquire(stats_state)
            p["stats"].data[stats_state.index] = ("final", tile, t)
            p["stats"].commit(stats_state, WARPGROUP)
        log.append(("softmax done", t))

    g = run.__globals__
    original = g["softmax"]
    g["softmax"] = softmax_wrong
    try:
        with pytest.raises((AssertionError, pytest.fail.Exception)):
            for order in ROLE_ORDERS:
                run(2, 2, 3, order)
    finally:
        g["softmax"] = original


def test_one_kv_stage_deadlocks_so_the_rules_refuse_it():
    """With one ring stage the MMA warp waits for V_(j-1) while K_j occupies the only stage: the
    model hangs from two blocks on, which is why sm100/tiles.py requires MIN_KV_STAGES = 2 and every
    configuration dispatch builds has at least that (shared memory permitting: checked for the CI
    kernel set)."""
    with pytest.raises(pytest.fail.Exception, match="deadlock"):
        run(2, 1, 2, ROLE_ORDERS[0])
    assert sm100_tiles.MIN_KV_STAGES == 2
    for flags in sm100_tiles.FORWARD_KERNEL_SET:
        d, dv = flags.get("d", 128), flags.get("dv", 128)
        assert sm100_tiles.forward_tiles(d, dv, False, False)["num_stages"] >= sm100_tiles.MIN_KV_STAGES


# ---- CTA pairs (cluster_m = 2) ---------------------------------------------------------------------
PAIR_ORDERS = [(order, odd_first) for order in ROLE_ORDERS for odd_first in (False, True)]


@pytest.mark.parametrize("q_tiles", [1, 2])
@pytest.mark.parametrize("kv_stages", [sm100_tiles.MIN_KV_STAGES, 3, sm100_tiles.MAX_KV_STAGES])
@pytest.mark.parametrize("num_blocks", [0, 1, 2, 3, 7])
def test_pair_every_role_of_both_ctas_finishes_and_sees_both_halves(q_tiles, kv_stages, num_blocks):
    for order, odd_first in PAIR_ORDERS:
        assert finishes(run(q_tiles, kv_stages, num_blocks, order, ctas=2, odd_first=odd_first), q_tiles, 2)
        assert finishes(run(q_tiles, kv_stages, [num_blocks], order, persistent=True, ctas=2,
                            odd_first=odd_first), q_tiles, 2)


@pytest.mark.parametrize("kv_stages", [sm100_tiles.MIN_KV_STAGES, sm100_tiles.MAX_KV_STAGES])
@pytest.mark.parametrize("tiles", PERSISTENT_TILES, ids=lambda t: "-".join(map(str, t)))
def test_pair_persistent_ctas_carry_every_phase_across_tiles(kv_stages, tiles):
    for order, odd_first in PAIR_ORDERS:
        assert finishes(run(2, kv_stages, tiles, order, ctas=2, odd_first=odd_first), 2, 2)


def pair_fault(name):
    """A pair's protocol with one plausible fault (BLACKWELL.md's 2-CTA failure modes) injected:
    'tx_one_cta' the full barriers wait for one CTA's bytes only; 's_one_cta' the even CTA's s
    empty barrier counts only its own threads; 'release_to_even_cta' the MMA's releases of q/kv
    stages reach the even CTA only (no multicast); 'commit_to_even_cta' S/O full reach it only."""
    g = run.__globals__
    original_pipes, original_multicast = g["make_pipelines"], g["multicast"]

    def pipes(q_tiles, kv_stages, ctas=1):
        p = original_pipes(q_tiles, kv_stages, ctas)
        if name == "tx_one_cta":
            p[0]["q"], p[0]["kv"] = Pipeline(q_tiles, 2, 1), Pipeline(kv_stages, 2, 1)
        if name == "s_one_cta":
            p[0]["s"] = Pipeline(q_tiles, 1, 2 * WARPGROUP)
        return p

    def multicast(p, pipe, state, kind):
        to_even_only = (name == "release_to_even_cta" and kind == "release") or \
                       (name == "commit_to_even_cta" and kind == "commit")
        original_multicast(p[:1] if to_even_only else p, pipe, state, kind)

    return pipes, multicast


@pytest.mark.parametrize("fault", ["tx_one_cta", "s_one_cta", "release_to_even_cta", "commit_to_even_cta"])
def test_the_pair_model_catches_pair_faults(fault):
    """Each fault hangs the pair or hands the MMA (or a CTA's softmax or correction) the wrong data
    for some interleaving, so the pair tests above are not vacuous."""
    g = run.__globals__
    originals = g["make_pipelines"], g["multicast"]
    g["make_pipelines"], g["multicast"] = pair_fault(fault)
    try:
        with pytest.raises((AssertionError, pytest.fail.Exception)):
            for order, odd_first in PAIR_ORDERS:
                for tiles in ((3,), (2, 2)):
                    run(2, 2, tiles, order, ctas=2, odd_first=odd_first)
    finally:
        g["make_pipelines"], g["multicast"] = originals


def test_pair_barrier_counts_are_the_kernels():
    """The model's pair counts are the kernel's: s's empty barrier counts both CTAs' softmax and
    correction threads, o's both correction warpgroups, and the loads count both CTAs' bytes (the
    kernel's tx counts are its per-CTA tile bytes times cluster_m)."""
    src = Path(sm100_fwd.__file__).read_text()
    assert "2 * WARPGROUP * ctas" in src and "WARPGROUP * ctas" in src
    assert "* cfg.cluster_m" in src.split("Transaction bytes a full barrier waits for")[1][:400]
    p = make_pipelines(2, 2, ctas=2)
    assert p[0]["s"].empty[0].count == 2 * 2 * WARPGROUP and p[0]["o"].empty[0].count == 2 * WARPGROUP
