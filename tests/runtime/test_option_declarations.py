"""The option declarations are the one source: EngineOptions' fields, ninfer-serve's and ninfer-generate's engine
flags, their help, their bounds and their conflicts all come from them."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from ninfer_jax import generate
from ninfer_jax.prefix_cache import options as prefix_cache_options
from ninfer_jax.runtime import options as engine_options
from ninfer_jax.runtime.options import OPTIONS, EngineOptions, OptionsError, engine_kwargs_from_args, flag_words
from ninfer_jax.server import cli
from pallas_kernels import kv_quant

PARSERS = {"ninfer-serve": cli.build_parser, "ninfer-generate": generate.build_parser}


def _engine_actions(parser):
    """Each option's flag (vLLM's names for some are flags of their own, not in the help)."""
    return {action.dest: action for action in parser._actions
            if action.dest in OPTIONS and action.help is not argparse.SUPPRESS}


def test_every_engine_option_is_declared_once_on_its_field():
    assert list(OPTIONS) == [f.name for f in dataclasses.fields(EngineOptions)] == [
        "dtype", "max_concurrency", "scheduling_policy", "prefill_chunk", "idle_prefill_chunk", "mixed_prefill_tokens",
        "kv_capacity", "kv_dtype", "generation_config", "chat_template",
        "load_format", "max_model_len", "kernels", "prefill_attention", "fp8_activations", "speculative",
        "num_speculative_tokens", "adaptive_speculation", "prompt_lookup_max", "prompt_lookup_min", "max_image_tokens",
        "vision_cache_tokens", "interpret", "output_window", "memory_fraction", "compile_threads",
        "background_compile", "prompt_logprobs", "batch_invariant", "seed", "tensor_parallel_size",
        "enable_expert_parallel",
        "no_prefix_reuse",
        "host_cache_mib", "device_snapshot_slots", "max_new_taps",
        "tap_ladder_tokens", "tap_min_gap_tokens",
        "prefix_cache_file", "concurrent_prefill", "cache_policy"]
    for field in dataclasses.fields(EngineOptions):
        assert OPTIONS[field.name].default == field.default
    assert OPTIONS["kv_dtype"].choices == tuple(kv_quant.PROFILES)  # the profiles the kernels store


def test_the_flags_are_the_spec_names():
    assert {o.flag: name for name, o in OPTIONS.items() if o.flag} == {
        "--dtype": "dtype", "--max-concurrency": "max_concurrency", "--scheduling-policy": "scheduling_policy",
        "--prefill-chunk": "prefill_chunk",
        "--idle-prefill-chunk": "idle_prefill_chunk", "--mixed-prefill-tokens": "mixed_prefill_tokens",
        "--kv-capacity": "kv_capacity", "--kv-dtype": "kv_dtype",
        "--max-model-len": "max_model_len", "--kernels": "kernels", "--prefill-attention": "prefill_attention",
        "--fp8-activations": "fp8_activations", "--speculative": "speculative",
        "--num-speculative-tokens": "num_speculative_tokens", "--adaptive-speculation": "adaptive_speculation",
        "--prompt-lookup-max": "prompt_lookup_max",
        "--prompt-lookup-min": "prompt_lookup_min", "--load-format": "load_format",
        "--generation-config": "generation_config", "--chat-template": "chat_template",
        "--max-image-tokens": "max_image_tokens", "--vision-cache-tokens": "vision_cache_tokens",
        "--compile-threads": "compile_threads",
        "--background-compile": "background_compile", "--prompt-logprobs": "prompt_logprobs",
        "--batch-invariant": "batch_invariant", "--seed": "seed", "--tensor-parallel-size": "tensor_parallel_size",
        "--enable-expert-parallel": "enable_expert_parallel", "--no-prefix-reuse": "no_prefix_reuse",
        "--host-cache-mib": "host_cache_mib", "--device-snapshot-slots": "device_snapshot_slots",
        "--cache-taps-per-request": "max_new_taps", "--cache-tap-ladder": "tap_ladder_tokens",
        "--cache-tap-min-gap": "tap_min_gap_tokens", "--prefix-cache-file": "prefix_cache_file",
        "--concurrent-prefill": "concurrent_prefill"}
    # vLLM's flags for the same settings, so its command lines carry over
    assert {o.vllm_flag: name for name, o in OPTIONS.items() if o.vllm_flag} == {
        "--max-num-seqs": "max_concurrency", "--kv-cache-dtype": "kv_dtype"}
    for prog in sorted(PARSERS):
        args = PARSERS[prog]().parse_args(["--max-num-seqs", "64", "--kv-cache-dtype", "fp8"])
        assert (args.max_concurrency, args.kv_dtype) == (64, "fp8")


def test_both_command_lines_take_the_same_engine_flags_with_the_declared_help():
    serve, gen = _engine_actions(cli.build_parser()), _engine_actions(generate.build_parser())
    assert serve.keys() == gen.keys() == {name for name, o in OPTIONS.items() if o.flag}
    for name, action in serve.items():
        assert action.option_strings[0] == gen[name].option_strings[0] == OPTIONS[name].flag
        assert action.help == gen[name].help == OPTIONS[name].help_text()
        assert action.default is None and gen[name].default is None  # unset: the engine's default or rule


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_help_shows_every_default_in_plain_words(prog, capsys):
    with pytest.raises(SystemExit):
        PARSERS[prog]().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--max-concurrency N requests decoded together (lanes, spec C), 1..256; default auto: on a GPU "
                  "the most lanes (at most 256) whose state slots (C + D) and 8192 KV tokens each",
                  "4 on a CPU",
                  "default 2048, or 8192 for a model with routed experts",
                  "default 32768 for a model with routed experts, else the prefill chunk",
                  "default the model's limit, at most 32768",
                  "0: device memory only; default auto: 0.25 x the memory available at startup, at most 65536 "
                  "(8192 where the machine does not say)",
                  "(in-flight coalescing, spec §12.2); default on",
                  "default lanes + 1 with host memory, lanes + 2 without (C+1 / C+2)",
                  "default 8 with host memory, 2 without",
                  "default max(4096, 2 x prefill chunk)",
                  "default max(1024, prefill chunk)",
                  "default auto: one per CPU core the process may use, at most 8",
                  "auto: float32 on a CPU, bfloat16 on a GPU; default auto"):
        assert shown in text


def test_both_command_lines_leave_the_context_length_to_the_engine():
    for build in PARSERS.values():
        assert engine_kwargs_from_args(build().parse_args([])) == {}
    assert EngineOptions().resolve(262144).max_model_len == 32768  # min(the model's limit, 32768)
    assert EngineOptions().resolve(4096).max_model_len == 4096


def _bound_cases():
    for name, option in OPTIONS.items():
        if option.flag is None or option.kind is not int:
            continue
        low = option.minimum
        values = {low - 1, low, low + 1}
        if option.maximum is not None:
            values |= {option.maximum, option.maximum + 1}
        if option.multiple_of:
            values |= {low + option.multiple_of // 2, low + option.multiple_of}
        for value in sorted(values):
            yield name, value


# Options that mean something only beside another
COMPANIONS = {"num_speculative_tokens": {"speculative": "ngram"}}


@pytest.mark.parametrize("name, value", list(_bound_cases()))
def test_the_command_lines_and_engine_options_agree_on_every_bound(name, value, capsys):
    try:
        EngineOptions(**{name: value, **COMPANIONS.get(name, {})}).check_conflicts()
        library = True
    except OptionsError as error:
        assert str(error).startswith(f"{name} must be")
        library = False
    for prog, build in PARSERS.items():
        try:
            build().parse_args([OPTIONS[name].flag, str(value)])
            command_line = True
        except SystemExit:
            assert f"argument {OPTIONS[name].flag}: must be" in capsys.readouterr().err
            command_line = False
        assert command_line == library, prog


def test_the_declared_bounds():
    def accepted(name, values):
        return [v for v in values if OPTIONS[name].problem(v) is None]

    assert accepted("max_concurrency", ["auto", *range(-1, 260)]) == ["auto", *range(1, 257)]
    assert accepted("prefill_chunk", range(0, 260, 32)) == [64, 128, 192, 256]
    assert accepted("host_cache_mib", (-1, 0, 1)) == [0, 1]
    assert accepted("kv_capacity", ("auto", "all", 0, 1)) == ["auto", 1]
    assert accepted("tap_ladder_tokens", (None, 63, 64)) == [None, 64]


@pytest.mark.parametrize("argv", [
    ["--no-prefix-reuse", "--host-cache-mib", "64", "--cache-taps-per-request", "2"],
    ["--prefix-cache-file", "x.cache", "--host-cache-mib", "0"],
    ["--kernels", "reference", "--prefill-attention", "cudnn"],
    ["--dtype", "float32", "--prefill-attention", "cudnn"],
    ["--prefill-chunk", "4096", "--idle-prefill-chunk", "2048"],
    ["--cache-tap-ladder", "1024", "--cache-tap-min-gap", "2048"],
    ["--tensor-parallel-size", "2", "--kernels", "pallas"],
    ["--enable-expert-parallel"],
])
def test_the_command_lines_refuse_what_engine_options_refuse_in_the_same_words(argv):
    args = cli.build_parser().parse_args(argv)
    given = {name: getattr(args, name) for name in OPTIONS if getattr(args, name, None) is not None}
    with pytest.raises(OptionsError) as library:
        EngineOptions(**given).check_conflicts()
    with pytest.raises(OptionsError) as command_line:
        engine_kwargs_from_args(args)
    assert str(command_line.value) == flag_words(str(library.value))
    assert "--" in str(command_line.value) and "--" not in str(library.value)


def test_flag_words_writes_names_as_flags_but_not_inside_paths_or_longer_names():
    assert flag_words("idle_prefill_chunk must be at least prefill_chunk (2048)") == \
        "--idle-prefill-chunk must be at least --prefill-chunk (2048)"
    assert flag_words("max_new_taps and tap_min_gap_tokens; interpret") == \
        "--cache-taps-per-request and --cache-tap-min-gap; interpret"  # interpret has no flag
    assert flag_words("prefix_cache_file /tmp/kernels/max_new_taps.cache is a directory") == \
        "--prefix-cache-file /tmp/kernels/max_new_taps.cache is a directory"


def test_ninfer_generate_refuses_conflicts_with_status_2_before_loading(capsys, monkeypatch):
    monkeypatch.setattr(generate.Engine, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(SystemExit) as stopped:
        generate.main(["--no-prefix-reuse", "--cache-tap-ladder", "4096"])
    assert stopped.value.code == 2
    assert "--no-prefix-reuse conflicts with --cache-tap-ladder" in capsys.readouterr().err


def test_ninfer_generate_refuses_an_image_file_that_is_not_an_image_before_loading(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(generate.Engine, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    (tmp_path / "notes.txt").write_text("not a picture")
    with pytest.raises(SystemExit) as stopped:
        generate.main(["--image", str(tmp_path / "notes.txt"), "Describe it."])
    assert stopped.value.code == 2 and "--image " in capsys.readouterr().err


def test_ninfer_generate_passes_on_only_the_given_engine_flags(monkeypatch):
    seen = {}

    def from_pretrained(path, **kwargs):
        seen.update(path=path, **kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(generate.Engine, "from_pretrained", from_pretrained)
    monkeypatch.setattr(generate, "enable_compile_cache", lambda folder: None)
    with pytest.raises(RuntimeError, match="stop here"):
        generate.main(["--max-concurrency", "2", "--cache-taps-per-request", "3", "--dtype", "float32"])
    assert seen == {"path": None, "max_concurrency": 2, "max_new_taps": 3, "dtype": "float32"}


def test_the_default_rules_live_in_the_prefix_cache_package():
    # scripts import them from the runtime's options module
    assert engine_options.default_snapshot_slots is prefix_cache_options.default_snapshot_slots
    assert engine_options.default_max_new_taps is prefix_cache_options.default_max_new_taps
    assert [prefix_cache_options.default_snapshot_slots(4, host) for host in (True, False)] == [5, 6]
    assert [prefix_cache_options.default_max_new_taps(host) for host in (True, False)] == [8, 2]
    assert [prefix_cache_options.default_tap_ladder_tokens(c) for c in (1024, 8192)] == [4096, 16384]
    assert [prefix_cache_options.default_tap_min_gap_tokens(c) for c in (512, 8192)] == [1024, 8192]
