"""Images through the engine and the hybrid prefix cache (spec §5.1 media keys, §6.1 / §7.1 no frontier inside a
vision span, §13.3 Vision): the engine's tokens equal a cacheless forward with the tower's outputs at the
placeholders, and every resume (Device, Host-only, the cache file) of a prompt with images equals no reuse."""

import io

import numpy as np
import pytest
from PIL import Image

from cache_support import settle_host, tokens
from ninfer_jax import Engine, SamplingParams
from ninfer_jax.frontend.mrope import mrope_positions
from ninfer_jax.frontend.prepared_prompt import prepare_tokens
from ninfer_jax.model import forward
from ninfer_jax.model.tiny import write_random_checkpoint
from ninfer_jax.model.vision import vision_forward
from oracle import oracle_config

PAD = 1000  # the image placeholder, inside the oracle's vocabulary
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Images of 64 to 96 tokens (the processor's minimum area is 256 patches); passes of 64 tokens cut them
COMMON = dict(max_concurrency=2, prefill_chunk=64, max_model_len=1024, output_window=64, max_image_tokens=96)
CACHE = {**COMMON, "kv_capacity": 40 * 64, "device_snapshot_slots": 6, "host_cache_mib": 16}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    raw = {**oracle_config("tiny-dense", "vlm"), "image_token_id": PAD}
    return write_random_checkpoint(tmp_path_factory.mktemp("vlm"), raw, seed=5)


@pytest.fixture(scope="module")
def root(checkpoint):
    # Mixed steps on (a CPU's default is off), so an image prompt's passes can ride in another lane's rounds
    engine = Engine.from_pretrained(checkpoint, no_prefix_reuse=True, warmup=False, mixed_prefill_tokens=64, **COMMON)
    yield engine
    engine.stop()


def png(seed: int, height: int, width: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def prompt(engine, *parts):
    """Token lists and images (bytes) in order -> the PreparedPrompt, each image expanded at its place."""
    ids = [t for p in parts for t in (p if isinstance(p, list) else [PAD])]
    return prepare_tokens(ids, images=[p for p in parts if isinstance(p, bytes)], vision=engine.vision)


def test_images_in_the_engine_give_the_cacheless_forwards_tokens(root):
    """Text, an image, text, a larger image, text: prefill passes cut both images and ride in another lane's decode
    rounds (mixed steps), decode rotates at the prompt's MRoPE delta, and each greedy token is the argmax of a
    cacheless forward of the whole sequence there."""
    p = prompt(root, tokens(20, 1), png(1, 256, 256), tokens(9, 2), png(2, 300, 420), tokens(5, 3))
    images = p.media.images
    assert [im.length for im in images] == [64, 88] and p.media.rope_delta < 0
    mixed = root.stats()["scheduler"].get("mixed_steps", 0)
    out = root.generate_many([tokens(30, 4), p], [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                                  SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])[1]
    assert root.stats()["scheduler"]["mixed_steps"] - mixed >= 2
    vparams, vcfg = root.runner.vision
    embeds = vision_forward(vparams, vcfg, np.concatenate([im.pixel_values for im in images]),
                            [im.grid for im in images])
    seq = np.array(list(p.token_ids) + list(out.token_ids))
    spans = np.zeros(len(seq), bool)
    for im in images:
        spans[im.begin:im.end] = True
    positions, _ = mrope_positions(len(seq), [(im.begin, im.grid) for im in images], vcfg.spatial_merge_size)
    logits = np.asarray(forward(root.runner.params, root.runner.cfg, seq, image_embeds=embeds, image_spans=spans,
                                rope_positions=positions))
    n = p.num_tokens
    assert logits[n - 1:-1].argmax(-1).tolist() == list(out.token_ids)
    assert root.stats()["vision"]["images_encoded"] == 2


def test_resumes_through_an_image_equal_no_reuse_and_another_image_misses_from_its_first_block(
        checkpoint, root, tmp_path):
    file = tmp_path / "vision.cache"
    cached = Engine.from_pretrained(checkpoint, prefix_cache_file=str(file), **CACHE)
    a, b = png(10, 256, 256), png(11, 256, 256)  # the same size: identical placeholder tokens

    def run(engine, p):
        out = engine.generate(p, GREEDY)
        assert out.token_ids == root.generate(p, GREEDY).token_ids
        return out, engine.cache_record(out.request_id)

    try:
        first = prompt(cached, tokens(100, 20), a, tokens(80, 21))
        begin, end = first.vision_spans[0][0], sum(first.vision_spans[0])
        out, _ = run(cached, first)
        encoded = cached.stats()["vision"]["images_encoded"]
        again = [tokens(100, 20), a, tokens(80, 21) + list(out.token_ids) + tokens(70, 22)]
        _, record = run(cached, prompt(cached, *again))
        assert record["cached_tokens"] >= end  # through the image and beyond, which is not encoded again
        assert cached.stats()["vision"]["images_encoded"] == encoded
        other = prompt(cached, tokens(100, 20), b, *again[2:])
        _, record = run(cached, other)
        assert record["cached_tokens"] <= begin // 64 * 64  # the image's media key differs from its first block
        assert cached.stats()["vision"]["images_encoded"] == encoded + 1
        _, record = run(cached, prompt(cached, tokens(100, 20), a, tokens(80, 23)))
        assert not begin < record["cached_tokens"] < end  # never resumed inside the span
        settle_host(cached, warmed=True)
        assert cached.demote_device_cache()["pages"] > 0
        _, record = run(cached, prompt(cached, *again))
        assert record["cached_tokens"] >= end and record["restored_host_bytes"] > 0  # the Host tier alone
        settle_host(cached)
    finally:
        cached.stop()
    restarted = Engine.from_pretrained(checkpoint, prefix_cache_file=str(file), **{**CACHE, "warmup": False})
    try:
        assert restarted.cache_load.outcome == "restored" and restarted.cache_load.blocks > 0
        _, record = run(restarted, prompt(restarted, *again))
        assert record["cached_tokens"] >= end  # from the file
        settle_host(restarted, warmed=False)
    finally:
        restarted.stop()


def test_an_endpoint_whose_tail_holds_an_image_resumes_a_prompt_ending_in_that_block(checkpoint, root):
    # The image spans 200..264, so no tap lies at 256; turn 1's endpoint tail (256..281) holds the image's last
    # tokens and its media key, which a next turn still inside that block must match.
    engine = Engine.from_pretrained(checkpoint, **{**CACHE, "warmup": False})
    try:
        image = png(12, 256, 256)
        turn1 = prompt(engine, tokens(200, 30), image, tokens(10, 31))
        assert turn1.vision_spans == ((200, 64),)
        out = engine.generate(turn1, GREEDY)
        turn2 = prompt(engine, tokens(200, 30), image, tokens(10, 31) + list(out.token_ids) + tokens(20, 32))
        assert turn2.num_tokens < 320  # its last block is the endpoint's
        resumed = engine.generate(turn2, GREEDY)
        assert resumed.usage.cached_tokens == turn1.num_tokens + len(out.token_ids) - 1
        assert resumed.token_ids == root.generate(turn2, GREEDY).token_ids
        settle_host(engine, warmed=False)
    finally:
        engine.stop()


def test_a_preempted_request_with_an_image_recomputes_what_the_cache_lost_and_ends_as_alone(checkpoint, root):
    """Two lanes in 6 pages: the junior, whose prompt holds an image, is preempted, and the senior's growth evicts
    what it computed; it prefills its prompt (the image again) and output so far, its positions past the prompt from
    `PromptMedia.continued` (pinned against mrope_positions in test_vision_prompt.py), and both end with the tokens
    they have alone."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (250, 120)]
    engine = Engine.from_pretrained(checkpoint, **{**COMMON, "kv_capacity": 6 * 64, "host_cache_mib": 0,
                                                   "warmup": False})
    try:
        prompts = [tokens(70, 40), prompt(engine, tokens(20, 41), png(13, 256, 256), tokens(5, 42))]
        outs = engine.generate_many(prompts, params)
        assert [o.token_ids for o in outs] == [root.generate(p, sp).token_ids for p, sp in zip(prompts, params)]
        assert engine.stats()["requests"]["requests_preempted"] == 1
        assert engine.cache_record(outs[1].request_id)["source"] == "root"
        engine.check_ledger()
    finally:
        engine.stop()
