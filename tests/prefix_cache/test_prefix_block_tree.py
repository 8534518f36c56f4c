"""BlockTree (spec §13.1): exact identity, extra keys, tails, F <= n - 1, duplicate publication."""

import numpy as np
import pytest
import xxhash

from ninfer_jax.prefix_cache import (CommitOutcome, OwnerState, SnapshotKind, VisionItem, block_hashes,
                                     block_lookup_hash, encode_tokens, media_keys)
from prefix_helpers import block, make_index, prompt, run, start


def test_lookup_hash_chains_xxh3_over_previous_hash_tokens_and_extra():
    tokens = prompt(1, 2)
    h0 = xxhash.xxh3_64_intdigest((0).to_bytes(8, "little") + block(1).astype("<i4").tobytes()
                                  + (0).to_bytes(8, "little"))
    h1 = xxhash.xxh3_64_intdigest(h0.to_bytes(8, "little") + block(2).astype("<i4").tobytes()
                                  + (7).to_bytes(8, "little"))
    assert block_hashes(tokens, [0, 7]) == [h0, h1]
    assert block_lookup_hash(h0, encode_tokens(block(2)), 7) == h1
    assert block_hashes(prompt(1, tail=10)) == [h0]  # only full blocks are hashed


def test_insert_then_match_requires_exact_tokens_and_extra_keys():
    idx = make_index()
    tokens = prompt(1, 2, 3, tail=5)
    lane = start(idx, tokens)
    lane.commit_through(len(tokens))
    assert [n.depth for n in lane.path] == [0, 1, 2]
    assert idx.match(tokens).path == lane.path
    other = prompt(1, 2, 4, tail=5)
    assert idx.match(other).path == lane.path[:2]
    changed = tokens.copy()
    changed[70] += 1  # one token of block 1
    assert idx.match(changed).path == lane.path[:1]
    # the same tokens with a different extra key (media) for block 1 miss from block 1 on
    extras = [0, 5, 0, 0]
    assert idx.match(tokens, block_hashes(tokens, extras), extras).path == lane.path[:1]
    idx.check_invariants()


def test_forced_constant_lookup_hash_never_produces_a_false_hit():
    idx = make_index(hash_fn=lambda data: 42)
    a = prompt(1, 2, 3, tail=1)
    b = prompt(1, 5, 6, tail=1)
    lane_a = start(idx, a)
    lane_a.commit_through(len(a))
    lane_b = start(idx, b)
    lane_b.commit_through(len(b))
    assert all(h == 42 for h in block_hashes(a, hash_fn=idx.hash_fn))
    # block 1 of b collides with block 1 of a: both children hang off hash 42
    assert lane_b.path[0] is lane_a.path[0] and lane_b.path[1] is not lane_a.path[1]
    assert idx.match(a).path == lane_a.path
    assert idx.match(b).path == lane_b.path
    assert idx.match(prompt(1, 7, 8, tail=1)).path == lane_a.path[:1]
    idx.check_invariants()
    lane_a.release()
    lane_b.release()
    idx.check_invariants()


def test_different_media_digest_with_same_tokens_misses():
    idx = make_index()
    tokens = prompt(1, 2, 3, tail=3)
    image_a = VisionItem(b"a" * 32, 0, (1, 2, 2), begin=70, length=40)
    image_b = VisionItem(b"b" * 32, 0, (1, 2, 2), begin=70, length=40)
    keys_a, keys_b = media_keys(4, [image_a]), media_keys(4, [image_b])
    assert keys_a[0] == 0 and keys_a[1] != 0 and keys_a[1] != keys_b[1]
    assert keys_a[2] == 0  # no overlap: 0; the parent node already differs per image
    hashes_a = block_hashes(tokens, keys_a)
    lane = start(idx, tokens)
    for b in range(3):
        commit = idx.commit_block(lane.parent, tokens[64 * b:64 * b + 64], hashes_a[b], lane.pages[b], keys_a[b])
        lane.path.append(commit.node)
    assert idx.match(tokens, hashes_a, keys_a).path == lane.path
    assert idx.match(tokens, block_hashes(tokens, keys_b), keys_b).path == lane.path[:1]
    # a forced equal hash with the other digest still misses: extra keys are compared exactly
    assert idx.match(tokens, hashes_a, keys_b).path == lane.path[:1]


def test_tail_snapshot_matches_on_exact_tail_tokens_only():
    idx = make_index()
    tokens = prompt(1, 2, tail=20, tail_label=9)
    lane = run(idx, tokens, endpoint=True)
    endpoint = lane.published[-1]
    assert endpoint.kind is SnapshotKind.ENDPOINT and endpoint.frontier == 148 and endpoint.tail_len == 20
    longer = np.concatenate([tokens, block(9)[20:40]])
    assert idx.match(longer).deepest is endpoint
    edited = longer.copy()
    edited[140] += 1  # inside the tail
    assert idx.match(edited).candidates == []
    shorter_tail = np.concatenate([tokens[:140], block(5)[:30]])
    assert idx.match(shorter_tail).candidates == []
    idx.check_invariants()


def test_frontier_must_leave_one_prompt_token_to_prefill():
    idx = make_index()
    tokens = prompt(1, 2, tail=20)
    lane = run(idx, tokens, taps=(128,), endpoint=True)
    tap, endpoint = lane.published
    assert idx.match(tokens[:128]).candidates == []                # F = n is not a resume point
    assert idx.match(tokens[:129]).candidates == [tap]             # F = n - 1
    assert idx.match(tokens).candidates == [tap]                   # endpoint F = 148 = n
    assert idx.match(np.concatenate([tokens, [7]])).candidates == [tap, endpoint]
    assert idx.match(tokens[:129], vision_spans=[(100, 40)]).candidates == []  # F strictly inside a span


def test_duplicate_snapshot_publication_is_a_noop_that_refreshes_recency():
    idx = make_index()
    tokens = prompt(1, 2, 3, tail=1)
    first = run(idx, tokens, taps=(128,)).published[0]
    snapshots_before = dict(idx.tree.snapshots)
    lane = start(idx, prompt(1, 2, 4, tail=1))
    lane.commit_through(128)
    grant = idx.begin_snapshot(128)
    free_slots = idx.slots.num_free
    recency = first.last_hit
    result = idx.publish_snapshot(grant.slot, SnapshotKind.BOUNDARY, lane.path[1])
    assert not result.published and result.snapshot is first and result.freed_slot == grant.slot
    assert first.kind is SnapshotKind.BOUNDARY  # the client named the shared prefix
    assert idx.slots.num_free == free_slots + 1 and idx.tree.snapshots == snapshots_before
    assert first.last_hit > recency and idx.stats.snapshots_duplicate == 1
    idx.check_invariants()


def test_commit_block_inserts_duplicates_or_adopts_the_lane_page():
    idx = make_index()
    tokens = prompt(1, 2, tail=1)
    a = start(idx, tokens)
    c0 = idx.commit_block(idx.root, tokens[:64], a.hashes[0], a.pages[0])
    assert c0.outcome is CommitOutcome.INSERTED and not c0.page_private
    assert idx.pages.state(a.pages[0]) is OwnerState.CACHED
    b = start(idx, tokens)  # same prompt from the root (no snapshot yet): recomputes block 0
    c1 = idx.commit_block(idx.root, tokens[:64], b.hashes[0], b.pages[0])
    assert c1.outcome is CommitOutcome.DUPLICATE and c1.page_private and c1.node is c0.node
    assert c0.node.active_refs == 2 and idx.pages.state(b.pages[0]) is OwnerState.ACTIVE
    idx.check_invariants()


def test_encode_tokens_rejects_partial_token_bytes():
    with pytest.raises(ValueError, match="multiple of 4"):
        encode_tokens(b"abc")
    assert encode_tokens([1, -1]) == np.array([1, -1], "<i4").tobytes()
