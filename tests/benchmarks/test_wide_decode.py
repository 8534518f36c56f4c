"""The wide-decode benchmark's arithmetic: a decode round's roofline at a hand-computed tiny shape, and the window of
rounds in which every lane of a wave decodes."""

import dataclasses

import pytest

from ninfer_jax.benchmarks.models import model_config, pack_config, param_counts, weight_bytes
from ninfer_jax.benchmarks.wide_decode import (
    expected_experts,
    full_width_window,
    round_roofline,
    mtp_draft_bytes,
    round_weight_bytes,
    verify_bytes_floor,
)
from ninfer_jax.config import QuantizationConfig


@pytest.fixture(scope="module")
def cfg():
    """Hidden 8, vocab 100, three GDN layers and one attention layer, 4 experts of intermediate 2, 2 per token."""
    return dataclasses.replace(
        model_config("tiny-moe"), vocab_size=100, hidden_size=8, layer_types=("linear_attention",) * 3
        + ("full_attention",), num_attention_heads=2, num_key_value_heads=1, head_dim=4, linear_num_key_heads=1,
        linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=2, shared_expert_intermediate_size=2)


def test_expected_experts_follow_uniform_routing():
    assert expected_experts(4, 2, 1) == 2  # one token: its k experts
    assert expected_experts(4, 2, 2) == 3  # 4 x (1 - (1/2)^2)
    assert expected_experts(256, 8, 256) == pytest.approx(256 * (1 - (31 / 32) ** 256))


def test_the_round_roofline_counts_touched_experts_kv_and_state_at_a_hand_computed_shape(cfg):
    # attention 8 x (2x2x4 + 2x1x4) + 2x4x8 = 256; GDN 8 x (conv 16 + value 8 + 2x2) + 8x8 = 288; mixers
    # 256 + 3 x 288 = 1120; an expert and the shared expert 3 x 8 x 2 = 48; active 1120 + 4 x (48 + 2 x 48) + 800
    assert param_counts(cfg)[1] == 2496
    roof = round_roofline(cfg, lanes=2, context=10, tflops=1e-9, tbps=1e-9)  # 1000 FLOP/s, 1000 B/s
    assert roof.experts_per_layer == 3
    # bf16: mixers 1120, 4 layers x (shared 48 + 3 experts x 48), lm_head 800, 2 embedding rows of 8
    assert roof.weight_bytes == 2 * (1120 + 4 * (48 + 3 * 48) + 800 + 2 * 8) == 5408
    assert roof.kv_bytes == 2 * 10 * (1 * 4 * 2 * 2)  # lanes x context x (one KV head of 4, K and V, bf16)
    # per GDN layer: state 2 x 4 x 4 f32 = 128 B, conv 3 x 16 bf16 = 96 B; read and written for each lane
    assert roof.state_bytes == 2 * 2 * 3 * (128 + 96) == 2688
    assert roof.flops == 2 * 2496 * 2 + 1 * 4 * 4 * 2 * 10 * 2 == 10624
    assert (roof.seconds, roof.bound) == (pytest.approx(10.624), "flops")  # bytes take 8.416 s
    assert roof.tok_s == pytest.approx(2 / 10.624)
    slower_copy = round_roofline(cfg, lanes=2, context=10, tflops=1e-9, tbps=0.5e-9)
    assert (slower_copy.seconds, slower_copy.bound) == (pytest.approx(16.832), "bytes")


def test_an_fp8_round_reads_its_quantized_linears_at_one_byte_and_the_rest_in_bf16(cfg):
    # linears 1120 + 4 x 192 = 1888 at one byte, less the GDN b and a projections (3 layers x 2 x 2 heads x 8 = 96),
    # which stay bf16 with the lm_head and the embedding rows: 5408 - (1888 - 96)
    roof = round_roofline(cfg, lanes=2, context=10, tflops=1e-9, tbps=1e-9, fp8=True)
    assert roof.weight_bytes == 5408 - 1792 == 3616
    assert param_counts(cfg, fp8=True)[2] == 2 * 2496 - (2496 - 800 - 96)  # one lane's bytes: the same rule
    assert roof.flops == 10624  # the same work


def test_a_verify_rounds_bytes_floor_is_the_experts_its_extra_rows_touch(cfg):
    # one row: 2 experts a layer, 5408 - 2 x (4 x 48 + 8) = 5008 B; two rows: the roofline's 3 experts, 5408 B
    assert round_weight_bytes(cfg, 1) == 2 * (1120 + 4 * (48 + 2 * 48) + 800 + 8) == 5008
    assert round_weight_bytes(cfg, 2) == round_roofline(cfg, 2, 10, 1e-9, 1e-9).weight_bytes == 5408
    dense = model_config("27b")  # a dense round reads every weight once, whatever its rows (but their embeddings)
    assert round_weight_bytes(dense, 4) - round_weight_bytes(dense, 1) == 2 * 3 * dense.hidden_size
    # a draft: fc 2 x 8 x 8, one attention layer 256, the shared expert 48 and 2 experts, the lm_head 800
    assert mtp_draft_bytes(cfg, 1) == 2 * (128 + 256 + 48 + 2 * 48 + 800) == 2656
    assert verify_bytes_floor(cfg, 1, 1) == (5408 + 2656) / 5008  # two rows and one draft over one row


def test_an_fp8_pack_of_the_27b_holds_55_percent_of_its_bf16_bytes_and_unknown_formats_are_refused():
    cfg = model_config("27b")
    assert pack_config(cfg, "bf16") is cfg and pack_config(cfg, "fp8").quantization == QuantizationConfig()
    bf16, fp8 = weight_bytes(cfg, "bf16"), weight_bytes(cfg, "fp8")
    # embeddings, lm_head, norms and the GDN a/b projections stay bf16; the block scales add 1/16384 per byte
    assert (bf16, fp8) == (54_641_404_928, 29_948_227_328) and weight_bytes(cfg, "fp8-dynamic") == fp8
    with pytest.raises(ValueError, match="weights must be one of bf16, fp8, fp8-dynamic"):
        pack_config(cfg, "int4")


def test_the_window_runs_from_the_second_read_after_the_last_first_token_to_the_first_finish():
    # Three lanes prefilled one a step (first tokens at 0, 1, 2), each step reading the round dispatched in the one
    # before: the read right after lane 2's first token (2.01) and the next (2.5) lack lane 2; the rounds read at 3,
    # 3.5 and 4 run all three lanes, until lane 0's last token at 4.
    lane0 = [(0, 1), (1, 1), (2.01, 1), (2.5, 1), (3, 1), (3.5, 1), (4, 1)]
    lane1 = [(1, 1), (2.01, 1), (2.5, 1), (3, 1), (3.5, 1), (4, 1), (4.5, 1)]
    lane2 = [(2, 1), (3, 1), (3.5, 1), (4, 1), (4.5, 1)]
    window = full_width_window([lane0, lane1, lane2])
    assert (window.lanes, window.rounds, window.seconds) == (3, 3, 1.5)
    assert (window.tok_s, window.ms_per_round) == (6.0, 500.0)
    assert (window.start_tokens, window.end_tokens) == (8 / 3, 17 / 3)  # tokens emitted by 2.5 and by 4
    assert window.every_lane
    # lane 2 emitted just after lane 0 in each read still counts once per round; a round without lane 1 shows
    late = [(t + 0.001, n) for t, n in lane2]
    assert full_width_window([lane0, lane1, late]).every_lane
    # a host stalled between two lanes' events of a read for over half the gap between reads: still once per round
    stalled = [(t + 0.3, n) for t, n in lane2]
    assert full_width_window([lane0, lane1, stalled]).every_lane
    assert not full_width_window([lane0, lane1, [e for e in stalled if e[0] != 3.8]]).every_lane
    assert not full_width_window([lane0, [e for e in lane1 if e[0] != 3.5], lane2]).every_lane
    assert full_width_window([lane0[:4], lane1, lane2]) is None  # lane 0 ends at the read that opens the window
    assert full_width_window([lane0, lane1, []]) is None  # a lane without a token


def test_a_wave_times_only_rounds_that_run_every_lane(checkpoint_factory):
    """run_wave on the tiny model: the lane admitted first decodes while the second prefills; the window holds only
    rounds of both lanes, and the wave ends with the pools' ledger clean."""
    from ninfer_jax import Engine, SamplingParams
    from ninfer_jax.benchmarks.wide_decode import run_wave, wave_tokens
    from ninfer_jax.config import ModelConfig

    directory = checkpoint_factory("tiny-dense", "text", seed=3)
    cfg = ModelConfig.from_file(directory / "config.json")
    engine = Engine.from_pretrained(directory, kernels="reference", warmup=False, max_concurrency=2,
                                    max_model_len=256, prefill_chunk=64, no_prefix_reuse=True)
    try:
        tokens = wave_tokens(cfg, 2, 100, 3, 64)  # prompts of two passes: the second lane's first token comes 2 later
        assert tokens == 2 + 3 + 4
        sampling = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        wave = run_wave(engine, [[3] * 100, [4] * 100], sampling)
        engine.check_ledger()
    finally:
        engine.stop()
    window = wave.window()
    assert window.every_lane and window.rounds >= 3
    # the first to finish ran to its length; the other was cancelled then, unless its last rounds were already read
    assert wave.finish_reasons[0] == "length" and wave.finish_reasons[1] in ("cancelled", "length")
    assert sum(n for _, n in wave.events[0]) == tokens
