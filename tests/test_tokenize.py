"""Exact prompt counts against transformers' apply_chat_template on real tokenizers.

Every test here runs twice: with the fast byte-level BPE path where a model
qualifies, and with `KVGATE_FAST_BPE=0` forcing `tokenizers` everywhere.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main
from proxy.errors import InvalidRequest
from proxy.tokenize import (
    ChatRequest,
    TemplateError,
    TokenCounter,
    TokenizerLoadError,
    load_counter,
)
from proxy.tokenize.bytelevel import ENV_SWITCH
from proxy.tokenize.templates import content_format, read_chat_template
from proxy.validation import parse_chat_file
from tests.support.corpus import WEATHER_TOOL, conversations
from tests.support.reference import hf_count, hf_tokenizer

MODELS = Path(__file__).resolve().parent.parent / "models"
SAMPLE = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And how many people live there? Answer in one sentence."},
]
# (model dir, whether its template renders tools and tool calls)
FAMILIES = [("qwen3-14b", True), ("gpt-oss-20b", True), ("deepseek-v3", False)]


# byte-level BPE families that the fast path must accept
FAST_FAMILIES = {"qwen3-14b", "gpt-oss-20b", "deepseek-v3"}


@pytest.fixture(scope="module", autouse=True, params=["fast", "tokenizers"])
def encoder_path(request: pytest.FixtureRequest) -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_SWITCH, "1" if request.param == "fast" else "0")
        yield request.param


@pytest.fixture(scope="module", params=[f[0] for f in FAMILIES])
def pair(request: pytest.FixtureRequest, encoder_path: str) -> tuple[str, TokenCounter, Any]:
    name: str = request.param
    counter = load_counter(MODELS / name)
    assert isinstance(counter, TokenCounter)
    fast = encoder_path == "fast" and name in FAST_FAMILIES
    assert counter.encoder_description.startswith("fast" if fast else "tokenizers")
    return name, counter, hf_tokenizer(MODELS / name)


def as_chat(req: dict[str, Any]) -> ChatRequest:
    return ChatRequest(
        messages=copy.deepcopy(req["messages"]),
        tools=req.get("tools"),
        add_generation_prompt=req.get("add_generation_prompt", True),
    )


def test_count_equals_transformers_on_corpus(pair: tuple[str, TokenCounter, Any]) -> None:
    name, counter, reference = pair
    tools = dict(FAMILIES)[name]
    corpus = conversations(tools=tools)
    assert len(corpus) >= 30
    mismatches = []
    for i, req in enumerate(corpus):
        ours = counter.count_chat(as_chat(req))
        theirs = hf_count(reference, copy.deepcopy(req))
        if ours != theirs:
            mismatches.append((i, ours, theirs))
    assert mismatches == []
    # the corpus really has long prompts: the 5,000-word one is thousands of tokens
    assert max(counter.count_chat(as_chat(r)) for r in corpus) > 5000


@pytest.mark.parametrize(
    ("name", "expected"), [("qwen3-14b", 44), ("gpt-oss-20b", 103), ("deepseek-v3", 32)]
)
def test_count_sample_conversation_matches_published_counts(name: str, expected: int) -> None:
    assert load_counter(MODELS / name).count_chat(ChatRequest(messages=SAMPLE)) == expected


def test_tool_definition_and_call_are_rendered() -> None:
    counter = load_counter(MODELS / "qwen3-14b")
    plain = counter.count_chat(ChatRequest(messages=[{"role": "user", "content": "hi"}]))
    with_tool = counter.count_chat(
        ChatRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL])
    )
    assert with_tool > plain + 50
    assert "get_weather" in counter.render_chat(
        ChatRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL])
    )


def test_string_tool_arguments_count_like_objects() -> None:
    """OpenAI clients send arguments as a JSON string; engines parse it before rendering."""
    counter = load_counter(MODELS / "qwen3-14b")
    call = conversations(tools=True)[-1]
    as_string = copy.deepcopy(call)
    fn = as_string["messages"][1]["tool_calls"][0]["function"]
    fn["arguments"] = json.dumps(fn["arguments"], ensure_ascii=False)
    assert counter.count_chat(as_chat(as_string)) == counter.count_chat(as_chat(call))


def test_text_parts_count_like_joined_string() -> None:
    counter = load_counter(MODELS / "qwen3-14b")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                          {"type": "text", "text": "world"}]}]
    joined = [{"role": "user", "content": "Hello\nworld"}]
    assert counter.count_chat(ChatRequest(messages=parts)) == counter.count_chat(
        ChatRequest(messages=joined)
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [("qwen3-14b", "string"), ("gpt-oss-20b", "string"), ("deepseek-v3", "string"),
     ("mistral-nemo-instruct-2407", "string"), ("gemma-3-12b-it", "openai")],
)
def test_content_format_is_read_from_the_template_tree(name: str, expected: str) -> None:
    """Gemma 3 loops `for item in message['content']` over `loop_messages = messages[1:]`."""
    config_file = MODELS / name / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template = read_chat_template(MODELS / name, config)
    assert isinstance(template, str)
    assert content_format(template) == expected


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
         "openai"),
        ("{% for m in messages | reverse %}{% for p in m['content'] | list %}{{ p }}"
         "{% endfor %}{% endfor %}", "openai"),
        ("{% set ms = messages %}{% set rest = ms[1:] %}{% for m in rest %}"
         "{% for p in m['content'] %}{{ p }}{% endfor %}{% endfor %}", "openai"),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        # a loop over something else's content is not a message's content
        ("{% for d in documents %}{% for p in d['content'] %}{{ p }}{% endfor %}{% endfor %}",
         "string"),
        ("{% for m in messages %", "string"),
    ],
)
def test_content_format_forms(template: str, expected: str) -> None:
    assert content_format(template) == expected


GEMMA_PARTS = [
    [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                  {"type": "text", "text": "  world  "}]}],
    [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
     {"role": "user", "content": [{"type": "text", "text": "Name"},
                                  {"type": "text", "text": "three rivers."}]},
     {"role": "assistant", "content": [{"type": "text", "text": "Nile, Rhine, Amazon."}]},
     {"role": "user", "content": "And their lengths?"}],
    SAMPLE,
]


@pytest.fixture(scope="module")
def gemma() -> tuple[TokenCounter, Any]:
    counter = load_counter(MODELS / "gemma-3-12b-it")
    assert isinstance(counter, TokenCounter)
    return counter, hf_tokenizer(MODELS / "gemma-3-12b-it")


@pytest.mark.parametrize("index", range(len(GEMMA_PARTS)))
def test_gemma3_content_parts_count_as_transformers(
    gemma: tuple[TokenCounter, Any], index: int
) -> None:
    """Gemma 3's template reads the parts itself (trimming each, no newline between):
    joining them first would add a token per join."""
    counter, reference = gemma
    messages = GEMMA_PARTS[index]
    ours = counter.count_chat(ChatRequest(messages=copy.deepcopy(messages)))
    assert ours == hf_count(reference, {"messages": copy.deepcopy(messages)})


def test_gemma3_sample_conversation_count() -> None:
    # 45: transformers' apply_chat_template on the sample (models/README.md)
    assert load_counter(MODELS / "gemma-3-12b-it").count_chat(ChatRequest(messages=SAMPLE)) == 45


def test_none_valued_keys_are_dropped_before_rendering() -> None:
    counter = load_counter(MODELS / "qwen3-14b")
    with_none = [{"role": "user", "content": "hi", "name": None}]
    assert counter.count_chat(ChatRequest(messages=with_none)) == counter.count_chat(
        ChatRequest(messages=[{"role": "user", "content": "hi"}])
    )


@pytest.mark.parametrize("text", ["The quick brown fox", "", "数学 🌅", "  spaces  "])
def test_plain_prompt_follows_tokenizer_bos_rule(
    pair: tuple[str, TokenCounter, Any], text: str
) -> None:
    _, counter, reference = pair
    assert counter.count_prompt(text) == len(reference(text)["input_ids"])


def test_deepseek_plain_prompt_gets_bos_from_config() -> None:
    counter = load_counter(MODELS / "deepseek-v3")
    # raw tokenizers adds no BOS; transformers adds it from add_bos_token=True
    assert counter.count_prompt("") == 1


def test_token_id_prompt_counts_as_given() -> None:
    counter = load_counter(MODELS / "qwen3-14b")
    assert counter.count_prompt([1, 2, 3, 4, 5]) == 5


def test_tiktoken_encodings_from_local_files() -> None:
    text = "The quick brown fox jumps over the lazy dog. 数学 ∑ x² 🌅 naïve café, 3.14159!"
    assert load_counter(MODELS / "tiktoken", encoding="cl100k_base").count_prompt(text) == 29
    assert load_counter(MODELS / "tiktoken", encoding="o200k_base").count_prompt(text) == 28
    harmony = load_counter(MODELS / "tiktoken", encoding="o200k_harmony")
    # gpt-oss renders with its HF tokenizer; o200k_harmony on the same text agrees.
    rendered = load_counter(MODELS / "gpt-oss-20b").render_chat(ChatRequest(messages=SAMPLE))
    assert harmony._encoder.encode_rendered(rendered).__len__() == 103


def test_tiktoken_from_cache_dir_never_downloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(TokenizerLoadError, match="kvgate never downloads"):
        load_counter("tiktoken:cl100k_base")
    url = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    shutil.copy(MODELS / "tiktoken" / "cl100k_base.tiktoken",
                tmp_path / hashlib.sha1(url.encode()).hexdigest())
    assert load_counter("tiktoken:cl100k_base").count_prompt("hello world") == 2


def test_tiktoken_rank_file_with_wrong_hash_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cl100k_base.tiktoken").write_bytes(b"aGVsbG8= 0\n")
    with pytest.raises(TokenizerLoadError, match="Hash mismatch"):
        load_counter(tmp_path)


def test_count_async_runs_off_the_loop_and_agrees() -> None:
    counter = load_counter(MODELS / "qwen3-14b")
    chat = ChatRequest(messages=SAMPLE)

    async def both() -> tuple[int, int]:
        return await counter.count_chat_async(chat), await counter.count_prompt_async("hi there")

    assert asyncio.run(both()) == (44, counter.count_prompt("hi there"))


# ------------------------------------------------------------------ errors


def template_dir(tmp_path: Path, template: str | list[dict[str, str]]) -> Path:
    (tmp_path / "tokenizer.json").symlink_to(MODELS / "qwen3-14b" / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return tmp_path


def test_template_exception_message_is_passed_through(tmp_path: Path) -> None:
    counter = load_counter(template_dir(
        tmp_path,
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
        "{{ m.content }}{% endfor %}",
    ))
    assert counter.count_chat(ChatRequest(messages=[{"role": "user", "content": "hi"}])) == 1
    with pytest.raises(TemplateError, match="Only user and assistant roles are supported!"):
        counter.count_chat(ChatRequest(messages=[{"role": "system", "content": "x"}]))


def test_named_templates_pick_tool_use_when_tools_given(tmp_path: Path) -> None:
    counter = load_counter(template_dir(tmp_path, [
        {"name": "default", "template": "{{ messages[0].content }}"},
        {"name": "tool_use", "template": "TOOLS {{ tools | tojson }} {{ messages[0].content }}"},
    ]))
    msgs = [{"role": "user", "content": "hi"}]
    assert counter.render_chat(ChatRequest(messages=msgs)) == "hi"
    rendered = counter.render_chat(ChatRequest(messages=msgs, tools=[{"name": "é"}]))
    assert rendered == 'TOOLS [{"name": "é"}] hi'  # tojson: no ASCII escaping


def test_template_sees_special_tokens_and_strftime(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").symlink_to(MODELS / "qwen3-14b" / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ messages[0].content }}{{ eos_token }}{{ strftime_now('%Y') | length }}"
    )
    counter = load_counter(tmp_path)
    assert counter.render_chat(ChatRequest(messages=[{"role": "user", "content": "a"}])) == (
        "a<|im_end|>4"
    )


def test_directory_without_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="has no tokenizer"):
        load_counter(tmp_path)
    (tmp_path / "tekken.json").write_text("{}")
    with pytest.raises(TokenizerLoadError, match="is not a usable tekken tokenizer"):
        load_counter(tmp_path)
    with pytest.raises(TokenizerLoadError, match="does not exist"):
        load_counter(tmp_path / "missing")


def test_model_without_template_refuses_chat(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").symlink_to(MODELS / "qwen3-14b" / "tokenizer.json")
    counter = load_counter(tmp_path)
    with pytest.raises(TemplateError, match="has no chat template"):
        counter.count_chat(ChatRequest(messages=[{"role": "user", "content": "a"}]))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"messages": []}, "`messages` must not be empty"),
        ({"messages": "hi"}, "`messages` must be an array"),
        ({"messages": ["hi"]}, "`messages[0]` must be an object"),
        ({"messages": [{"content": "hi"}]}, "`messages[0].role` must be a non-empty string"),
        ({"messages": [{"role": "user", "content": 5}]}, "`messages[0].content` must be"),
        ({"messages": [{"role": "user"}]}, "`messages[0].content` is required"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text parts only"),
    ],
)
def test_messages_of_wrong_shape_name_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        parse_chat_file(data)


# ------------------------------------------------------------------ CLI


def test_cli_count_json_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": SAMPLE, "add_generation_prompt": True}))
    assert main(["count", "--model-dir", str(MODELS / "qwen3-14b"), "--chat", str(chat),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == 44
    assert main(["count", "--model-dir", str(MODELS / "tiktoken"), "--encoding", "cl100k_base",
                 "--prompt", "hello world"]) == 0
    assert capsys.readouterr().out.strip() == "2"


def test_cli_count_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["count", "--model-dir", str(MODELS / "qwen3-14b"), "--chat", str(bad)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err
    assert main(["count", "--model-dir", str(tmp_path), "--prompt", "x"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


def test_mistral_tekken_counts_as_mistral_common_publishes() -> None:
    counter = load_counter(MODELS / "mistral-nemo-instruct-2407")
    # 32: mistral-common 1.13.1 encode_chat_completion on the sample (models/README.md)
    assert counter.count_chat(ChatRequest(messages=SAMPLE)) == 32
    text = "The quick brown fox jumps over the lazy dog. 数学 ∑ x² 🌅 naïve café, 3.14159!"
    assert counter.count_prompt(text) == 33  # 32 tokens + BOS
    assert counter.count_prompt([5, 6, 7]) == 3
    plain = counter.count_chat(ChatRequest(messages=[{"role": "user", "content": "Weather?"}]))
    with_tool = counter.count_chat(ChatRequest(
        messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL]))
    assert with_tool > plain + 30
    with pytest.raises(TemplateError, match="must start with a user message"):
        counter.count_chat(ChatRequest(messages=[{"role": "assistant", "content": "x"}]))



def test_mistral_final_assistant_message_continues_as_prefix() -> None:
    """vLLM's Mistral mode marks a final assistant message `prefix=True` and continues it
    (no `</s>`); mistral-common on its own refuses such a conversation."""
    from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    counter = load_counter(MODELS / "mistral-nemo-instruct-2407")
    reference = MistralTokenizer.from_file(str(MODELS / "mistral-nemo-instruct-2407" /
                                               "tekken.json"))
    encoded = reference.encode_chat_completion(ChatCompletionRequest(messages=[
        UserMessage(content="Hi"), AssistantMessage(content="Hello, I am", prefix=True)]))
    assert encoded.text == "<s>[INST]Hi[/INST]Hello, I am"
    assert len(encoded.tokens) == 8
    for final in ("Hello, I am", [{"type": "text", "text": "Hello, I am"}]):
        chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": final}]
        assert counter.count_chat(ChatRequest(messages=chat)) == 8
