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

The roles here are written from the kernel's code, call for call; a change to the kernel's pipeline
use must be mirrored here (the test names the method each coroutine follows).
"""

from __future__ import annotations

import itertools

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


def make_pipelines(q_tiles, kv_stages):
    """FlashAttentionForwardSm100.make_pipelines: q, kv (TMA -> UMMA: one arrive_expect_tx, the TMA's
    bytes modelled as completing with it; released by one tcgen05.commit), s and o (UMMA -> threads:
    one commit; s released by softmax t and the correction warpgroup, 128 threads each), stats
    (softmax warpgroup -> correction warpgroup, 128 threads each way)."""
    return dict(q=Pipeline(q_tiles, 1, 1), kv=Pipeline(kv_stages, 1, 1),
                s=Pipeline(q_tiles, 1, 2 * WARPGROUP), o=Pipeline(q_tiles, 1, WARPGROUP),
                stats=Pipeline(2 * q_tiles, WARPGROUP, WARPGROUP))


# A CTA's work: the KV block count of each tile it walks, in order. One CTA per tile runs one of
# them with fresh states; a persistent CTA (cfg.persistent_ctas) runs several, its states carried.
# Faults the model can inject (``bugs``), each a plausible way to get the cross-tile phases wrong:
#   "tail_advances_s"   the MMA's last P V moves the s state on, as a single-tile kernel may
#   "o_always_advances" the correction moves o on for a tile without KV blocks (no O commit)
#   "q_never_released"  the MMA warp never gives Q's stages back


def load(p, q_tiles, kv_stages, tiles, persistent, log, bugs=()):
    """FlashAttentionForwardSm100.load (+ load_kv, kernel's load branch): per tile with blocks, Q
    tiles, K_0, then K_i, V_(i-1), then V_last; after the last tile producer_tail on kv (and on q
    with persistent CTAs)."""
    q_state, kv_state = producer(q_tiles), producer(kv_stages)

    def load_kv(state, what):
        yield from p["kv"].producer_acquire(state)
        p["kv"].data[state.index] = what
        p["kv"].commit(state)
        return state.advanced()

    for tile, n in enumerate(tiles):
        if n > 0:
            for t in range(q_tiles):
                yield from p["q"].producer_acquire(q_state)
                p["q"].data[q_state.index] = ("Q", tile, t)
                p["q"].commit(q_state)
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
    log.append(("load done",))


def mma(p, tm, q_tiles, kv_stages, tiles, persistent, log, bugs=()):
    """FlashAttentionForwardSm100.mma per tile: S_t(0); then per block i: O_t += P_t(i-1) V_(i-1),
    S_t(i); Q's stages released (persistent); then the last P V (its s wait does not advance s)
    and O's commit."""
    q_state, kv_state, s_state, o_state = consumer(q_tiles), consumer(kv_stages), producer(q_tiles), producer(q_tiles)

    def pv(t, v_state, tile, block):
        assert p["kv"].data[v_state.index] == ("V", tile, block), "V stage holds another block"
        assert tm["P"][t] == (tile, block), f"P_{t} is not block {block}'s of tile {tile} (softmax not done)"
        assert tm["O_rescaled"][t] == (tile, block), f"O_{t} not rescaled for block {block} of tile {tile}"
        if block == 0:  # O_t starts afresh: the previous tile's O_t must have been read out
            assert tm["O_final"][t] is None, f"O_{t} of tile {tm['O_final'][t]} overwritten before its epilogue"
        tm["O"][t] = (tile, block)

    def qk(t, k_state, tile, block):
        assert p["q"].data[t] == ("Q", tile, t), f"Q stage {t} holds {p['q'].data[t]}, not tile {tile}'s"
        assert p["kv"].data[k_state.index] == ("K", tile, block), "K stage holds another block"
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
            p["s"].commit(s_state)
            s_state = s_state.advanced()
            q_state = q_state.advanced()
        p["kv"].release(k_state)
        kv_state = k_state.advanced()
        for i in range(1, n):
            k_state, v_state = kv_state, kv_state.advanced()
            yield from p["kv"].consumer_wait(k_state)
            for t in range(q_tiles):
                yield from p["s"].producer_acquire(s_state)
                if t == 0:
                    yield from p["kv"].consumer_wait(v_state)
                pv(t, v_state, tile, i - 1)
                qk(t, k_state, tile, i)
                p["s"].commit(s_state)
                s_state = s_state.advanced()
            p["kv"].release(k_state)
            p["kv"].release(v_state)
            kv_state = v_state.advanced()
        if persistent and "q_never_released" not in bugs:
            for t in range(q_tiles):
                p["q"].release(q_first.advanced(t))
        for t in range(q_tiles):
            yield from p["s"].producer_acquire(s_state.advanced(t))
            if t == 0:
                yield from p["kv"].consumer_wait(kv_state)
            pv(t, kv_state, tile, n - 1)
            tm["O_final"][t] = tile
            p["o"].commit(o_state)
            o_state = o_state.advanced()
        if "tail_advances_s" in bugs:
            s_state = s_state.advanced(q_tiles)
        p["kv"].release(kv_state)
        kv_state = kv_state.advanced()
    log.append(("mma done",))


def softmax(p, tm, t, q_tiles, tiles, log, bugs=()):
    """FlashAttentionForwardSm100.softmax (+ softmax_step): tile t's own stages of s (t) and stats
    (t, t + q_tiles), advanced by q_tiles per block and after the final statistics, across tiles."""
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
            p["s"].release(s_state, WARPGROUP)
            s_state = s_state.advanced(q_tiles)
            stats_state = stats_state.advanced(q_tiles)
        yield from p["stats"].producer_acquire(stats_state)
        p["stats"].data[stats_state.index] = ("final", tile, t)
        p["stats"].commit(stats_state, WARPGROUP)
        stats_state = stats_state.advanced(q_tiles)
    log.append(("softmax done", t))


def correction(p, tm, q_tiles, tiles, log, bugs=()):
    """FlashAttentionForwardSm100.correction per tile: per block and query tile the factor, O's
    rescale, the release of S's stage; then each query tile's 1/rowsum and final O (o moves on
    only for a tile with KV blocks, the only ones the MMA warp commits O for)."""
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
                p["s"].release(s_state, WARPGROUP)
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
    log.append(("correction done",))


def run(q_tiles, kv_stages, tiles, order, persistent=None, bugs=()):
    """Interleave the roles over the CTA's ``tiles`` (KV blocks per tile; an int: one tile) in the
    given preference order (each step resumes the first role whose wait has passed); returns the
    log, or fails on a deadlock. ``persistent`` defaults to more than one tile."""
    tiles = [tiles] if isinstance(tiles, int) else list(tiles)
    persistent = len(tiles) > 1 if persistent is None else persistent
    assert persistent or len(tiles) == 1, "one CTA per tile walks one tile"
    p = make_pipelines(q_tiles, kv_stages)
    tm = {key: [None] * q_tiles for key in ("S", "P", "O", "O_rescaled", "O_final")}
    log = []
    roles = {"load": load(p, q_tiles, kv_stages, tiles, persistent, log, bugs),
             "mma": mma(p, tm, q_tiles, kv_stages, tiles, persistent, log, bugs),
             "correction": correction(p, tm, q_tiles, tiles, log, bugs)}
    for t in range(q_tiles):
        roles[f"softmax{t}"] = softmax(p, tm, t, q_tiles, tiles, log, bugs)
    interleave(roles, order, f"q_tiles={q_tiles}, stages={kv_stages}, tiles={tiles}")
    return log


def interleave(roles: dict, order, what: str) -> None:
    """Run the role generators (each yields the predicate its wait needs) to their end: every step
    resumes the first role in ``order`` (names without their warpgroup digit) whose wait has
    passed; fails on a deadlock, naming ``what`` was replayed."""
    waiting = {name: (lambda: True) for name in roles}
    while roles:
        for name in sorted(roles, key=lambda r: order.index(r.rstrip("01"))):
            if waiting[name]():
                try:
                    waiting[name] = next(roles[name])
                except StopIteration:
                    del roles[name]
                break
        else:
            pytest.fail(f"deadlock with {sorted(roles)} waiting ({what})")


ROLE_ORDERS = [list(o) for o in itertools.permutations(["load", "mma", "softmax", "correction"])]


def finishes(log, q_tiles):
    return sorted(e[0] for e in log) == sorted(["load done", "mma done", "correction done"] + ["softmax done"] * q_tiles)


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

    def wrong(q_tiles, kv_stages):
        p = original(q_tiles, kv_stages)
        p["s"] = Pipeline(q_tiles, 1, WARPGROUP)
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
    def softmax_wrong(p, tm, t, q_tiles, tiles, log, bugs=()):
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
