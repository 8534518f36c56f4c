"""The sharding report's readings (`ninfer_jax/benchmarks/sharding_report.py`): collectives parsed from compiled HLO
text, and the bytes a device holds of a sharded tree."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ninfer_jax.benchmarks.sharding_report import hlo_collectives
from ninfer_jax.runtime.device.sharding import device_bytes


def test_collectives_are_counted_with_their_result_bytes_tuples_and_async_starts_included():
    text = "\n".join([
        "  %all-reduce.1 = f32[8,2048]{1,0} all-reduce(f32[8,2048]{1,0} %p), replica_groups={{0,1}}",
        "  %ar.2 = (f32[8,64]{1,0}, bf16[8,8,64]{2,1,0}) all-reduce(%a, %b), to_apply=%add",
        "  %ag = bf16[4,256]{1,0} all-gather-start(bf16[2,256]{1,0} %x), dimensions={0}",
        "  %cp = s32[16]{0} collective-permute(s32[16]{0} %y), source_target_pairs={{0,1},{1,0}}",
        "  %add = f32[8,2048]{1,0} add(f32[8,2048]{1,0} %all-reduce.1, f32[8,2048]{1,0} %z)",
    ])
    assert hlo_collectives(text) == {
        "all-reduce": {"ops": 2, "bytes": 8 * 2048 * 4 + 8 * 64 * 4 + 8 * 8 * 64 * 2},
        "all-gather": {"ops": 1, "bytes": 4 * 256 * 2},
        "collective-permute": {"ops": 1, "bytes": 16 * 4},
    }


def test_a_device_holds_a_split_leafs_share_and_a_replicated_leaf_whole():
    shapes = {"w": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16), "n": jax.ShapeDtypeStruct((32,), jnp.float32)}
    specs = {"w": P(None, "tp"), "n": P()}
    assert device_bytes(shapes, specs, 4) == 64 * 32 * 2 // 4 + 32 * 4
