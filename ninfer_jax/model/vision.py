"""The Qwen3.5 vision tower as pure functions of a params pytree (transformers' `Qwen3_5VisionModel`).

Conventions, each checked against transformers' `models/qwen3_5/modeling_qwen3_5.py` and `vision_utils.py` by
tests/model/test_vision.py (the MoE model's tower is the same code):
  * pixel_values [N, C*T*P*P], rows in spatial-merge-block order (frontend/image_processing.py); the Conv3d
    patch embedding has stride = kernel, so it is one matmul with a bias.
  * A learned [side^2, D] position table, bilinearly resampled (align_corners, border taps) to each image's
    (h, w) grid, is added to the patch embeddings.
  * Blocks: x += attn(LN1(x)); x += mlp(LN2(x)). LayerNorm with bias, eps 1e-6. Attention: fused qkv with bias,
    2-D axial RoPE over the whole head (the h-row angles then the w-column angles, that pair twice, rotate-half),
    scale head_dim^-0.5, not causal, within one image only. MLP: fc1, tanh GELU, fc2, with biases.
  * Merger: LN, each merge x merge block's D * merge^2 vector, fc1, exact GELU, fc2 -> out_hidden_size.
No deepstack features: Qwen3-VL's tower has them, Qwen3.5's does not; the text model reads only the merged
tokens, placed at its image placeholders.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ninfer_jax.config import VisionConfig

F32 = jnp.float32
LN_EPS = 1e-6
PREFIX = "model.visual."


@struct.dataclass
class VisionBlockParams:
    norm1_w: jax.Array  # [D]
    norm1_b: jax.Array  # [D]
    qkv_w: jax.Array  # [D, 3D]: q | k | v, each head_dim per head
    qkv_b: jax.Array  # [3D]
    proj_w: jax.Array  # [D, D]
    proj_b: jax.Array  # [D]
    norm2_w: jax.Array  # [D]
    norm2_b: jax.Array  # [D]
    fc1_w: jax.Array  # [D, I]
    fc1_b: jax.Array  # [I]
    fc2_w: jax.Array  # [I, D]
    fc2_b: jax.Array  # [D]


@struct.dataclass
class MergerParams:
    norm_w: jax.Array  # [D]
    norm_b: jax.Array  # [D]
    fc1_w: jax.Array  # [D*m^2, D*m^2]
    fc1_b: jax.Array  # [D*m^2]
    fc2_w: jax.Array  # [D*m^2, out]
    fc2_b: jax.Array  # [out]


@struct.dataclass
class VisionParams:
    """Weights stored [in, out] (x @ w), as the text model's."""

    patch_w: jax.Array  # [C*T*P*P, D], the Conv3d kernel flattened in pixel_values' row order
    patch_b: jax.Array  # [D]
    pos_embed: jax.Array  # [num_position_embeddings, D]
    blocks: tuple[VisionBlockParams, ...]
    merger: MergerParams


def vision_tensor_shapes(vcfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every vision-tower tensor of a VLM checkpoint (`model.visual.*`), by name and shape as on disk."""
    d, i, m = vcfg.hidden_size, vcfg.intermediate_size, vcfg.merged_dim
    p, t = vcfg.patch_size, vcfg.temporal_patch_size
    shapes = {
        PREFIX + "patch_embed.proj.weight": (d, vcfg.in_channels, t, p, p),
        PREFIX + "patch_embed.proj.bias": (d,),
        PREFIX + "pos_embed.weight": (vcfg.num_position_embeddings, d),
    }
    for b in range(vcfg.depth):
        pre = f"{PREFIX}blocks.{b}."
        shapes.update({
            pre + "norm1.weight": (d,), pre + "norm1.bias": (d,),
            pre + "norm2.weight": (d,), pre + "norm2.bias": (d,),
            pre + "attn.qkv.weight": (3 * d, d), pre + "attn.qkv.bias": (3 * d,),
            pre + "attn.proj.weight": (d, d), pre + "attn.proj.bias": (d,),
            pre + "mlp.linear_fc1.weight": (i, d), pre + "mlp.linear_fc1.bias": (i,),
            pre + "mlp.linear_fc2.weight": (d, i), pre + "mlp.linear_fc2.bias": (d,),
        })
    shapes.update({
        PREFIX + "merger.norm.weight": (d,), PREFIX + "merger.norm.bias": (d,),
        PREFIX + "merger.linear_fc1.weight": (m, m), PREFIX + "merger.linear_fc1.bias": (m,),
        PREFIX + "merger.linear_fc2.weight": (vcfg.out_hidden_size, m),
        PREFIX + "merger.linear_fc2.bias": (vcfg.out_hidden_size,),
    })
    return shapes


def vision_params_from_tensors(vcfg: VisionConfig, get, put) -> VisionParams:
    """The params pytree from `get(name, shape)` (a checkpoint's array, checked) and `put` (array -> device)."""
    shapes = vision_tensor_shapes(vcfg)

    def w(name):  # a Linear's [out, in] -> [in, out]
        return put(get(PREFIX + name, shapes[PREFIX + name]).T)

    def b(name):
        return put(get(PREFIX + name, shapes[PREFIX + name]))

    conv = get(PREFIX + "patch_embed.proj.weight", shapes[PREFIX + "patch_embed.proj.weight"])
    blocks = tuple(
        VisionBlockParams(
            norm1_w=b(f"blocks.{k}.norm1.weight"), norm1_b=b(f"blocks.{k}.norm1.bias"),
            qkv_w=w(f"blocks.{k}.attn.qkv.weight"), qkv_b=b(f"blocks.{k}.attn.qkv.bias"),
            proj_w=w(f"blocks.{k}.attn.proj.weight"), proj_b=b(f"blocks.{k}.attn.proj.bias"),
            norm2_w=b(f"blocks.{k}.norm2.weight"), norm2_b=b(f"blocks.{k}.norm2.bias"),
            fc1_w=w(f"blocks.{k}.mlp.linear_fc1.weight"), fc1_b=b(f"blocks.{k}.mlp.linear_fc1.bias"),
            fc2_w=w(f"blocks.{k}.mlp.linear_fc2.weight"), fc2_b=b(f"blocks.{k}.mlp.linear_fc2.bias"),
        )
        for k in range(vcfg.depth)
    )
    return VisionParams(
        patch_w=put(conv.reshape(conv.shape[0], -1).T),
        patch_b=b("patch_embed.proj.bias"),
        pos_embed=b("pos_embed.weight"),
        blocks=blocks,
        merger=MergerParams(
            norm_w=b("merger.norm.weight"), norm_b=b("merger.norm.bias"),
            fc1_w=w("merger.linear_fc1.weight"), fc1_b=b("merger.linear_fc1.bias"),
            fc2_w=w("merger.linear_fc2.weight"), fc2_b=b("merger.linear_fc2.bias"),
        ),
    )


# --- per-grid metadata, on the host --------------------------------------------------------------------------
def _block_order(h: int, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The (row, col) of each patch of an h x w grid in spatial-merge-block order, as pixel_values holds them."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")

    def order(a):
        return a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)

    return order(rows), order(cols)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear (align_corners) taps into a `side`-long table and their weights, for positions `index` on an axis
    of `size`; float32 in transformers' order of operations."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))
    return taps, np.maximum(np.float32(1) - distance, np.float32(0))


def grid_metadata(vcfg: VisionConfig, grid: tuple[tuple[int, int, int], ...]):
    """Per patch: the position table's 4 bilinear taps [N, 4] and weights [N, 4], and the (row, col) [N, 2] that
    the rotary embedding turns into angles."""
    side, m = vcfg.grid_side, vcfg.spatial_merge_size
    idx, wts, pos = [], [], []
    for _, h, w in grid:
        rows, cols = _block_order(h, w, m)
        h_taps, h_w = _axis_taps(rows, h, side)
        w_taps, w_w = _axis_taps(cols, w, side)
        idx.append((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4))
        wts.append((h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4))
        pos.append(np.stack([rows, cols], axis=-1))
    return (np.concatenate(idx).astype(np.int32), np.concatenate(wts).astype(np.float32),
            np.concatenate(pos).astype(np.int32))


# --- the tower ------------------------------------------------------------------------------------------------
def _layer_norm(x, w, b):
    x32 = x.astype(F32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + LN_EPS) * w.astype(F32) + b.astype(F32)).astype(x.dtype)


def _rotary(vcfg: VisionConfig, pos):
    """pos [N, 2] -> cos, sin [N, head_dim]: the row angles then the column angles, that pair twice."""
    half = vcfg.head_dim // 2
    inv_freq = 1.0 / (vcfg.rope_theta ** (jnp.arange(0, half, 2, dtype=F32) / half))
    freqs = pos.astype(F32)[..., None] * inv_freq  # [N, 2, half / 2]
    angles = jnp.concatenate([freqs[:, 0], freqs[:, 1]], axis=-1)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x, cos, sin):
    """x [N, heads, head_dim] rotated in float32 (rotate-half), cast back."""
    x32 = x.astype(F32)
    h = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., h:], x32[..., :h]], axis=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


def _attention(p: VisionBlockParams, vcfg: VisionConfig, x, cos, sin, lengths):
    n, heads, hd = x.shape[0], vcfg.num_heads, vcfg.head_dim
    qkv = (x @ p.qkv_w + p.qkv_b).reshape(n, 3, heads, hd)
    q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    outs, start = [], 0
    # NOTE: one attention per image over static slices (the grid is static): no [N, N] mask, and no image
    # attends to another.
    for length in lengths:
        s = slice(start, start + length)
        outs.append(jax.nn.dot_product_attention(q[s], k[s], v[s], scale=hd**-0.5))
        start += length
    out = jnp.concatenate(outs) if len(outs) > 1 else outs[0]
    return out.reshape(n, heads * hd) @ p.proj_w + p.proj_b


def _block(p: VisionBlockParams, vcfg: VisionConfig, x, cos, sin, lengths):
    x = x + _attention(p, vcfg, _layer_norm(x, p.norm1_w, p.norm1_b), cos, sin, lengths)
    h = jax.nn.gelu(_layer_norm(x, p.norm2_w, p.norm2_b) @ p.fc1_w + p.fc1_b, approximate=True)
    return x + h @ p.fc2_w + p.fc2_b


@functools.partial(jax.jit, static_argnames=("vcfg", "lengths"))
def _encode(params: VisionParams, pixel_values, taps, tap_weights, pos, vcfg: VisionConfig, lengths):
    dtype = params.patch_w.dtype
    x = pixel_values.astype(dtype) @ params.patch_w + params.patch_b
    x = x + (params.pos_embed[taps] * tap_weights[..., None].astype(dtype)).sum(1)
    cos, sin = _rotary(vcfg, pos)
    for blk in params.blocks:
        x = _block(blk, vcfg, x, cos, sin, lengths)
    mp = params.merger
    x = _layer_norm(x, mp.norm_w, mp.norm_b).reshape(-1, vcfg.merged_dim)
    return jax.nn.gelu(x @ mp.fc1_w + mp.fc1_b, approximate=False) @ mp.fc2_w + mp.fc2_b


def vision_forward(params: VisionParams, vcfg: VisionConfig, pixel_values, grid_thw):
    """Encode images: the tower's merged tokens, the rows the text model places at the image placeholders.

    Args:
      pixel_values: [sum of h*w, C*T*P*P], the images' patches one image after another (image_processing.py).
      grid_thw: [n_images, 3] (t, h, w) in patches, t = 1; any sequence of triples or an int array.
    Returns:
      [sum of h*w / merge^2, out_hidden_size] in the params' dtype, image after image, each image's tokens in
      row-major order of its merged (h / merge, w / merge) grid.
    Raises:
      ValueError for a video grid (t > 1: not supported), a grid not divisible by the merge size, or
      pixel_values of the wrong shape.
    """
    grid = tuple(tuple(int(v) for v in g) for g in np.asarray(grid_thw).reshape(-1, 3))
    m = vcfg.spatial_merge_size
    for i, (t, h, w) in enumerate(grid):
        if t != 1:
            raise ValueError(f"grid_thw[{i}] has t={t}: videos are not supported, an image has t=1")
        if h <= 0 or w <= 0 or h % m or w % m:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: h and w must be positive multiples of {m}")
    expected = (sum(h * w for _, h, w in grid), vcfg.patch_dim)
    if tuple(pixel_values.shape) != expected:
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}, expected {expected} for {grid}")
    taps, tap_weights, pos = grid_metadata(vcfg, grid)
    lengths = tuple(h * w for _, h, w in grid)
    return _encode(params, jnp.asarray(pixel_values), taps, tap_weights, pos, vcfg=vcfg, lengths=lengths)


# --- serving: one image per call, padded to a bucket of patches ------------------------------------------------
def patch_buckets(vcfg: VisionConfig, max_patches: int) -> tuple[int, ...]:
    """The padded patch counts an image is encoded at: powers of two from 64 up to the first >= max_patches."""
    sizes = [max(64, vcfg.spatial_merge_size**2)]
    while sizes[-1] < max_patches:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def pad_image(vcfg: VisionConfig, pixel_values, grid, bucket: int):
    """One image's encoder inputs padded to `bucket` patches (host arrays): pixels, position taps and weights,
    rotary (row, col), and its patch count."""
    taps, weights, pos = grid_metadata(vcfg, (tuple(int(v) for v in grid),))
    n = taps.shape[0]
    if n > bucket:
        raise ValueError(f"an image of {n} patches does not fit a bucket of {bucket}")

    def pad(a):
        return np.concatenate([a, np.zeros((bucket - n,) + a.shape[1:], a.dtype)])

    return pad(np.asarray(pixel_values, np.float32)), pad(taps), pad(weights), pad(pos), np.int32(n)


def _masked_block(p: VisionBlockParams, vcfg: VisionConfig, x, cos, sin, valid):
    n, heads, hd = x.shape[0], vcfg.num_heads, vcfg.head_dim
    h = _layer_norm(x, p.norm1_w, p.norm1_b)
    qkv = (h @ p.qkv_w + p.qkv_b).reshape(n, 3, heads, hd)
    q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    out = jax.nn.dot_product_attention(q, k, v, scale=hd**-0.5, mask=valid[None, None, :])
    x = x + out.reshape(n, heads * hd) @ p.proj_w + p.proj_b
    h = jax.nn.gelu(_layer_norm(x, p.norm2_w, p.norm2_b) @ p.fc1_w + p.fc1_b, approximate=True)
    return x + h @ p.fc2_w + p.fc2_b


def encode_padded(params: VisionParams, vcfg: VisionConfig, pixels, taps, tap_weights, pos, n_valid):
    """One image padded to a bucket (`pad_image`) -> [bucket / merge^2, out_hidden_size]; rows past its
    n_valid / merge^2 tokens are junk. Patches never attend to padding."""
    dtype = params.patch_w.dtype
    x = pixels.astype(dtype) @ params.patch_w + params.patch_b
    x = x + (params.pos_embed[taps] * tap_weights[..., None].astype(dtype)).sum(1)
    cos, sin = _rotary(vcfg, pos)
    valid = jnp.arange(x.shape[0]) < n_valid
    for blk in params.blocks:
        x = _masked_block(blk, vcfg, x, cos, sin, valid)
    mp = params.merger
    x = _layer_norm(x, mp.norm_w, mp.norm_b).reshape(-1, vcfg.merged_dim)
    return jax.nn.gelu(x @ mp.fc1_w + mp.fc1_b, approximate=False) @ mp.fc2_w + mp.fc2_b
