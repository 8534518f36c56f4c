"""What tensor and expert parallel cost each device, read without a multi-GPU machine: the weight and pool bytes one
device holds at each mesh size (from `ParallelLayout`'s specs over the params' and pools' shapes; nothing is made),
and the collectives XLA puts into the sharded decode round (the runner's own jitted step, compiled for N host
devices of a CPU). Collectives come from two compiles, of one and two layer periods (`full_attention_interval`
layers each): their difference is a period's, the rest the embedding's and the lm_head's, so the whole model's count
is exact without compiling every layer."""

from __future__ import annotations

import dataclasses
import re
import time

import jax
import jax.numpy as jnp

from ninfer_jax.config import ModelConfig
from ninfer_jax.benchmarks.profiling import HLO_DTYPE_BYTES, hlo_array_bytes
from ninfer_jax.model import ops
from ninfer_jax.model.random_init import random_params
from ninfer_jax.model.state import PAGE, init_device_state
from ninfer_jax.runtime.device.steps import DECODE_COLUMNS, jit_decode_step
from ninfer_jax.runtime.device.sharding import ParallelLayout, device_bytes

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# `%name = bf16[8,2048]{1,0} all-reduce(` or a tuple of shapes; the async forms end in -start
_OP = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b(" + "|".join(HLO_DTYPE_BYTES) + r")\[([\d,]*)\]")


def hlo_collectives(text: str) -> dict[str, dict[str, int]]:
    """Per collective kind in an HLO module's text: how many ops and the bytes of their results."""
    out = {}
    for line in text.splitlines():
        m = _OP.search(line)
        if m is None:
            continue
        nbytes = sum(hlo_array_bytes(t, dims) for t, dims in _SHAPE.findall(m.group(1)))
        entry = out.setdefault(m.group(2), {"ops": 0, "bytes": 0})
        entry["ops"] += 1
        entry["bytes"] += nbytes
    return out


def _periods(cfg: ModelConfig, n: int) -> ModelConfig:
    """cfg cut to its first n layer periods (one period: full_attention_interval layers, GDN then attention)."""
    period = len(cfg.layer_types) // len(cfg.attn_layers)
    return dataclasses.replace(cfg, layer_types=cfg.layer_types[:n * period])


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def decode_collectives(cfg: ModelConfig, layout: ParallelLayout, rows: int, max_pages: int) -> dict:
    """The collectives of one decode round of `rows` rows on `layout`, for cfg's whole layer stack; compile seconds."""
    start, counts = time.perf_counter(), []
    step = jit_decode_step()
    kc = dataclasses.replace(ops.REFERENCE, spmd=layout.spmd if layout.size > 1 else None)  # as the runner's
    for n in (1, 2):
        part = _periods(cfg, n)
        params = jax.eval_shape(lambda c=part: random_params(c))
        params = params.replace(mtp=None)
        heads = layout.kv_heads(params, part)
        state = jax.eval_shape(lambda c=part: init_device_state(c, 4 * rows, rows + 2, jnp.bfloat16, jnp.bfloat16,
                                                                kv_heads=heads))
        # the round's host arrays, uncommitted as the runner passes them
        packed = jax.ShapeDtypeStruct((rows, DECODE_COLUMNS + max_pages), jnp.int32)
        prev = jax.ShapeDtypeStruct((rows,), jnp.int32)
        specs = layout.shardings(layout.param_specs(params, part))
        compiled = step.lower(_abstract(layout.placed_shapes(params, part), specs), part, kc, False,
                              _abstract(state, layout.shardings(layout.state_specs(state, part))), packed,
                              prev).compile()
        counts.append(hlo_collectives(compiled.as_text()))
    periods = len(cfg.attn_layers)
    total = {}
    for kind in COLLECTIVES:
        one, two = (c.get(kind, {"ops": 0, "bytes": 0}) for c in counts)
        per = {k: two[k] - one[k] for k in ("ops", "bytes")}
        fixed = {k: one[k] - per[k] for k in ("ops", "bytes")}
        if one["ops"] or two["ops"]:
            total[kind] = {"per_period_ops": per["ops"], "per_period_bytes": per["bytes"], "fixed_ops": fixed["ops"],
                           "ops": fixed["ops"] + periods * per["ops"],
                           "bytes": fixed["bytes"] + periods * per["bytes"]}
    return {"collectives": total, "compile_s": time.perf_counter() - start}


def memory(cfg: ModelConfig, layout: ParallelLayout, weights: str = "bf16") -> dict:
    """Bytes one device holds on `layout`: the weights (the MTP layer included), one KV page of every attention
    layer and one state slot of every GDN layer."""
    params = jax.eval_shape(lambda: random_params(cfg, fp8=weights == "fp8"))
    heads = layout.kv_heads(params, cfg)
    state = jax.eval_shape(lambda: init_device_state(cfg, 1, 1, jnp.bfloat16, jnp.bfloat16, mtp=True, kv_heads=heads))
    specs = layout.state_specs(state, cfg)
    size = layout.size
    kv = device_bytes((state.k_pages, state.v_pages), (specs.k_pages, specs.v_pages), size)
    slot = device_bytes((state.ssm, state.conv), (specs.ssm, specs.conv), size)
    return {"weights": layout.device_bytes(params, cfg), "page": kv, "slot": slot, "page_tokens": PAGE}


def report(models: dict[str, ModelConfig], sizes: list[int], rows: list[int], max_pages: int = 512) -> list[dict]:
    """One row per (model, mesh size, expert parallel, round rows): memory per device (the weights bf16 and as
    Qwen's block-FP8 packs hold them) and the round's collectives.
    Needs as many jax devices as the largest size (XLA_FLAGS=--xla_force_host_platform_device_count=8 on a CPU)."""
    out = []
    for name, cfg in models.items():
        for size in sizes:
            for ep in ([False, True] if cfg.is_moe and size > 1 else [False]):
                layout = ParallelLayout.over(size, expert_parallel=ep)
                mem = {**memory(cfg, layout), "weights_fp8": memory(cfg, layout, "fp8")["weights"]}
                for r in rows:
                    out.append({"model": name, "tp": size, "ep": ep, "rows": r, **mem,
                                **decode_collectives(cfg, layout, r, max_pages)})
                    print(_line(out[-1]), flush=True)
    return out


def _line(row: dict) -> str:
    coll = ", ".join(f"{k} {v['ops']} ({v['bytes'] / 2**20:.2f} MiB)" for k, v in row["collectives"].items())
    return (f"{row['model']} TP {row['tp']}{' EP' if row['ep'] else ''} {row['rows']} rows: weights "
            f"{row['weights'] / 2**30:.1f} GiB a device ({row['weights_fp8'] / 2**30:.1f} FP8), a page "
            f"{row['page'] / 2**10:.0f} KiB, a slot "
            f"{row['slot'] / 2**20:.1f} MiB; collectives per round: {coll or 'none'} "
            f"(compiled in {row['compile_s']:.1f} s)")

