"""TapPlanner (spec §7.1, §13.1): every rule on worked examples, then property tests."""

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_jax.prefix_cache import (HintKind, Placement, SnapshotKind, TapHint, TapPlanOptions, TapSource,
                                     plan_taps)

EXPLICIT, OPENER, TOOLS, SYSTEM, AUTO, MESSAGE = (HintKind.EXPLICIT, HintKind.OPENER, HintKind.TOOLS_END,
                                                  HintKind.SYSTEM_END, HintKind.AUTOMATIC, HintKind.MESSAGE)
CHAT = TapPlanOptions(max_new_taps=8, tap_ladder_tokens=4096, tap_min_gap_tokens=1024)


def hints(*pairs):
    return [TapHint(p, k) for p, k in pairs]


def summary(taps):
    return [(t.position, t.placement.value, t.kind.value, t.source.value) for t in taps]


def test_chat_turn_taps_system_end_as_boundary_and_opener_absorbs_the_tail():
    taps = plan_taps(1000, 0, hints((300, SYSTEM), (300, MESSAGE), (700, MESSAGE), (980, OPENER)), options=CHAT)
    assert summary(taps) == [(256, "exact", "boundary", "structural"), (960, "exact", "tap", "opener")]


def test_semantic_cluster_keeps_its_earliest_member_and_its_boundary_publication():
    taps = plan_taps(1000, 0, hints((950, SYSTEM), (980, OPENER)), options=CHAT)
    # one cluster (30 < 64 apart): earliest 950 -> 896, priority of the opener, published as Boundary;
    # the prompt tail (999 -> 960) lies 64 after it and is dropped
    assert summary(taps) == [(896, "exact", "boundary", "structural")]
    assert taps[0].priority == 2
    auto = plan_taps(1000, 0, hints((500, AUTO), (520, TOOLS)), options=CHAT)
    assert summary(auto) == [(448, "exact", "boundary", "automatic"), (960, "flexible", "tap", "prompt_tail")]
    alone = plan_taps(1000, 0, hints((500, AUTO)), options=CHAT)
    assert summary(alone)[0] == (448, "exact", "tap", "automatic")  # automatic markers publish as taps


def test_resuming_from_an_endpoint_drops_the_opener_tap():
    h = hints((1180, OPENER))
    assert summary(plan_taps(1200, 900, h, options=CHAT)) == [(1152, "exact", "tap", "opener")]
    assert summary(plan_taps(1200, 900, h, options=CHAT, resumed_from_endpoint=True)) == [
        (1152, "flexible", "tap", "prompt_tail")]


def test_proximity_drops_non_explicit_candidates_but_not_explicit_ones():
    taps = plan_taps(2000, 0, hints((1000, EXPLICIT), (1030, OPENER)), existing_frontiers=[1900], options=CHAT)
    # explicit 1000 -> 960 ; opener 1030 -> 1024 lies 64 after it: dropped ; tail 1999 -> 1984 lies
    # 84 after the existing snapshot at 1900: kept
    assert summary(taps) == [(960, "exact", "boundary", "explicit"), (1984, "flexible", "tap", "prompt_tail")]
    near_existing = plan_taps(2000, 0, hints((960, EXPLICIT)), existing_frontiers=[940], options=CHAT)
    assert near_existing[0].position == 960
    near_base = plan_taps(2000, 1000, hints((1050, OPENER)), options=CHAT)
    assert all(t.source is not TapSource.OPENER for t in near_base)  # 1024 is 24 after the base
    duplicate = plan_taps(2000, 0, hints((960, EXPLICIT)), existing_frontiers=[960], options=CHAT)
    assert 960 not in [t.position for t in duplicate]


def test_ladder_snaps_to_message_boundaries_and_keeps_the_gap_on_both_sides():
    h = hints((15500, MESSAGE), (11000, MESSAGE), (9000, MESSAGE))
    taps = plan_taps(20000, 0, h, options=CHAT)
    # n - 4096 = 15904 -> message 15500 -> 15488 ; n - 8192 = 11808 -> 11000 -> 10944 ;
    # n - 16384 = 3616 (no boundary within 1024) -> 3584 ; the tail 19999 -> 19968
    assert summary(taps) == [(3584, "flexible", "tap", "ladder"), (10944, "flexible", "tap", "ladder"),
                             (15488, "flexible", "tap", "ladder"), (19968, "flexible", "tap", "prompt_tail")]
    crowded = plan_taps(20000, 0, h + hints((3700, EXPLICIT)), options=CHAT)
    assert [t.position for t in crowded] == [3648, 10944, 15488, 19968]  # 3584 is within 1024 of 3648


def test_vision_spans_move_taps_to_the_span_start():
    taps = plan_taps(1000, 0, hints((500, EXPLICIT)), vision_spans=[(450, 100), (400, 60)], options=CHAT)
    # 500 is inside [450, 550) -> 450 -> 448, inside [400, 460) -> 400 -> 384
    assert taps[0].position == 384


def test_budget_keeps_the_first_taps_in_priority_order():
    options = TapPlanOptions(max_new_taps=2, tap_ladder_tokens=4096, tap_min_gap_tokens=1024)
    taps = plan_taps(1000, 0, hints((900, OPENER), (384, EXPLICIT), (128, EXPLICIT), (600, EXPLICIT)),
                     options=options)
    assert [(t.position, t.source.value) for t in taps] == [(128, "explicit"), (384, "explicit")]
    assert plan_taps(1000, 0, hints((128, EXPLICIT)), options=TapPlanOptions(max_new_taps=0)) == []


# ---- property tests -------------------------------------------------------------------------

KINDS = list(HintKind)


@st.composite
def planning_inputs(draw):
    n = draw(st.integers(2, 120_000))
    base = draw(st.integers(0, n - 1))
    hint_list = draw(st.lists(st.builds(TapHint, st.integers(0, n + 200), st.sampled_from(KINDS)), max_size=24))
    existing = draw(st.lists(st.integers(1, n), max_size=6))
    spans = draw(st.lists(st.tuples(st.integers(0, n), st.integers(1, 700)), max_size=4))
    ladder = 64 * draw(st.integers(1, 200))
    gap = 64 * draw(st.integers(1, ladder // 64))
    options = TapPlanOptions(max_new_taps=draw(st.integers(0, 10)), tap_ladder_tokens=ladder,
                             tap_min_gap_tokens=gap)
    return n, base, hint_list, existing, spans, options, draw(st.booleans())


def plan(args, **override):
    n, base, hint_list, existing, spans, options, from_endpoint = args
    if override:
        options = TapPlanOptions(**{**options.__dict__, **override})
    return plan_taps(n, base, hint_list, existing, spans, options, from_endpoint)


@settings(max_examples=300, deadline=None)
@given(planning_inputs())
def test_taps_are_aligned_in_range_outside_vision_and_off_the_path(args):
    n, base, _, existing, spans, options, _ = args
    taps = plan(args)
    positions = [t.position for t in taps]
    assert positions == sorted(set(positions))
    assert len(taps) <= options.max_new_taps
    for p in positions:
        assert p % 64 == 0 and base < p <= n - 1
        assert not any(b < p < b + length for b, length in spans)
        assert p not in existing


@settings(max_examples=300, deadline=None)
@given(planning_inputs())
def test_taps_respect_priority_proximity_and_placement(args):
    n, base, _, existing, _, options, from_endpoint = args
    taps = sorted(plan(args), key=lambda t: t.rank)
    assert [t.rank for t in taps] == list(range(len(taps)))
    assert [t.priority for t in taps] == sorted(t.priority for t in taps)
    for t in taps:
        earlier = [q for q in [base, *existing] + [u.position for u in taps if u.rank < t.rank]]
        if t.source is TapSource.LADDER:
            assert all(abs(t.position - q) >= options.tap_min_gap_tokens for q in earlier)
        elif t.source is not TapSource.EXPLICIT:
            assert not any(0 <= t.position - q <= 64 for q in earlier)
        exact = t.source in (TapSource.EXPLICIT, TapSource.OPENER, TapSource.STRUCTURAL, TapSource.AUTOMATIC)
        assert (t.placement is Placement.EXACT) == exact
        if t.source in (TapSource.EXPLICIT, TapSource.STRUCTURAL):
            assert t.kind is SnapshotKind.BOUNDARY
        if t.source in (TapSource.PROMPT_TAIL, TapSource.LADDER):
            assert t.kind is SnapshotKind.TAP
        if from_endpoint:
            assert t.source is not TapSource.OPENER


@settings(max_examples=300, deadline=None)
@given(planning_inputs())
def test_budget_keeps_a_priority_prefix_and_the_ladder_stays_logarithmic(args):
    n, base, _, _, _, options, _ = args
    unlimited = plan(args, max_new_taps=1000)
    limited = plan(args)
    assert [t.position for t in limited] == sorted(t.position for t in unlimited if t.rank < options.max_new_taps)
    ladder = [t for t in unlimited if t.source is TapSource.LADDER]
    bound = math.floor(math.log2(n / options.tap_ladder_tokens)) + 1 if n > options.tap_ladder_tokens else 0
    assert len(ladder) <= bound


@settings(max_examples=200, deadline=None)
@given(planning_inputs(), st.randoms(use_true_random=False))
def test_tap_planning_is_deterministic(args, rnd: random.Random):
    n, base, hint_list, existing, spans, options, from_endpoint = args
    shuffled = list(hint_list)
    rnd.shuffle(shuffled)
    again = plan_taps(n, base, shuffled, list(reversed(existing)), list(reversed(spans)), options, from_endpoint)
    assert again == plan(args) == plan(args)
