"""Engine.chat (vLLM's LLM.chat): a conversation rendered with the checkpoint's own template, salted when asked,
generated as that prompt is."""

import pytest

from ninfer_jax import Engine, SamplingParams
from ninfer_jax.frontend import prepare_chat

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MESSAGES = [{"role": "system", "content": "Answer in code."}, {"role": "user", "content": "Add two numbers."}]


@pytest.fixture(scope="module")
def engine():
    engine = Engine.from_pretrained(None, max_concurrency=2, prefill_chunk=64, max_model_len=512, kv_capacity=2048,
                                    warmup=False)
    yield engine
    engine.stop()


def test_chat_generates_the_checkpoints_rendering_of_the_conversation(engine):
    out = engine.chat(MESSAGES, GREEDY, enable_thinking=False)
    prompt = prepare_chat(engine.tokenizer, MESSAGES, enable_thinking=False, template=engine.chat_template,
                          vision=engine.vision)
    assert out.prompt_token_ids == tuple(prompt.token_ids)
    assert out.token_ids == engine.generate(prompt, GREEDY).token_ids
    assert engine.chat(MESSAGES, GREEDY, enable_thinking=False, cache_salt="x").usage.cached_tokens == 0


@pytest.mark.parametrize("given", ["file", "inline"])
def test_a_chat_template_renders_conversations_instead_of_the_checkpoints(tmp_path, given):
    """--chat-template as vLLM takes it: a file, or the template itself."""
    template = tmp_path / "plain.jinja"
    source = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
              "{% if add_generation_prompt %}[assistant] {% endif %}")
    template.write_text(source)
    engine = Engine.from_pretrained(None, max_concurrency=2, prefill_chunk=64, max_model_len=512, kv_capacity=2048,
                                    warmup=False, chat_template=str(template) if given == "file" else source)
    try:
        out = engine.chat(MESSAGES, GREEDY)
        assert engine.tokenizer.decode(list(out.prompt_token_ids)) == (
            "[system] Answer in code.\n[user] Add two numbers.\n[assistant] ")
    finally:
        engine.stop()


def test_a_chat_template_that_cannot_be_read_or_compiled_is_refused_before_loading(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    for given, words in ((str(tmp_path / "missing.jinja"), "No such file"), (str(broken), "does not compile"),
                         ("{% for m in messages %}", "does not compile")):
        with pytest.raises(ValueError, match=words):
            Engine.from_pretrained(None, chat_template=given, warmup=False)
