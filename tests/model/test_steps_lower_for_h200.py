"""The model's prefill, decode and mixed steps at the released models' real widths (four layers of each: three GDN
and one attention) lowered for the H200 without a GPU, with the engine's Pallas kernel switches and FP8 x FP8
prefill rows taken as on a Hopper GPU. A kernel that cannot take a real shape fails here rather than on the first
GPU that runs it (the 27B's FP8 in-projection, 16480 bf16 columns, once failed to lower so)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from kernel_support import lower_for_h200
from ninfer_jax.benchmarks.models import model_config, pack_config
from ninfer_jax.model import qwen3_5
from ninfer_jax.model.random_init import random_params
from ninfer_jax.model.state import init_device_state
from ninfer_jax.runtime import startup
from ninfer_jax.runtime.options import EngineOptions
from pallas_kernels import fp8_gemm

PAGES, SLOTS, ROWS, LANES = 8, 2, 256, 4
S, I32 = jax.ShapeDtypeStruct, jnp.int32


def _lower(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _setup(name: str, weights: str, monkeypatch, pages: int = PAGES):
    """Four layers of `name` (three GDN, one attention) as shapes, the engine's kernel switches and a state."""
    lower_for_h200()
    monkeypatch.setattr(fp8_gemm, "available", lambda: True)  # the wgmma GEMM's paths, as on a Hopper GPU
    full = model_config(name)
    cfg = dataclasses.replace(pack_config(full, weights), layer_types=full.layer_types[:4])
    fp8 = weights != "bf16"
    params = jax.eval_shape(lambda: random_params(cfg, fp8=fp8))
    state = jax.eval_shape(lambda: init_device_state(cfg, pages, SLOTS, jnp.bfloat16, jnp.bfloat16))
    kc = startup.kernel_config(EngineOptions(kernels="pallas", prefill_attention="pallas",
                                             fp8_activations="dynamic" if fp8 else "weight-only"))
    return cfg, params, state, kc


def _lower_prefill(cfg, kc, params, state, rows: int, pages: int = PAGES) -> str:
    return _lower(lambda p, st, tok, nv, base, pt, slot, tp, ts: qwen3_5.prefill(p, cfg, kc, tok, nv, base, pt, slot,
                                                                                st, tp, ts),
                  params, state, S((rows,), I32), S((), I32), S((), I32), S((pages,), I32), S((), I32),
                  S((2,), I32), S((2,), I32))


def _lower_decode(cfg, kc, params, state, lanes: int) -> str:
    return _lower(lambda p, st, tok, pos, pt, slots, act: qwen3_5.decode(p, cfg, kc, tok, pos, pt, slots, act, st),
                  params, state, S((lanes,), I32), S((lanes,), I32), S((lanes, PAGES), I32), S((lanes,), I32),
                  S((lanes,), jnp.bool_))


def _lower_mixed(cfg, kc, params, state, lanes: int) -> str:
    """A prefill chunk and a decode round in one pass: the projections over both rows (the GDN in-projection
    whole)."""
    p_ctx = dict(slot=S((), I32), base=S((), I32), n_valid=S((), I32), page_table=S((PAGES,), I32),
                 tap_positions=S((2,), I32), tap_slots=S((2,), I32), rope_positions=S((3, ROWS), I32))
    d_ctx = dict(positions=S((lanes,), I32), page_tables=S((lanes, PAGES), I32), slots=S((lanes,), I32),
                 active=S((lanes,), jnp.bool_), rope_shift=S((lanes,), I32))
    return _lower(lambda p, st, emb, pc, tok, dc: qwen3_5.mixed(p, cfg, kc, emb, pc, tok, dc, st),
                  params, state, S((ROWS, cfg.hidden_size), jnp.bfloat16), p_ctx, S((lanes,), I32), d_ctx)


@pytest.mark.parametrize("weights", ["fp8-dynamic", "bf16"])
@pytest.mark.parametrize("name", ["27b", "35b-a3b"])
def test_steps_lower_for_h200_at_real_widths(name, weights, monkeypatch):
    cfg, params, state, kc = _setup(name, weights, monkeypatch)
    fp8 = weights != "bf16"
    prefill = _lower_prefill(cfg, kc, params, state, ROWS)
    decode = _lower_decode(cfg, kc, params, state, LANES)
    # a prefill chunk and a decode round in one pass: the projections over both rows (the GDN in-projection whole)
    mixed = _lower_mixed(cfg, kc, params, state, LANES)
    # the GEMM for FP8 prefill rows (and the grouped experts' two products a layer on the 35B-A3B)
    assert ("mosaic_gpu" in prefill) == fp8 and ("mosaic_gpu" in mixed) == fp8
    assert "gdn_chunk" in prefill and "gdn_decode_layer" in decode and "gdn_chunk" in mixed
    # a decode round's attention merges its splits and gates in one kernel; a mixed step's rows keep XLA's merge
    assert "paged_decode_combine" in decode and "paged_decode_combine" not in mixed
    # the norms before FP8 x FP8 products write their FP8 rows themselves, in decode rounds and prefill chunks
    assert all(("add_rms_norm_fp8" in step) == fp8 for step in (prefill, decode, mixed))
    if cfg.num_experts:  # one lane's MoE layers route inside the experts' first kernel: no router kernel
        kernels = re.findall(r'name = "([^"]*)"', _lower_decode(cfg, kc, params, state, 1))
        assert "moe_gemv_route_gate_up" in kernels and "moe_route" not in kernels
        assert "add_rms_norm_router" in kernels  # the logits written by the norm before the layer
        four = re.findall(r'name = "([^"]*)"', decode)  # four lanes: the router kernel, the norm without logits
        assert "moe_route" in four and "add_rms_norm_router" not in four


@pytest.mark.parametrize("tokens", [4096, 256], ids=["grouped-gemm", "tiles"])
def test_fp8_moe_norms_hand_their_rows_to_the_experts(tokens, monkeypatch):
    """A 35B-A3B FP8 prefill chunk of 4096 tokens (32768 routed rows, 128 a expert: the grouped GEMM's) or 256 (8 a
    expert: the FP8 x FP8 tiles', as a 256-lane round's): every norm writes its FP8 rows, the GDN in-projections'
    and the MoE layers' with their bf16 rows too (the [b | a] side; the router), the attention's without."""
    from pallas_kernels import rms_norm

    cfg, params, state, kc = _setup("35b-a3b", "fp8-dynamic", monkeypatch, pages=tokens // 64 + 2)
    kernel, calls = rms_norm.add_rms_norm_fp8, []
    monkeypatch.setattr(rms_norm, "add_rms_norm_fp8", lambda *a, with_rows, **kw: calls.append(with_rows)
                        or kernel(*a, with_rows=with_rows, **kw))
    text = _lower_prefill(cfg, kc, params, state, tokens, tokens // 64 + 2)
    assert "mosaic_gpu" in text and sorted(calls) == [False] + [True] * 7


@pytest.mark.parametrize("name, fused", [("35b-a3b", True), ("27b", False)])
def test_a_one_lane_gdn_out_projection_normalizes_its_input_where_xla_doubles_its_row(name, fused, monkeypatch):
    """fuse_gdn_out: each GDN layer of a one-lane 35B-A3B round hands the delta rule's output to `gdn_out_proj`, which
    lowers at the real width; the 27B's out-projection, one cuBLAS call for one row, keeps XLA's norm and matmul, as
    do four lanes and a mixed step's one decode lane (its out-projection takes the chunk's rows too)."""
    cfg, params, state, kc = _setup(name, "bf16", monkeypatch)
    assert ("gdn_out_proj" in re.findall(r'name = "([^"]*)"', _lower_decode(cfg, kc, params, state, 1))) == fused
    assert "gdn_out_proj" not in _lower_decode(cfg, kc, params, state, LANES)
    assert "gdn_out_proj" not in _lower_mixed(cfg, kc, params, state, 1)
