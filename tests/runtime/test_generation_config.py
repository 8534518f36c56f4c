"""A checkpoint's generation_config.json gives the sampling defaults of requests that leave those fields unset, as
vLLM's --generation-config auto does; none turns that off, and a broken file is refused at load naming itself."""

import json
import shutil

import pytest

from ninfer_jax import Engine, SamplingParams
from ninfer_jax.runtime.options import EngineOptions, OptionsError
from ninfer_jax.runtime.sampling import generation_defaults

OPTIONS = dict(max_concurrency=1, prefill_chunk=64, max_model_len=256, kv_capacity=1024, warmup=False)
PROMPT = list(range(100, 140))


def _write(path, fields):
    path.write_text(json.dumps({"bos_token_id": 1, "do_sample": True, **fields}))
    return path


def test_the_sampling_fields_of_a_generation_config_map_to_sampling_params(tmp_path):
    file = _write(tmp_path / "generation_config.json", {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                        "repetition_penalty": 1.05, "max_new_tokens": 512,
                                                        "min_p": 0.1, "eos_token_id": [2, 3]})
    assert generation_defaults(file) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.1,
                                         "repetition_penalty": 1.05, "max_tokens": 512}
    assert generation_defaults(tmp_path / "missing.json") == {}
    with pytest.raises(ValueError, match="generation_config.json: top_p must be in"):
        generation_defaults(_write(file, {"top_p": 0}))
    file.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        generation_defaults(file)


def test_requests_without_sampling_take_the_checkpoints_defaults_unless_turned_off(checkpoint_factory, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(checkpoint_factory("tiny-dense", "text", seed=3), directory)
    _write(directory / "generation_config.json", {"temperature": 0.0, "max_new_tokens": 3})
    reference = SamplingParams(max_tokens=3, temperature=0.0)
    with Engine.from_pretrained(directory, **OPTIONS) as engine:
        assert engine.sampling_defaults == {"temperature": 0.0, "max_tokens": 3}
        out = engine.generate(PROMPT)
        assert len(out.token_ids) <= 3 and out.token_ids == engine.generate(PROMPT, reference).token_ids
    with Engine.from_pretrained(directory, generation_config="none", **OPTIONS) as engine:
        assert engine.sampling_defaults == {}
        assert len(engine.generate(PROMPT, SamplingParams(ignore_eos=True)).token_ids) == 16
    _write(directory / "generation_config.json", {"temperature": -1})
    with pytest.raises(ValueError, match="generation_config.json: temperature must be in"):
        Engine.from_pretrained(directory, **OPTIONS)


def test_a_generation_config_path_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(OptionsError, match="generation_config .*missing: no such file"):
        EngineOptions(generation_config=str(tmp_path / "missing")).resolve(4096, "cpu")
