"""Shared helpers of the kernel tests."""

import jax
import numpy as np

# Kernels run in the Pallas interpreter on a CPU (CI), compiled on a GPU (`JAX_PLATFORMS=cuda pytest tests/kernels`)
INTERPRET = jax.default_backend() == "cpu"


def attention64(q, k, v, q_pos, kv_len):
    """Softmax attention in float64 (numpy), the paged kernels' oracle: q [T, Hq, D], k/v [S, Hkv, D]; query i sees
    keys j <= q_pos[i], j < kv_len."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(t, hkv, hq // hkv, d)
    s = np.einsum("tkgd,skd->tkgs", qg, k[:kv_len]) / np.sqrt(d)
    s = np.where(np.arange(kv_len)[None, None, None, :] <= q_pos[:, None, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (np.einsum("tkgs,skd->tkgd", p / p.sum(-1, keepdims=True), v[:kv_len])).reshape(t, hq, d)


def lower_for_h200():
    """Make `jit(...).lower(lowering_platforms=("cuda",))` work on a machine without a GPU.

    jax 0.10 lowers Pallas-Triton kernels to Triton IR without asking for a device; jax >= 0.11 asks for
    the GPU's compute capability first. This pins it to the H200's (sm_90). Lowering catches unsupported
    primitives and shapes in CI; only the Triton compile itself needs the GPU.
    """
    try:
        from jax._src.pallas.triton import gpu_info as gi
        from jax._src.pallas.triton import pallas_call_registration as reg
    except ImportError:  # jax 0.10: no device query during lowering
        return
    if hasattr(reg, "gpu_info_lib"):
        reg.gpu_info_lib.get_gpu_info = lambda: gi.get_gpu_info_from_version(gi.GpuVersion.H200)
