"""Persistence of the Host tier across restarts (spec §5.5) on the tiny model (fp32): what a save keeps, what a
restarted engine resumes from, and that a damaged, foreign or oversized file never breaks the start.

Every engine ends with the invariant checker, the slab ledger and a leak check (`settle`); engines start without
warmup (the model steps compile on first use) to keep the restarts cheap.
"""

import logging

import pytest

from ninfer_jax import Engine, SamplingParams
from ninfer_jax.runtime.device.cache_file import EMPTY
from ninfer_jax.runtime.options import OptionsError
from cache_support import assert_same_output, settle_host as settle, tokens

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
LONG = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True, logprobs=5)  # an endpoint 113 past the tap
NO_REUSE = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5, prefix_cache=False)
COMMON = dict(max_concurrency=2, prefill_chunk=128, max_model_len=1024, output_window=64, host_cache_mib=16)


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-dense", "text", seed=43)


def start(checkpoint, path, **options):
    return Engine.from_pretrained(checkpoint, prefix_cache_file=str(path), warmup=False, **{**COMMON, **options})


def loaded(engine) -> dict:
    return engine.stats()["prefix_cache"]["loaded"]


@pytest.fixture(scope="module")
def saved_once(checkpoint, tmp_path_factory):
    """A file saved by an engine that served one 300-token prompt and 70 output tokens; (path, prompt, its
    output, the snapshots the engine held)."""
    path = tmp_path_factory.mktemp("saved") / "prefix.cache"
    engine = start(checkpoint, path)
    assert loaded(engine)["outcome"] == "not restored"  # no file yet
    prompt = tokens(300, 1)
    out = engine.generate(prompt, LONG)
    saved_snapshots = engine.stats()["prefix_cache"]["snapshots"]
    engine.stop()
    assert path.exists() and not path.with_name(path.name + ".tmp").exists()
    return path, prompt, out, saved_snapshots


@pytest.fixture()
def saved(saved_once, tmp_path):
    """`saved_once` with the file copied for this test, which may damage or replace it."""
    path, *rest = saved_once
    copy = tmp_path / path.name
    copy.write_bytes(path.read_bytes())
    return copy, *rest


def test_a_restarted_engine_resumes_a_conversation_from_the_saved_host_tier(checkpoint, saved):
    path, prompt, first, held = saved
    engine = start(checkpoint, path)
    report = loaded(engine)
    # 5 blocks (320 tokens), the prompt-tail tap at 256 and the endpoint at 369 (prompt + 69 computed outputs)
    assert report["outcome"] == "restored" and report["blocks"] == 5 and report["snapshots"] == 2 == held
    cache = engine.stats()["prefix_cache"]
    assert cache["nodes_by_tier"] == {"device": 0, "host": 5, "both": 0}  # rebuilt Host-only
    follow = prompt + list(first.token_ids) + tokens(40, 2)
    resumed = engine.generate(follow, GREEDY)
    record = engine.cache_record(resumed.request_id)
    assert resumed.usage.cached_tokens == len(prompt) + len(first.token_ids) - 1
    assert record["source"] == "endpoint" and record["restored_host_bytes"] > 0
    assert_same_output(resumed, engine.generate(follow, NO_REUSE))
    settle(engine, warmed=False)
    engine.stop()


@pytest.mark.parametrize("damage", ["slab byte", "table byte", "truncated", "not a cache file"])
def test_a_damaged_file_loads_nothing_and_the_next_save_replaces_it(checkpoint, saved, damage, caplog):
    path, prompt, first, _ = saved
    data = bytearray(path.read_bytes())
    if damage == "slab byte":
        data[-1000] ^= 0x40
    elif damage == "table byte":
        data[40] ^= 0x01
    elif damage == "truncated":
        del data[-5000:]
    else:
        data = bytearray(b"hello, not a cache" * 10)
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ninfer_jax.cache_file"):
        engine = start(checkpoint, path)
    report = loaded(engine)
    assert report["outcome"] == "not restored" and report["blocks"] == 0
    assert {"slab byte": "checksum", "table byte": "damaged", "truncated": "damaged",
            "not a cache file": "not a prefix cache file"}[damage] in report["reason"]
    assert "prefix cache not restored" in caplog.text
    assert engine.stats()["prefix_cache"]["nodes"] == 0
    again = engine.generate(prompt, LONG)  # the engine serves, from the root
    assert again.usage.cached_tokens == 0 and again.token_ids == first.token_ids
    settle(engine, warmed=False)
    engine.stop()
    assert loaded(restarted := start(checkpoint, path))["outcome"] == "restored"  # the stop saved a good file
    restarted.stop()


def test_a_file_saved_with_no_snapshot_on_the_host_says_so_without_a_warning(checkpoint, tmp_path, caplog):
    path = tmp_path / "prefix.cache"
    start(checkpoint, path).stop()  # served nothing: the Host tier holds no snapshot
    assert path.exists()
    with caplog.at_level(logging.INFO, logger="ninfer_jax.cache_file"):
        engine = start(checkpoint, path)
    report = loaded(engine)
    assert report["outcome"] == "not restored" and report["reason"] == EMPTY
    assert f"prefix cache not restored | {EMPTY}" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    engine.stop()


@pytest.mark.parametrize("change", ["weights", "prefill_chunk", "idle_prefill_chunk"])
def test_a_file_saved_for_other_weights_or_another_prefill_is_not_used(checkpoint, checkpoint_factory, saved, change):
    path, prompt, _, _ = saved
    if change == "weights":
        other = start(checkpoint_factory("tiny-dense", "text", seed=44), path)
    elif change == "prefill_chunk":  # the saving engine's idle passes were its chunk, 128
        other = start(checkpoint, path, prefill_chunk=64, idle_prefill_chunk=128)
    else:
        other = start(checkpoint, path, idle_prefill_chunk=256)
    report = loaded(other)
    assert report["outcome"] == "not restored" and report["reason"].endswith(f"(differs in {change})")
    assert other.generate(prompt, GREEDY).usage.cached_tokens == 0
    settle(other, warmed=False)
    other.stop()


def test_a_smaller_host_tier_loads_whole_snapshots_and_only_their_paths(checkpoint, tmp_path):
    path = tmp_path / "prefix.cache"
    big = start(checkpoint, path)
    prompts = [tokens(600, 10), tokens(200, 11)]  # a long conversation and a short one
    for p in prompts:
        big.generate(p, GREEDY)
    need = big.stats()["prefix_cache"]["host_slabs"]
    big.stop()
    image_slabs = big.cache_manager.index.slabs.image_slabs
    # room for one image and the short prompt's 3 blocks, not for the long one's 9 blocks and two images
    slab_mib = big.cache_manager.index.slabs.slab_bytes / 2**20
    small = start(checkpoint, path, host_cache_mib=max(1, round((image_slabs + 4) * slab_mib)))
    report = loaded(small)
    assert report["outcome"] == "partly restored", (report, need)
    assert 0 < report["snapshots"] < report["saved_snapshots"] and report["blocks"] < report["saved_blocks"]
    tree = small.cache_manager.index.tree
    for s in tree.snapshots.values():  # every loaded snapshot came with its whole anchor path
        assert all(n.host_state.name == "RESIDENT" for n in s.anchor.path())
    settle(small, warmed=False)
    small.stop()


def test_a_failed_engine_saves_nothing(checkpoint, saved):
    path, prompt, _, _ = saved
    before = path.read_bytes()
    engine = start(checkpoint, path)
    engine.inject_host_fault("write")
    failed = engine.generate(tokens(200, 5), GREEDY)
    assert failed.finish_reason == "error"
    engine.stop()
    assert path.read_bytes() == before


@pytest.mark.parametrize("when", ["before", "during"])
def test_an_abandoned_save_keeps_the_previous_file(checkpoint, saved, when, monkeypatch):
    """A second Ctrl+C abandons the save (`Engine.abandon_save`, §5.5): one not begun never begins, and one under
    way stops before its next entry and deletes its temporary file. Either way the previous file stays."""
    path, *_ = saved
    before = path.read_bytes()
    engine = start(checkpoint, path)
    engine.generate(tokens(200, 6), GREEDY)  # something new to save
    if when == "before":
        engine.abandon_save()
    else:
        buffer = engine.cache_manager.host.buffer
        views = buffer.views

        def abandon_after_the_first_entry(slabs):
            engine.abandon_save()
            return views(slabs)

        monkeypatch.setattr(buffer, "views", abandon_after_the_first_entry)
    engine.stop()
    assert path.read_bytes() == before and not path.with_name(path.name + ".tmp").exists()


def test_prefix_cache_file_needs_the_weights_identity(checkpoint, tmp_path):
    from ninfer_jax.model import load_checkpoint
    from ninfer_jax.runtime.options import EngineOptions

    config, params = load_checkpoint(checkpoint, dtype="float32")
    options = EngineOptions(dtype="float32", prefix_cache_file=str(tmp_path / "x.cache"), **COMMON)
    with pytest.raises(OptionsError, match="weights' identity"):
        Engine(config, params, options, warmup=False)
