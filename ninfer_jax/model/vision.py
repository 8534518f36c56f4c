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

Two entry points: `vision_forward` (the reference: any images in one call, a program per set of grids) and
`encode_padded` (serving: one image padded to one of a few `patch_buckets`, a program per bucket compiled at
startup by `warmup_padded`, attention masked so the valid rows equal vision_forward's; `encode_padded_batch`
for several images of one bucket).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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


def _attention(p: VisionBlockParams, vcfg: VisionConfig, x, cos, sin, attend):
    n, heads, hd = x.shape[0], vcfg.num_heads, vcfg.head_dim
    qkv = (x @ p.qkv_w + p.qkv_b).reshape(n, 3, heads, hd)
    q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    return attend(q, k, v).reshape(n, heads * hd) @ p.proj_w + p.proj_b


def _per_image_attention(lengths: tuple[int, ...], q, k, v):
    """q, k, v [N, heads, head_dim] of images one after another, `lengths` patches each: each image attends
    within itself."""
    # NOTE: one attention per image over static slices (the grid is static): no [N, N] mask, and no image
    # attends to another.
    outs, start = [], 0
    for length in lengths:
        s = slice(start, start + length)
        outs.append(jax.nn.dot_product_attention(q[s], k[s], v[s], scale=q.shape[-1] ** -0.5))
        start += length
    return jnp.concatenate(outs) if len(outs) > 1 else outs[0]


def _gelu(x, approximate: bool):
    """GELU in float32, cast back: torch's bf16 kernels compute it in float32 and round once."""
    return jax.nn.gelu(x.astype(F32), approximate=approximate).astype(x.dtype)


def _block(p: VisionBlockParams, vcfg: VisionConfig, x, cos, sin, attend):
    x = x + _attention(p, vcfg, _layer_norm(x, p.norm1_w, p.norm1_b), cos, sin, attend)
    h = _gelu(_layer_norm(x, p.norm2_w, p.norm2_b) @ p.fc1_w + p.fc1_b, approximate=True)
    return x + h @ p.fc2_w + p.fc2_b


def _tower(params: VisionParams, vcfg: VisionConfig, pixel_values, taps, tap_weights, pos, attend):
    """Patch rows -> merged tokens; `attend(q, k, v)` decides which patches see which."""
    dtype = params.patch_w.dtype
    x = pixel_values.astype(dtype) @ params.patch_w + params.patch_b
    # NOTE: the position taps are weighed and summed in float32, then cast, as transformers does in bf16
    x = x + (params.pos_embed[taps].astype(F32) * tap_weights[..., None]).sum(1).astype(dtype)
    cos, sin = _rotary(vcfg, pos)
    for blk in params.blocks:
        x = _block(blk, vcfg, x, cos, sin, attend)
    mp = params.merger
    x = _layer_norm(x, mp.norm_w, mp.norm_b).reshape(-1, vcfg.merged_dim)
    return _gelu(x @ mp.fc1_w + mp.fc1_b, approximate=False) @ mp.fc2_w + mp.fc2_b


@functools.partial(jax.jit, static_argnames=("vcfg", "lengths"))
def _encode(params: VisionParams, pixel_values, taps, tap_weights, pos, vcfg: VisionConfig, lengths):
    attend = functools.partial(_per_image_attention, lengths)
    return _tower(params, vcfg, pixel_values, taps, tap_weights, pos, attend)


def _check_grid(vcfg: VisionConfig, grid: tuple[tuple[int, int, int], ...]) -> None:
    m = vcfg.spatial_merge_size
    for i, (t, h, w) in enumerate(grid):
        if t != 1:
            raise ValueError(f"grid_thw[{i}] has t={t}: videos are not supported, an image has t=1")
        if h <= 0 or w <= 0 or h % m or w % m:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: h and w must be positive multiples of {m}")


def _check_pixels(vcfg: VisionConfig, pixel_values, grid: tuple[tuple[int, int, int], ...]) -> None:
    expected = (sum(h * w for _, h, w in grid), vcfg.patch_dim)
    if tuple(pixel_values.shape) != expected:
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}, expected {expected} for {grid}")


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
    _check_grid(vcfg, grid)
    _check_pixels(vcfg, pixel_values, grid)
    taps, tap_weights, pos = grid_metadata(vcfg, grid)
    lengths = tuple(h * w for _, h, w in grid)
    return _encode(params, jnp.asarray(pixel_values), taps, tap_weights, pos, vcfg=vcfg, lengths=lengths)


# --- the serving encoder: one image padded to a bucket ----------------------------------------------------------
MIN_BUCKET_PATCHES = 64
FINE_BUCKET_PATCHES = 1024  # from here on, four buckets per doubling
MAX_BUCKETS = 32  # each bucket is one program compiled at startup


def patch_buckets(vcfg: VisionConfig, max_patches: int, min_patches: int = MIN_BUCKET_PATCHES) -> tuple[int, ...]:
    """The patch counts an image is encoded at (`encode_padded`), ascending, up to the first >= max_patches:
    merge^2 * 2^k from the smallest >= min_patches, then from FINE_BUCKET_PATCHES on a quarter of each doubling
    (1024, 1280, 1536, 1792, 2048, 2560 ...). A large image pays every padded patch in the tower's matmuls, so
    there padding stays below 25% (a 1344-pixel image's 7056 patches take 7168, not 8192); a small one is
    latency-bound and costs few programs.

    Raises:
      ValueError when min_patches or max_patches is not positive, or the range needs more than MAX_BUCKETS.
    """
    if min_patches <= 0 or max_patches <= 0:
        raise ValueError(f"min_patches ({min_patches}) and max_patches ({max_patches}) must be positive")
    bucket = vcfg.spatial_merge_size**2
    while bucket < min_patches:
        bucket *= 2
    buckets = [bucket]
    while buckets[-1] < max_patches:
        last = buckets[-1]
        octave = 1 << (last.bit_length() - 1)  # the power of two at or below the last bucket
        buckets.append(last + (octave // 4 if last >= FINE_BUCKET_PATCHES else octave))
    if len(buckets) > MAX_BUCKETS:
        raise ValueError(f"patch buckets from {min_patches} to {max_patches} patches are {len(buckets)} programs, "
                         f"more than {MAX_BUCKETS}: raise min_patches or lower max_patches")
    return tuple(buckets)


class PaddedImage(NamedTuple):
    """One image's `encode_padded` inputs on the host, `bucket` rows each; rows >= n_valid are padding (zero
    pixels, zero tap weights, position (0, 0))."""

    pixels: np.ndarray  # [bucket, patch_dim] float32
    taps: np.ndarray  # [bucket, 4] int32
    tap_weights: np.ndarray  # [bucket, 4] float32
    pos: np.ndarray  # [bucket, 2] int32
    n_valid: np.ndarray  # [] int32: h * w, the image's patches


def pad_image(vcfg: VisionConfig, pixel_values, grid: tuple[int, int, int], bucket: int) -> PaddedImage:
    """One image's pixel_values [h * w, patch_dim] (image_processing.py) and grid (1, h, w), padded to `bucket`.

    Raises:
      ValueError for a video grid, a grid not divisible by the merge size, pixel_values of the wrong shape, a
      bucket not a multiple of merge^2, or an image larger than the bucket.
    """
    grid = tuple(int(v) for v in grid)
    _check_grid(vcfg, (grid,))
    _check_pixels(vcfg, pixel_values, (grid,))
    metadata = padded_metadata(vcfg, grid, bucket)
    pixels = np.zeros((bucket, vcfg.patch_dim), np.float32)
    pixels[:len(pixel_values)] = np.asarray(pixel_values)
    return PaddedImage(pixels, *metadata)


@functools.lru_cache(maxsize=64)
def padded_metadata(vcfg: VisionConfig, grid: tuple[int, int, int], bucket: int) -> tuple[np.ndarray, ...]:
    """(taps, tap_weights, pos, n_valid) of `pad_image` for a grid (1, h, w) and bucket, padding rows zero: the
    same for every image of that size (screenshots repeat sizes), so computed once. Read-only arrays.

    Raises:
      ValueError for a bucket not a multiple of merge^2, or an image larger than the bucket.
    """
    n, merge_rows = grid[1] * grid[2], vcfg.spatial_merge_size**2
    if bucket % merge_rows:
        raise ValueError(f"bucket {bucket} is not a multiple of spatial_merge_size^2 = {merge_rows}")
    if n > bucket:
        raise ValueError(f"an image of grid {grid} has {n} patches, more than its bucket of {bucket}")

    def pad(a, dtype):
        out = np.zeros((bucket, *a.shape[1:]), dtype)
        out[:n] = a
        out.setflags(write=False)
        return out

    taps, tap_weights, pos = grid_metadata(vcfg, (grid,))
    n_valid = np.asarray(n, np.int32)
    n_valid.setflags(write=False)
    return pad(taps, np.int32), pad(tap_weights, np.float32), pad(pos, np.int32), n_valid


def pixels_from_bytes(table, patches, temporal: int):
    """The processor's pixel_values rows from uint8 patches [n, 3, P, P] and its normalisation table [3, 256]
    (`image_processing.normalization_table`), inside a step: a lookup, so the device gets the processor's floats
    from an eighth of the bytes."""
    x = table[jnp.arange(3)[None, :, None, None], patches.astype(jnp.int32)]
    n, _, p, _ = patches.shape
    return jnp.broadcast_to(x[:, :, None], (n, 3, temporal, p, p)).reshape(n, -1)


def stack_images(images: list[PaddedImage]) -> PaddedImage:
    """Images padded to one bucket, each field stacked on a leading axis: `encode_padded_batch`'s inputs."""
    if len({image.pixels.shape[0] for image in images}) != 1:
        raise ValueError(f"images padded to different buckets: {[image.pixels.shape[0] for image in images]}")
    return PaddedImage(*(np.stack(field) for field in zip(*images)))


def padded_tower(params: VisionParams, vcfg: VisionConfig, pixels, taps, tap_weights, pos, n_valid,
                 attention: str = "xla"):
    """`encode_padded`'s program, unjitted: for a caller's own jitted step (the runner's writes its rows)."""
    # NOTE: a key-padding mask (key_value_seq_lengths), so valid patches never attend to padding and equal
    # vision_forward. Padded query rows are masked too (query_seq_lengths), so cuDNN can skip their tiles; jax
    # does not specify their output then: they are zeroed, because a NaN there would reach valid rows through
    # the next layer's values (0 * NaN). Padded rows end in merged rows of their own (n_valid is a multiple of
    # merge^2), junk the caller drops.
    def attend(q, k, v):
        lengths = n_valid.reshape(1)
        out = jax.nn.dot_product_attention(q[None], k[None], v[None], scale=q.shape[-1] ** -0.5,
                                           query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                           implementation=attention)[0]
        return jnp.where((jnp.arange(out.shape[0]) < n_valid)[:, None, None], out, 0)

    return _tower(params, vcfg, pixels, taps, tap_weights, pos, attend)


def _encode_padded_batch(params: VisionParams, vcfg: VisionConfig, pixels, taps, tap_weights, pos, n_valid,
                         attention: str = "xla"):
    def one(*image):
        return padded_tower(params, vcfg, *image, attention=attention)

    return jax.vmap(one)(pixels, taps, tap_weights, pos, n_valid)


_PROGRAMS = {name: jax.jit(f, static_argnames=("vcfg", "attention"))
             for name, f in (("one", padded_tower), ("batch", _encode_padded_batch))}


def _device_inputs(*image):
    """An image's fields in the one form the programs see, whatever the caller's (host or device arrays, a
    Python int n_valid): jit keys its cache on the form, and the program a bucket compiled at startup must be
    the one every image of it runs. Attention is passed by keyword always, for the same reason."""
    *arrays, n_valid = image
    if not isinstance(n_valid, jax.Array):
        n_valid = np.asarray(n_valid, np.int32)
    elif n_valid.dtype != jnp.int32 or n_valid.weak_type:
        n_valid = n_valid.astype(jnp.int32)
    return jax.device_put((*arrays, n_valid))


def encode_padded(params: VisionParams, vcfg: VisionConfig, pixels, taps, tap_weights, pos, n_valid,
                  attention: str = "xla"):
    """One image padded to a bucket (`pad_image`'s fields, host or device arrays) -> [bucket / merge^2,
    out_hidden_size] in the params' dtype; rows >= n_valid / merge^2 are junk. The program's shapes are the
    bucket's alone.

    `attention` is jax's dot_product_attention implementation: "xla" (materialises [heads, bucket, bucket]
    logits) or "cudnn" (flash attention; GPU, bf16 or fp16 params only).
    """
    return _PROGRAMS["one"](params, vcfg, *_device_inputs(pixels, taps, tap_weights, pos, n_valid),
                            attention=attention)


def encode_padded_batch(params: VisionParams, vcfg: VisionConfig, pixels, taps, tap_weights, pos, n_valid,
                        attention: str = "xla"):
    """`encode_padded` of B images padded to one bucket, in one call: each field stacked on a leading axis
    (`stack_images`; n_valid [B]); returns [B, bucket / merge^2, out_hidden_size]. Each image attends within
    itself only. A program per (bucket, B)."""
    return _PROGRAMS["batch"](params, vcfg, *_device_inputs(pixels, taps, tap_weights, pos, n_valid),
                              attention=attention)


def warmup_padded(params: VisionParams, vcfg: VisionConfig, buckets: tuple[int, ...], attention: str = "xla"):
    """Compiles `encode_padded` for every bucket (an engine's startup), so no image that fits one compiles."""
    m = vcfg.spatial_merge_size
    blank = np.zeros((m * m, vcfg.patch_dim), np.float32)
    for bucket in buckets:
        jax.block_until_ready(encode_padded(params, vcfg, *pad_image(vcfg, blank, (1, m, m), bucket),
                                            attention=attention))


def padded_compile_count() -> int:
    """Programs compiled by `encode_padded` and `encode_padded_batch` in this process (grows only when a new
    bucket, batch size, params dtype or attention appears): lets tests prove that serving never compiles."""
    return sum(f._cache_size() for f in _PROGRAMS.values())
