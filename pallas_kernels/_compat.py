"""The few Pallas APIs our kernels use, gated here so the kernels run on jax 0.10.2 (CPU, interpret mode)
and jax 0.11.2 (H200, Triton).

NOTE: on GPU a bare `pl.pallas_call` picks its backend from a config flag whose default moved between
releases (0.10 defaults to Mosaic GPU, which lacks cumsum and gathers). Every kernel here passes Triton
compiler params, which pins the Triton backend on both versions. Triton warns that it is deprecated; the
warning is filtered once, here.
"""

from __future__ import annotations

import warnings

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

warnings.filterwarnings("ignore", message=".*Triton.*deprecat.*")
warnings.filterwarnings("ignore", message=".*pallas_call.*deprecat.*")

# Masked, gathered loads and stores (ref.at[index arrays]); Triton skips masked lanes entirely.
load = pltriton.load
store = pltriton.store


def triton_params(num_warps: int, num_stages: int):
    """Compiler params selecting the Triton backend with the given warps and pipelining depth."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def full_spec():
    """A BlockSpec that hands the kernel the whole array (indexed by hand inside the kernel)."""
    return pl.no_block_spec
