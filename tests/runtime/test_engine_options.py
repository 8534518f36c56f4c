"""EngineOptions.resolve: the kernels follow the device unless named, and conflicting kernel options are refused."""

from __future__ import annotations

import pytest

from ninfer_jax.runtime.options import EngineOptions, OptionsError


def test_auto_kernels_are_pallas_on_a_gpu_and_the_references_elsewhere():
    assert EngineOptions().resolve(4096, "gpu").kernels == "pallas"
    assert EngineOptions().resolve(4096, "cpu").kernels == "reference"
    assert EngineOptions(kernels="reference").resolve(4096, "gpu").kernels == "reference"
    assert EngineOptions(kernels="pallas", interpret=True).resolve(4096, "cpu").kernels == "pallas"


def test_cudnn_prefill_attention_is_accepted_on_a_gpu_with_the_pallas_kernels():
    resolved = EngineOptions(prefill_attention="cudnn").resolve(4096, "gpu")
    assert (resolved.kernels, resolved.prefill_attention) == ("pallas", "cudnn")


@pytest.mark.parametrize("options, backend, message", [
    (dict(prefill_attention="cudnn"), "cpu", "needs a GPU"),
    (dict(prefill_attention="cudnn", kernels="reference"), "gpu", "conflicts with kernels 'reference'"),
    (dict(prefill_attention="cudnn", kernels="pallas", interpret=True), "cpu", "conflicts with interpret"),
    (dict(prefill_attention="flash"), "gpu", "prefill_attention must be"),
    (dict(kernels="triton"), "gpu", "kernels must be"),
])
def test_conflicting_kernel_options_are_refused_by_name(options, backend, message):
    with pytest.raises(OptionsError, match=message):
        EngineOptions(**options).resolve(4096, backend)
