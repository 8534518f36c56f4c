"""The fused GDN prefill step up to the delta rule (`pallas_kernels/gdn_conv.py`, interpret mode on CPU) against the
model's own composition (`qwen3_5.gdn_conv_qkv`), and its Triton lowering at the 35B-A3B's and the 27B's head
shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.config import ModelConfig
from ninfer_jax.model import ops, qwen3_5, tiny
from kernel_support import INTERPRET, lower_for_h200
from pallas_kernels import gdn_conv

TINY = ModelConfig.from_dict(tiny.preset_config("tiny-moe"))  # 2 key heads, 4 value heads of 32, 4 taps


def _case(t, n_valid, dtype, seed, extra_cols=70):
    rng = np.random.default_rng(seed)
    c = TINY.conv_dim
    proj = jnp.asarray(rng.standard_normal((t, c + extra_cols)) * 2, dtype)  # z, b, a ride along unread
    history = jnp.asarray(rng.standard_normal((TINY.linear_conv_kernel_dim - 1, c)), dtype)
    conv_w = jnp.asarray(rng.standard_normal((TINY.linear_conv_kernel_dim, c)) * 0.5, dtype)
    return proj, history, conv_w, jnp.int32(n_valid)


def _composition(proj, history, conv_w, n_valid):
    """As `qwen3_5._gdn_prefill` composes it without the kernel."""
    window = jnp.concatenate([history, proj[:, : TINY.conv_dim]], axis=0)
    return qwen3_5.gdn_conv_qkv(window, conv_w, (jnp.arange(proj.shape[0]) < n_valid)[:, None], TINY)


def _fused(proj, history, conv_w, n_valid, **kw):
    return gdn_conv.gdn_conv_prefill(
        proj, history, conv_w, n_valid, num_key_heads=TINY.linear_num_key_heads,
        key_head_dim=TINY.linear_key_head_dim, num_value_heads=TINY.linear_num_value_heads,
        value_head_dim=TINY.linear_value_head_dim, interpret=INTERPRET, **kw)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t, n_valid", [(64, 64), (64, 37), (13, 13), (200, 130), (3, 1)],
                         ids=["one-block", "padded", "short", "blocks-and-padding", "shorter-than-the-taps"])
def test_fused_step_equals_the_models_composition(t, n_valid, dtype):
    """q and k normalised as the model does (q scaled), v the conv's output; history rows feed the first K-1 tokens;
    every row at or past n_valid is zero."""
    args = _case(t, n_valid, dtype, seed=t * 1000 + n_valid)
    want = _composition(*args)
    got = _fused(*args, config=gdn_conv.GdnConvConfig(block_t=16))
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        # float32: the same operations to rounding; bf16: the conv's sum may round once differently
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)
        assert not np.asarray(g[n_valid:]).any()  # padding: exact zeros


def test_model_prefill_takes_it_only_when_asked_and_able():
    args = _case(16, 16, jnp.float32, seed=0)
    on = ops.KernelConfig("pallas", interpret=INTERPRET, fuse_gdn_conv=True)
    assert ops.gdn_conv_prefill(on, *args, TINY) is not None
    assert ops.gdn_conv_prefill(ops.KernelConfig("pallas", interpret=INTERPRET), *args, TINY) is None  # flag off
    odd = TINY.__class__(**{**TINY.__dict__, "linear_key_head_dim": 24})  # not one power-of-two block
    assert ops.gdn_conv_prefill(on, *args, odd) is None
    with pytest.raises(ValueError, match="fuse_gdn_conv"):
        ops.KernelConfig(fuse_gdn_conv=True)
    with pytest.raises(ValueError, match="history"):
        _fused(args[0], args[1][:-1], *args[2:])


@pytest.mark.parametrize("cfg_name", ["qwen3.5-35b-a3b", "qwen3.5-27b"])
def test_lowers_to_triton_at_the_real_head_shapes(cfg_name):
    lower_for_h200()
    cfg = ModelConfig.from_file(tiny.CONFIG_DIR / f"{cfg_name}.json")
    spec = jax.ShapeDtypeStruct
    t, c, k = 2048, cfg.conv_dim, cfg.linear_conv_kernel_dim
    width = c + cfg.value_dim + 2 * cfg.linear_num_value_heads
    text = gdn_conv.gdn_conv_prefill.trace(
        spec((t, width), jnp.bfloat16), spec((k - 1, c), jnp.bfloat16), spec((k, c), jnp.bfloat16),
        spec((), jnp.int32), num_key_heads=cfg.linear_num_key_heads, key_head_dim=cfg.linear_key_head_dim,
        num_value_heads=cfg.linear_num_value_heads, value_head_dim=cfg.linear_value_head_dim,
    ).lower(lowering_platforms=("cuda",)).as_text()
    assert "gdn_conv_prefill" in text
