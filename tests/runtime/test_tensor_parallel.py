"""Tensor and expert parallelism (runtime/device/sharding.py) on CPU with 8 forced host devices: every layout gives
the one-device engine's greedy tokens on the tiny dense and MoE checkpoints, including resumes from the Device cache,
the Host tier and a prefix cache file saved by another layout; the option rules refuse what cannot run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer_jax.config import ModelConfig
from ninfer_jax.runtime import startup
from ninfer_jax.runtime.options import EngineOptions, OptionsError
from ninfer_jax.model.tiny import write_random_checkpoint
from oracle import oracle_config

ROOT = Path(__file__).resolve().parents[2]
# The reference first. TP 2 splits every mixer; TP 4 splits the attention's 4 query heads over the 2 KV heads, each
# device holding a copy of the one it reads (its pages too), and keeps the GDN mixers whole (2 key heads); its file
# loads at TP 2, whose pools hold the KV heads themselves; at TP 8 the tiny dense model's mixers stay replicated (8
# does not divide 4 query heads) while its MLP columns and vocabulary split. The MoE splits its experts' columns at TP
# 2 and the experts with expert parallel at TP 4. The MoE FP8 pack splits its block-FP8 experts and shared expert (an
# MLP, as the dense one's) at TP 2 (intermediate sizes of 256: one 128-block per device and half), and its mixers
# (heads of 128: each device's columns of the fused projections whole 128-blocks; the GDN in_proj a ConcatWeight of an
# FP8 [qkv | z] and a plain [b | a]); with a shared expert of 128 and heads of 64 (a device's k columns would cut a
# block), expert parallel keeps the shared expert whole on every device and counts it on one, and the mixers whole.
# Speculative verify rounds commit the GDN state per device too, and MTP rows run the MTP layer's attention per device
# on its copied KV head (the reference speculates as well).
LAYOUTS = {"tiny-dense": "1,4,2,8", "tiny-moe": "1,2,4:ep", "tiny-moe-fp8": "1,2,2:ep",
           "tiny-moe-fp8-narrow-shared": "1,2:ep", "tiny-dense-ngram": "1:ngram,2:ngram",
           "tiny-dense-mtp": "1:mtp,4:mtp"}
# Greedy tokens of a tiny random model barely read the attention (its residual branches are scaled down): a resume
# from wrong KV bytes can keep them, never the chosen tokens' logprobs, equal to the reference's to this tolerance.
LOGPROB_TOLERANCE = 1e-4
SPECULATIVE = {"tiny-dense-ngram": 8, "tiny-dense-mtp": 9}  # each a checkpoint (and cache file) of its own: its seed
FP8_PACKS = {"tiny-moe-fp8": ("tiny-moe", {"moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
                                           "head_dim": 128, "linear_key_head_dim": 128, "linear_value_head_dim": 128}),
             "tiny-moe-fp8-narrow-shared": ("tiny-moe", {"moe_intermediate_size": 256,
                                                         "shared_expert_intermediate_size": 128})}


def _checkpoint(checkpoint_factory, tmp_path_factory, name: str) -> Path:
    # one GDN and one attention layer reach every path that more do
    shape = {"num_hidden_layers": 2, "full_attention_interval": 2}
    if name in SPECULATIVE:
        return checkpoint_factory("tiny-dense", "text", seed=SPECULATIVE[name], **shape)
    if name not in FP8_PACKS:
        return checkpoint_factory(name, "text", seed=7, **shape)
    preset, sizes = FP8_PACKS[name]
    return write_random_checkpoint(tmp_path_factory.mktemp(name), oracle_config(preset, "text", **shape, **sizes),
                                   seed=7, fp8=True)


@pytest.fixture(scope="module")
def served(checkpoint_factory, tmp_path_factory):
    """Each layout's JSON record (`tensor_parallel_run.py`), by checkpoint, in layout order, then its dummy_init
    record. Two processes at once (each is mostly one thread compiling), a preset's FP8 pack after it, with the
    suite's unoptimised compiles (conftest), which cut their time by a third."""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    runs, names = [], {}
    for preset in ("tiny-dense", "tiny-moe"):
        groups = []
        for name in [preset, *(n for n, (base, _) in FP8_PACKS.items() if base == preset),
                     *(SPECULATIVE if preset == "tiny-dense" else [])]:
            checkpoint = _checkpoint(checkpoint_factory, tmp_path_factory, name)
            names[checkpoint.name] = name
            groups += [str(checkpoint), LAYOUTS[name]]
        runs.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("tensor_parallel_run.py")),
             str(tmp_path_factory.mktemp("tp")), *groups],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    records: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for run in runs:
        out, err = run.communicate(timeout=900)
        assert run.returncode == 0, err[-3000:]
        for line in out.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                records[names[record["checkpoint"]]].append(record)
    return records


def test_random_weights_made_on_the_mesh_equal_the_placed_one_device_weights(served):
    # load_format "dummy" on a mesh makes each device's shards in place (a 397B-A17B never lands on one device)
    for preset, records in served.items():
        made = records[-1]["dummy_init"]
        assert made["layout"] == LAYOUTS[preset].split(",")[-1]
        assert made["leaves"] > 20 and made["equal"] and made["same_shardings"], made


@pytest.mark.parametrize("preset", sorted(LAYOUTS))
def test_every_layout_gives_the_one_device_tokens_through_device_host_and_file_resumes(served, preset):
    reference, *layouts = served[preset][:-1]  # the last record is dummy_init's
    assert [r["layout"] for r in served[preset][:-1]] == LAYOUTS[preset].split(",")
    assert reference["parallel"] == {"tensor_parallel_size": 1, "expert_parallel": False, "devices": ["cpu:0"]}
    for k, record in enumerate(layouts, 1):
        tp, _, ep = record["layout"].partition(":")
        assert record["parallel"] == {"tensor_parallel_size": int(tp), "expert_parallel": ep == "ep",
                                      "devices": [f"cpu:{i}" for i in range(int(tp))]}
        # the file the layout before saved, resumed against the reference's cold computation
        assert record["loaded"] == "restored"
        assert record["file"]["cached"] >= 128 and record["file"]["host_bytes"] > 0
        ours, theirs = record["sets"][str(k)], reference["sets"][str(k)]
        assert ours["device"]["cached"] >= 128 and ours["device"]["host_bytes"] == 0
        assert ours["host"]["cached"] >= 128 and ours["host"]["host_bytes"] > 0
        assert ours["first"] == theirs["first"]  # two lanes prefilled and decoded together
        for resumed, cold in ((record["file"], reference["file"]), (ours["device"], theirs["device"]),
                              (ours["host"], theirs["host"])):
            assert resumed["tokens"] == cold["tokens"] and len(resumed["logprobs"]) == len(cold["tokens"])
            assert resumed["logprobs"] == pytest.approx(cold["logprobs"], abs=LOGPROB_TOLERANCE)
        if "repeats" in record:  # verify rounds ran, on every device's heads
            assert record["drafted"] > 0 and record["repeats"]["tokens"] == reference["repeats"]["tokens"]


def test_the_mesh_must_fit_the_devices_and_the_kernels():
    def refused(**options):
        with pytest.raises(OptionsError) as error:
            backend, devices = options.pop("backend", "cpu"), options.pop("devices", 8)
            EngineOptions(**options).resolve(4096, backend, devices=devices)
        return str(error.value)

    assert refused(tensor_parallel_size=6) == "tensor_parallel_size must be a power of two, got 6"
    assert refused(tensor_parallel_size=8, devices=4) == \
        "tensor_parallel_size 8 exceeds the 4 device(s) this process sees"
    assert "needs tensor_parallel_size > 1" in refused(enable_expert_parallel=True)
    # on a GPU kernels auto means the Pallas kernels, not yet checked per device on several GPUs
    assert "Pallas kernels per device are not checked" in refused(tensor_parallel_size=2, backend="gpu")
    resolved = EngineOptions(tensor_parallel_size=2, kernels="reference").resolve(4096, "gpu", devices=2)
    assert resolved.kernels == "reference" and resolved.tensor_parallel_size == 2
    dense = ModelConfig.from_dict(oracle_config("tiny-dense"))
    with pytest.raises(OptionsError, match="enable_expert_parallel needs a model with routed experts"):
        startup.resolve_options(EngineOptions(tensor_parallel_size=2, enable_expert_parallel=True), dense)


def test_the_conv_pool_keeps_the_canonical_order_where_the_gdn_mixer_runs_whole():
    # The Host tier keeps the canonical channel order; the transfers reorder only a pool the per-device GDN mixers
    # read in their order. A block-FP8 in_proj whose device pieces would cut 128-blocks (heads of 32) keeps the mixer
    # whole, reading the canonical order.
    import types

    import jax

    from ninfer_jax.model.random_init import random_params
    from ninfer_jax.model.spmd import Spmd, conv_order

    cfg = ModelConfig.from_dict(oracle_config("tiny-dense"))
    mesh = Spmd(types.SimpleNamespace(size=2))  # only its size is read
    plain = jax.eval_shape(lambda: random_params(cfg))
    order = conv_order(mesh, plain, cfg)
    assert sorted(order.tolist()) == list(range(cfg.conv_dim)) and order.tolist() != list(range(cfg.conv_dim))
    assert conv_order(mesh, jax.eval_shape(lambda: random_params(cfg, fp8=True)), cfg) is None
    assert conv_order(None, plain, cfg) is None


@pytest.mark.parametrize("model,size", [("tiny-dense", 4), ("397b-a17b", 8)])
def test_attention_over_more_devices_than_kv_heads_holds_a_device_share(model, size):
    # Each device holds its query heads' share of the q+gate columns and o_proj rows and a copy of the one KV head
    # they read (its k and v columns and its pages), not the whole attention (4 query / 2 KV heads at TP 4; the
    # 397B-A17B's 32 / 2 at TP 8); the GDN mixers of both stay whole (2 and 16 key heads).
    import dataclasses
    import types

    import jax
    import jax.numpy as jnp

    from ninfer_jax.benchmarks.models import model_config
    from ninfer_jax.model.params import AttnParams
    from ninfer_jax.model.random_init import random_params
    from ninfer_jax.model.state import init_device_state
    from ninfer_jax.runtime.device.sharding import ParallelLayout, device_bytes

    cfg = model_config(model)
    period = cfg.layer_types.index("full_attention") + 1
    cfg = dataclasses.replace(cfg, layer_types=cfg.layer_types[:period])  # one period: GDN layers, then attention
    layout = ParallelLayout(types.SimpleNamespace(size=size))  # only its size is read
    params = jax.eval_shape(lambda: random_params(cfg))
    i = next(i for i, p in enumerate(params.layers) if isinstance(p.mixer, AttnParams))
    held = device_bytes(layout.placed_shapes(params, cfg).layers[i].mixer,
                        layout.param_specs(params, cfg).layers[i].mixer, size)
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    item = jnp.dtype(params.embed.dtype).itemsize
    query = (h * 2 * hq * d + hq * d * h) * item  # q+gate columns and o_proj rows
    whole = query + h * 2 * hkv * d * item + 2 * d * item  # with the k and v columns and the q and k norms
    assert held == query // size + h * 2 * d * item + 2 * d * item < whole

    heads = layout.kv_heads(params, cfg)
    assert heads == size
    state = jax.eval_shape(lambda: init_device_state(cfg, 1, 1, jnp.bfloat16, jnp.bfloat16, kv_heads=heads))
    specs = layout.state_specs(state, cfg)
    page = device_bytes((state.k_pages, state.v_pages), (specs.k_pages, specs.v_pages), size)
    assert page == 2 * 64 * d * 2  # one KV head of K and V, bf16
    assert layout.pool_shares(params, cfg)[0] == 1 / hkv


def test_block_fp8_mixers_split_on_whole_blocks_and_keep_their_values():
    # A block-FP8 fused projection splits where each device's columns are whole 128-blocks of its scales' grid
    # (`spmd.block_order`): with heads of 128 both mixers split at TP 2 (the GDN in_proj a ConcatWeight of an FP8
    # [qkv | z] and a plain [b | a], split part by part) and the attention at TP 4 over copied KV heads; each device's
    # dequantized slice is the canonical weight's columns (rows, for the out-projections) of its heads. Heads of 32
    # and 64 would cut a block: those mixers run whole.
    import types

    import jax
    import numpy as np
    from jax.sharding import PartitionSpec

    from ninfer_jax.model.ops import dequantize
    from ninfer_jax.model.params import AttnParams
    from ninfer_jax.model.random_init import random_params
    from ninfer_jax.model.spmd import AXIS, Spmd, mixer_orders, place_mixer

    def config(**heads):
        return ModelConfig.from_dict(oracle_config("tiny-dense", "text", num_hidden_layers=2,
                                                   full_attention_interval=2, **heads))

    def piece(spec, leaf, d, n):  # device d's shard of a leaf laid out by spec
        if AXIS not in tuple(spec):
            return leaf
        axis, k = tuple(spec).index(AXIS), leaf.shape[tuple(spec).index(AXIS)] // n
        return jax.lax.slice_in_dim(leaf, d * k, (d + 1) * k, axis=axis)

    narrow = config()
    params = jax.eval_shape(lambda: random_params(narrow, fp8=True))
    assert [Spmd(types.SimpleNamespace(size=2)).splits_mixer(p.mixer, narrow) for p in params.layers] == [False, False]
    cfg = config(head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128)
    params = random_params(cfg, fp8=True)
    for n, split in ((2, [True, True]), (4, [False, True])):
        spmd = Spmd(types.SimpleNamespace(size=n))
        assert [spmd.splits_mixer(p.mixer, cfg) for p in params.layers] == split
        for p in (layer.mixer for layer, s in zip(params.layers, split) if s):
            placed, specs = place_mixer(spmd, p, cfg), spmd.mixer_specs(p, cfg)
            fused = mixer_orders(p, cfg, n)
            out = "o_proj" if isinstance(p, AttnParams) else "out_proj"
            for d in range(n):
                local = jax.tree.map(lambda s, x: piece(s, x, d, n), specs, placed,
                                     is_leaf=lambda x: isinstance(x, PartitionSpec))
                for name, (_, order) in fused.items():
                    whole = np.asarray(dequantize(getattr(p, name)))
                    columns = order.reshape(n, -1)[d]
                    np.testing.assert_array_equal(np.asarray(dequantize(getattr(local, name))), whole[:, columns])
                whole = np.asarray(dequantize(getattr(p, out)))
                rows = whole.shape[0] // n
                np.testing.assert_array_equal(np.asarray(dequantize(getattr(local, out))),
                                              whole[d * rows:(d + 1) * rows])


def test_pages_with_copied_kv_heads_move_as_the_canonical_pages():
    # At TP 4 over 2 KV heads the pools hold [head 0, head 0, head 1, head 1]: a gather to the Host gives the bytes
    # a one-device pool of the same heads gives (so a file saved at TP 4 loads at TP 1 and back), and a scatter
    # writes every copy, values and scales of a quantized pool alike.
    import jax.numpy as jnp
    import numpy as np

    from ninfer_jax.model.spmd import kv_head_order
    from ninfer_jax.runtime.device.transfer import gather_pages, scatter_pages
    from pallas_kernels import kv_quant

    rng = np.random.default_rng(5)
    order = kv_head_order(2, 4)

    def pools(fmt):  # (one device's canonical pool, the TP 4 pool of its copies)
        x = jnp.asarray(rng.standard_normal((5, 64, 2, 64)), jnp.float32)
        if fmt is None:
            return x, x[:, :, order]
        canonical = kv_quant.QuantPages(*kv_quant.quantize(fmt, x), fmt.name)
        return canonical, kv_quant.with_planes(canonical, [plane[:, :, order] for plane in kv_quant.planes(canonical)])

    (k1, k4), (v1, v4) = pools(None), pools(kv_quant.INT8_G64)
    pages = jnp.asarray([1, 4])
    one = np.asarray(gather_pages((k1,), (v1,), pages))
    np.testing.assert_array_equal(np.asarray(gather_pages((k4,), (v4,), pages, kv_order=order)), one)
    blank = [jnp.zeros_like(x) for x in (k4, *kv_quant.planes(v4))]
    (k, ), (v, ) = scatter_pages((blank[0],), (kv_quant.with_planes(v4, blank[1:]),), jnp.asarray([2, 3]),
                                 jnp.asarray(one), kv_order=order)
    for after, before in zip([k, *kv_quant.planes(v)], [k4, *kv_quant.planes(v4)]):
        np.testing.assert_array_equal(np.asarray(after[2:4]), np.asarray(before[np.array([1, 4])]))
