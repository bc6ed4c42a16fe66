"""The fast byte-level BPE path and the count cache: exact against the references.

References: `tokenizers` for token ids, transformers' `apply_chat_template` for chat
counts. The fast path must give the same ids on the whole corpus and on fuzzed text;
the count cache must not change any count; a tokenizer that differs structurally
keeps `tokenizers`.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import random
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.cli import main
from proxy.metrics import Metrics
from proxy.tokenize import ChatRequest, TokenCounter, encoders, load_counter
from proxy.tokenize.bytelevel import (
    ENV_SWITCH,
    PROBES,
    ByteLevelBPEEncoder,
    plan_fast_bpe,
    try_fast,
)
from proxy.tokenize.cache import MIN_CACHED_CHARS, CountCache
from proxy.tokenize.counting import INLINE_MESSAGES, INLINE_NEW_CHARS, INLINE_RENDERED_CHARS
from proxy.tokenize.encoders import HFEncoder, SpecialSplitter, hf_added_tokens
from tests.support.corpus import conversations
from tests.support.reference import hf_count, hf_tokenizer

MODELS = Path(__file__).resolve().parent.parent / "models"
FAST = ["qwen3-14b", "gpt-oss-20b", "deepseek-v3"]


def counter_for(name: str, **kw: Any) -> TokenCounter:
    counter = load_counter(MODELS / name, **kw)
    assert isinstance(counter, TokenCounter)
    return counter


@functools.cache
def shared(name: str) -> TokenCounter:
    """One counter per model for the fuzz tests (loading takes a good fraction of a second)."""
    return counter_for(name)


@pytest.fixture(scope="module", params=FAST)
def fast_pair(request: pytest.FixtureRequest) -> tuple[ByteLevelBPEEncoder, HFEncoder]:
    encoder = counter_for(request.param)._encoder
    assert isinstance(encoder, ByteLevelBPEEncoder)
    return encoder, encoder._ref


@pytest.fixture(scope="module")
def qwen_json() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((MODELS / "qwen3-14b" / "tokenizer.json").read_text())
    return data


# ------------------------------------------------------------------ which path


def test_fast_path_is_taken_for_byte_level_families() -> None:
    for name in FAST:
        assert counter_for(name).encoder_description.startswith("fast byte-level BPE")


def nfkc_model(tmp_path: Path, qwen_json: dict[str, Any]) -> Path:
    """Qwen3's files with an NFKC normalizer, which tiktoken's core cannot reproduce."""
    (tmp_path / "tokenizer.json").write_text(
        json.dumps(_mutated(qwen_json, ("normalizer",), {"type": "NFKC"})))
    (tmp_path / "tokenizer_config.json").symlink_to(
        MODELS / "qwen3-14b" / "tokenizer_config.json")
    return tmp_path


def test_unsupported_structure_keeps_tokenizers_and_says_why(
    tmp_path: Path, qwen_json: dict[str, Any]
) -> None:
    counter = load_counter(nfkc_model(tmp_path, qwen_json))
    assert counter.encoder_description == (
        "tokenizers (fast path off: normalizer 'NFKC' is not NFC)"
    )
    assert counter.count_chat(ChatRequest(messages=[{"role": "user", "content": "ﬁ ½"}])) == (
        hf_count(hf_tokenizer(tmp_path), {"messages": [{"role": "user", "content": "ﬁ ½"}]}))


def test_env_switch_off_forces_tokenizers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert counter_for("qwen3-14b").encoder_description == (
        f"tokenizers (fast path off: {ENV_SWITCH}=0)"
    )


def test_check_config_names_each_models_counting_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], qwen_json: dict[str, Any]
) -> None:
    (tmp_path / "nfkc").mkdir()
    model = nfkc_model(tmp_path / "nfkc", qwen_json)
    config = tmp_path / "kvgate.toml"
    config.write_text(tomli_w.dumps({"models": [
        {"name": name, "path": str(path), "max_model_len": 8192,
         "deployment": {"kv_tokens": 100_000},
         "backends": [{"name": backend, "url": "http://127.0.0.1:9"}]}
        for name, path, backend in (("qwen", MODELS / "qwen3-14b", "a"), ("nfkc", model, "b"))
    ]}))
    assert main(["check-config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "counting: fast byte-level BPE (tiktoken core)" in out
    assert "counting: tokenizers (fast path off: normalizer 'NFKC' is not NFC)" in out
    bounds = [line.strip() for line in out.splitlines() if "prompt bound" in line]
    assert bounds == [
        "prompt bound for admission: UTF-8 bytes of the rendered chat, ASCII text only (NFC)",
        "prompt bound for admission: none (counted before admission)"]


# ------------------------------------------------------------------ segment additivity

METASPACE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "[INST]{{ m['content'] }}[/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)
METASPACE_CHATS = [
    [{"role": "user", "content": "hello world"},
     {"role": "assistant", "content": "the quick brown fox jumps over the lazy dog"},
     {"role": "user", "content": " hello there, how are you?"}],
    [{"role": "user", "content": "\nthe lazy dog\n"}, {"role": "assistant", "content": "fox"}],
]


def metaspace_model(tmp_path: Path, prepend_scheme: str, *, nested: bool = False) -> Path:
    """A small BPE trained here, with Mistral v0.3's pre-tokenizer shape: Metaspace,
    "▁" prepended per `prepend_scheme`, and [INST] [/INST] as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    tok.pre_tokenizer = pre_tokenizers.Sequence([metaspace]) if nested else metaspace
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world",
              "hello there, how are you?"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.add_special_tokens(["[INST]", "[/INST]"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": METASPACE_TEMPLATE}))
    return tmp_path


def assert_counts_as_tokenizers(model: Path) -> TokenCounter:
    """kvgate's chat count is `tokenizers`' count of the same rendered text, and
    transformers' `apply_chat_template` count."""
    from tokenizers import Tokenizer

    counter = counter_for(str(model))
    reference = Tokenizer.from_file(str(model / "tokenizer.json"))
    transformers_tok = hf_tokenizer(model)
    for messages in METASPACE_CHATS:
        chat = ChatRequest(messages=copy.deepcopy(messages))
        rendered = counter.render_chat(chat)
        expected = len(reference.encode(rendered, add_special_tokens=False).ids)
        for _ in range(2):  # the second count may come from the cache
            assert counter.count_chat(chat) == expected, rendered
        assert expected == hf_count(transformers_tok, {"messages": copy.deepcopy(messages)})
    return counter


@pytest.mark.parametrize("nested", [False, True])
def test_metaspace_prepend_first_counts_the_whole_text(tmp_path: Path, nested: bool) -> None:
    """`prepend_scheme: "first"` prepends "▁" only at offset 0 of the whole text: the
    text after [INST] encodes differently on its own, so kvgate must not split there."""
    from tokenizers import Tokenizer

    model = metaspace_model(tmp_path, "first", nested=nested)
    reference = Tokenizer.from_file(str(model / "tokenizer.json"))
    text = "[INST]hello world[/INST]the quick brown fox"
    whole = len(reference.encode(text, add_special_tokens=False).ids)
    segments = 2 + sum(len(reference.encode(t, add_special_tokens=False).ids)
                       for t in ("hello world", "the quick brown fox"))
    assert whole > segments  # the undercount that splitting would give

    counter = assert_counts_as_tokenizers(model)
    assert counter.count_prompt(text) == whole
    assert counter.encoder_description == (
        "tokenizers (fast path off: it needs segment splitting); segment splitting off "
        "(prompts encoded whole): the Metaspace pre-tokenizer prepends '▁' only at the "
        "start of the whole text (prepend_scheme 'first')")


def test_additivity_probe_alone_turns_splitting_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the structural rule, the load-time probe still finds the difference."""
    monkeypatch.setattr(encoders, "_metaspace_first", lambda pre: False)
    counter = assert_counts_as_tokenizers(metaspace_model(tmp_path, "first"))
    assert counter.encoder_description.endswith(
        "segment splitting off (prompts encoded whole): "
        "text next to an added token encodes differently on its own")


def test_metaspace_prepend_always_keeps_splitting(tmp_path: Path) -> None:
    """`prepend_scheme: "always"` marks every segment alike: additive, so it splits."""
    counter = assert_counts_as_tokenizers(metaspace_model(tmp_path, "always"))
    assert isinstance(counter._encoder, HFEncoder)
    assert counter._encoder.splitter is not None
    assert "segment splitting off" not in counter.encoder_description


@pytest.mark.parametrize("name", ["qwen3-14b", "gpt-oss-20b", "deepseek-v3", "gemma-3-12b-it"])
def test_bundled_models_pass_the_additivity_probe(name: str) -> None:
    counter = counter_for(name)
    assert "segment splitting off" not in counter.encoder_description
    encoder = counter._encoder
    reference = encoder._ref if isinstance(encoder, ByteLevelBPEEncoder) else encoder
    assert isinstance(reference, HFEncoder) and reference.splitter is not None


# ------------------------------------------------------------------ added-token splitting


def alternation_split(tokens: dict[str, int], text: str) -> list[str | int]:
    """The splitter as it was: one alternation of every token, longest first."""
    pattern = re.compile("|".join(map(re.escape, sorted(tokens, key=lambda t: (-len(t), t)))))
    out: list[str | int] = []
    pos = 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            out.append(text[pos:m.start()])
        out.append(tokens[m.group()])
        pos = m.end()
    if pos < len(text):
        out.append(text[pos:])
    return out


@functools.cache
def added_tokens(name: str) -> dict[str, int]:
    data = json.loads((MODELS / name / "tokenizer.json").read_text())
    tokens = hf_added_tokens(data)
    assert tokens
    return tokens


SPLIT_MODELS = ["deepseek-v3", "qwen3-14b", "gpt-oss-20b", "gemma-3-12b-it"]


def near_token_text(rng: random.Random, tokens: list[str]) -> str:
    """Whole tokens, their prefixes and suffixes, characters they use, and words."""
    alphabet = sorted({ch for t in tokens for ch in t})
    parts = []
    for _ in range(rng.randint(0, 30)):
        token = rng.choice(tokens)
        kind = rng.randrange(6)
        if kind == 0:
            parts.append(token)
        elif kind == 1:
            parts.append(token[:rng.randint(1, len(token))])
        elif kind == 2:
            parts.append(token[rng.randint(0, len(token) - 1):])
        elif kind == 3:
            parts.append("".join(rng.choices(alphabet, k=rng.randint(1, 6))))
        elif kind == 4:
            parts.append(rng.choice(["<div>", " ", "\n", "hello", "<", "|", "｜", "<|", "▁"]))
        else:
            other = rng.choice(tokens)
            parts.append(token[:rng.randint(0, len(token))] + other[rng.randint(0, len(other)):])
    return "".join(parts)


@pytest.mark.parametrize("name", SPLIT_MODELS)
def test_splitter_splits_as_the_longest_first_alternation(name: str) -> None:
    tokens = added_tokens(name)
    splitter = SpecialSplitter(tokens)
    rng = random.Random(name)
    ordered = sorted(tokens)
    sample = rng.sample(ordered, min(300, len(ordered)))
    texts = [near_token_text(rng, ordered) for _ in range(1000)] + sample + [
        "".join(sample), "<div>hello</div>\n" * 100]
    mismatches = [ascii(t) for t in texts if splitter.split(t) != alternation_split(tokens, t)]
    assert mismatches == []


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_splitter_splits_as_the_alternation_on_fuzzed_text(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(SPLIT_MODELS))
    tokens = added_tokens(name)
    ordered = sorted(tokens)
    piece = st.one_of(
        st.sampled_from(ordered),
        st.builds(lambda t, k: t[:k], st.sampled_from(ordered), st.integers(1, 40)),
        st.builds(lambda t, k: t[k:], st.sampled_from(ordered), st.integers(0, 40)),
        st.text(alphabet=sorted({ch for t in ordered for ch in t}), max_size=6),
        st.text(max_size=4),
    )
    text = data.draw(st.lists(piece, max_size=25).map("".join))
    assert SpecialSplitter(tokens).split(text) == alternation_split(tokens, text)


def test_splitter_matches_tokenizers_on_its_added_tokens() -> None:
    """Both agree with `tokenizers` itself, which finds added tokens leftmost-longest."""
    encoder = counter_for("qwen3-14b")._encoder
    assert isinstance(encoder, ByteLevelBPEEncoder)
    tokens = added_tokens("qwen3-14b")
    rng = random.Random(7)
    for _ in range(300):
        text = near_token_text(rng, sorted(tokens))
        ids = encoder._ref.encode_rendered(text)
        split = encoder.split_rendered(text)
        assert [p for p in split if isinstance(p, int)] == [i for i in ids if i in
                                                            tokens.values()], ascii(text)


# ------------------------------------------------------------------ structure


def _mutated(data: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(data)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        (("normalizer",), {"type": "NFKC"}, "normalizer 'NFKC' is not NFC"),
        (("model", "dropout"), 0.1, "BPE dropout or byte fallback"),
        (("model", "byte_fallback"), True, "BPE dropout or byte fallback"),
        (("model", "continuing_subword_prefix"), "##", "subword prefixes"),
        (("pre_tokenizer",), {"type": "ByteLevel", "add_prefix_space": False,
                              "use_regex": True}, "pre-tokenizer is not Split(regex)"),
        # a Split Python would run itself, with `\s` (Python and Oniguruma disagree on it)
        (("pre_tokenizer",), {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Isolated",
             "invert": False},
            {"type": "Split", "pattern": {"Regex": "\\p{L}+|\\s+"}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]},
         "pre-tokenizer is not Split(regex)"),
    ],
)
def test_plan_refuses_structures_tiktoken_cannot_reproduce(
    qwen_json: dict[str, Any], path: tuple[str, ...], value: Any, reason: str
) -> None:
    data = _mutated(qwen_json, path, value)
    plan = plan_fast_bpe(data, hf_added_tokens(data))
    assert isinstance(plan, str) and reason in plan


def test_plan_refuses_merges_out_of_id_order(qwen_json: dict[str, Any]) -> None:
    merges = list(qwen_json["model"]["merges"])
    merges[10], merges[20] = merges[20], merges[10]
    data = _mutated(qwen_json, ("model", "merges"), merges)
    assert plan_fast_bpe(data, hf_added_tokens(data)) == (
        "merge order and vocab ids disagree (tiktoken merges by id)"
    )


def test_plan_refuses_stripping_added_tokens(qwen_json: dict[str, Any]) -> None:
    data = copy.deepcopy(qwen_json)
    data["added_tokens"][1]["lstrip"] = True
    assert hf_added_tokens(data) is None
    assert "strips whitespace" in str(plan_fast_bpe(data, None))


def test_qwen_merge_ids_follow_merge_order_and_vocab_is_complete(
    qwen_json: dict[str, Any]
) -> None:
    """The property the fast path rests on, stated for the bundled Qwen3 file."""
    model = qwen_json["model"]
    vocab = model["vocab"]
    merged = [vocab[a + b] for a, b in model["merges"]]
    assert merged == sorted(merged)
    assert len(model["merges"]) == len(vocab) - 256  # one merge per non-byte token


def test_vocab_entry_that_cannot_merge_to_itself_keeps_tokenizers(
    tmp_path: Path, qwen_json: dict[str, Any]
) -> None:
    data = copy.deepcopy(qwen_json)
    del data["model"]["merges"][1000]  # its token stays in the vocab, unreachable by merges
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    reference = HFEncoder(path, add_bos_token=None, bos_token=None, tokenizer_json=data)
    fast, why = try_fast(path, data, reference)
    assert fast is None
    assert why == "a vocab entry does not merge to itself and ignore_merges is off"


def test_probe_mismatch_keeps_tokenizers(
    tmp_path: Path, qwen_json: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(qwen_json))
    reference = HFEncoder(path, add_bos_token=None, bos_token=None, tokenizer_json=qwen_json)
    real = reference.encode_rendered
    monkeypatch.setattr(reference, "encode_rendered",
                        lambda text: [*real(text), 0] if "東京" in text else real(text))
    fast, why = try_fast(path, qwen_json, reference)
    assert fast is None
    assert why == "self-check: probe 1 encodes differently"


# ------------------------------------------------------------------ equality


def test_fast_equals_tokenizers_on_corpus_and_probes(
    fast_pair: tuple[ByteLevelBPEEncoder, HFEncoder]
) -> None:
    fast, reference = fast_pair
    counter_texts = [
        json.dumps(req, ensure_ascii=False) for req in conversations(tools=True)
    ] + [m["content"] for req in conversations(tools=True) for m in req["messages"]
         if isinstance(m.get("content"), str)] + list(PROBES)
    assert len(counter_texts) > 100
    for text in counter_texts:
        assert fast.encode_rendered(text) == reference.encode_rendered(text)
        for bos in (False, True):
            assert fast.encode_plain(text, add_special_tokens=bos) == reference.encode_plain(
                text, add_special_tokens=bos)


# Found by the scans below: the mark order NFC gives depends on the Unicode version
# (Python 3.11 knows U+1AC0's combining class, `tokenizers`' tables do not), and
# digits newer than Python's tables (U+11DE0) that the `regex` package calls \p{N}.
UNICODE_EDGES = ["A\u1dd9\u1ac0", "x\u1ac0\u1dd9y", "  \U00012475", "a\U00011de0\U00011de1 1",
                 "\U0001246f\U00012550 9"]


def test_fast_equals_tokenizers_on_unicode_version_edges(
    fast_pair: tuple[ByteLevelBPEEncoder, HFEncoder]
) -> None:
    fast, reference = fast_pair
    for text in UNICODE_EDGES:
        assert fast.encode_rendered(text) == reference.encode_rendered(text), ascii(text)


def test_fast_equals_tokenizers_on_sampled_code_points(
    fast_pair: tuple[ByteLevelBPEEncoder, HFEncoder]
) -> None:
    """Every 13th code point above ASCII, alone, doubled, and between letters, digits
    and spaces (every code point passes too; that scan takes half a minute a model)."""
    fast, reference = fast_pair
    texts = [f"a{c} {c}1  {c}\n{c}{c}" for c in map(chr, range(0x80, 0x110000, 13))
             if not 0xD800 <= ord(c) <= 0xDFFF]
    expected = [e.ids for e in reference.tokenizer.encode_batch(texts,
                                                                add_special_tokens=False)]
    mismatches = [ascii(t) for t, ids in zip(texts, expected, strict=True)
                  if fast.encode_rendered(t) != ids]
    assert mismatches == []


def test_fast_equals_tokenizers_on_random_unicode(
    fast_pair: tuple[ByteLevelBPEEncoder, HFEncoder]
) -> None:
    """Random runs from every plane, with whitespace between: 3,000 texts."""
    fast, reference = fast_pair
    rng = random.Random(5)
    planes = [(0x20, 0x7E), (0xA0, 0x2FFF), (0x3000, 0xFFFF), (0x10000, 0x10FFFF)]
    texts = []
    for _ in range(3000):
        parts = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = planes[min(3, int(rng.random() * 4))]
            cp = rng.randint(lo, hi)
            if 0xD800 <= cp <= 0xDFFF:
                continue
            parts.append(chr(cp) * rng.choice([1, 1, 2, 5]))
            if rng.random() < 0.3:
                parts.append(rng.choice([" ", "  ", "\n", "\r\n", "\t", " \n "]))
        texts.append("".join(parts))
    mismatches = [ascii(t) for t in texts
                  if fast.encode_rendered(t) != reference.encode_rendered(t)]
    assert mismatches == []


def test_lone_surrogate_fails_as_tokenizers_fails(
    fast_pair: tuple[ByteLevelBPEEncoder, HFEncoder]
) -> None:
    """JSON may carry a lone surrogate; both paths refuse it the same way."""
    fast, reference = fast_pair
    for text in ("a\ud800b", "é\udfff"):
        with pytest.raises(TypeError) as theirs:
            reference.encode_rendered(text)
        with pytest.raises(TypeError) as ours:
            fast.encode_rendered(text)
        assert str(ours.value) == str(theirs.value)


PIECES = [
    "😀", "🏳️\u200d🌈", "👩\u200d💻", "🇯🇵", "東京", "数学", "한국어", "Привет", "مرحبا",
    "e\u0301", "a\u0308", "\u0338", ">\u0338", "A\u030a", "\u212b", "ﬁ", "½",
    " ", "  ", "\t", "\n", "\r\n", "\r", "\n\n\n", "   \n", "\u00a0", "\u3000", "\u2028",
    "0", "123", "4567", "3.14", "١٢", "１２", "'s", "'LL", "don't",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</tool_call>",
    "<|start|>", "<|message|>", "<|im", "|>", "<｜User｜>",
    "12345", "a1b2c3", "x²³", "東京タワー", "ひらがなカタカナ", "漢字123", "Ⅻ", "①",
    "the", "The", "HELLO", "café", "naïve", "x²", "{\"a\": 1}", "```", "->", "...",
]
fuzz_text = st.lists(
    st.one_of(st.sampled_from(PIECES), st.text(max_size=8),
              st.builds(lambda c, n: c * n, st.sampled_from([" ", "\n", "a", "1", "-", "🙂"]),
                        st.integers(1, 300))),
    max_size=40,
).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=fuzz_text)
def test_fast_equals_tokenizers_on_fuzzed_text(text: str) -> None:
    for name in FAST:
        encoder = shared(name)._encoder
        assert isinstance(encoder, ByteLevelBPEEncoder)
        assert encoder.encode_rendered(text) == encoder._ref.encode_rendered(text)
        assert encoder.encode_plain(text, add_special_tokens=True) == (
            encoder._ref.encode_plain(text, add_special_tokens=True))


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    return {name: hf_tokenizer(MODELS / name) for name in ("qwen3-14b", "deepseek-v3")}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(system=fuzz_text, user=fuzz_text)
def test_chat_count_equals_transformers_on_fuzzed_messages(
    references: dict[str, Any], system: str, user: str
) -> None:
    """Through the count cache and the fast path, which DeepSeek takes with chained Splits."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    for name, reference in references.items():
        counter = shared(name)
        for _ in range(2):  # the second count comes from the cache
            ours = counter.count_chat(ChatRequest(messages=copy.deepcopy(messages)))
            assert ours == hf_count(reference, {"messages": copy.deepcopy(messages)})


# ------------------------------------------------------------------ cache


def test_deepseek_pre_splits_digits_and_cjk_as_tokenizers_does() -> None:
    encoder = counter_for("deepseek-v3")._encoder
    assert isinstance(encoder, ByteLevelBPEEncoder)
    assert encoder._pieces("ab 1234567 東京タワーx  9") == [
        "ab ", "123", "456", "7", " ", "東京タワー", "x  ", "9"]
    text = "ab 1234567 東京タワーx  9"
    assert encoder.encode_rendered(text) == encoder._ref.encode_rendered(text)


@pytest.mark.parametrize("name", ["qwen3-14b", "deepseek-v3", "gpt-oss-20b"])
def test_cache_never_changes_a_count(name: str) -> None:
    cached = counter_for(name)
    uncached = counter_for(name, cache_bytes=0)
    assert uncached.cache_stats() is None
    corpus = conversations(tools=name != "deepseek-v3")
    for _ in range(2):
        for req in corpus:
            chat = ChatRequest(messages=copy.deepcopy(req["messages"]), tools=req.get("tools"),
                               add_generation_prompt=req.get("add_generation_prompt", True))
            assert cached.count_chat(chat) == uncached.count_chat(chat) == len(
                uncached.chat_token_ids(chat))
    stats = cached.cache_stats()
    assert stats is not None and stats.hits >= stats.misses > 0


def test_shared_system_prompt_is_counted_once() -> None:
    counter = counter_for("qwen3-14b")
    system = "You are a careful assistant. " * 40
    for i in range(5):
        counter.count_chat(ChatRequest(messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": f"question {i}: " + "why? " * 20},
        ]))
    stats = counter.cache_stats()
    assert stats is not None
    # the system segment: one miss then four hits; each new user segment: a miss
    assert (stats.hits, stats.misses) == (4, 6)


def test_cache_evicts_least_recent_past_its_byte_bound() -> None:
    cache = CountCache(max_bytes=2000)
    segments = [chr(65 + i) * 400 for i in range(6)]
    for i, segment in enumerate(segments):
        cache.put(segment, i)
        assert cache.get(segments[0]) == 0  # kept hot, never evicted
        assert cache.stats().size_bytes <= 2000
    assert cache.get(segments[1]) is None  # the coldest went first
    assert cache.get(segments[-1]) == 5


def test_short_segments_are_not_cached() -> None:
    counter = counter_for("qwen3-14b")
    counter.count_chat(ChatRequest(messages=[{"role": "user", "content": "x" * (
        MIN_CACHED_CHARS - 10)}]))
    stats = counter.cache_stats()
    assert stats is not None and (stats.hits, stats.misses, stats.entries) == (0, 0, 0)


def test_cache_metrics_are_exported_per_model() -> None:
    counter = counter_for("qwen3-14b")
    metrics = Metrics()
    metrics.watch_count_cache("qwen3-14b", counter.cache_stats)
    chat = ChatRequest(messages=[{"role": "user", "content": "tell me more " * 20}])
    counter.count_chat(chat)
    counter.count_chat(chat)
    text = metrics.render().decode()
    assert 'kvgate_count_cache_hits_total{model="qwen3-14b"} 1.0' in text
    assert 'kvgate_count_cache_misses_total{model="qwen3-14b"} 1.0' in text
    assert 'kvgate_count_cache_bytes{model="qwen3-14b"}' in text


def test_async_count_agrees_inline_and_in_the_pool() -> None:
    counter = counter_for("qwen3-14b")
    short = ChatRequest(messages=[{"role": "user", "content": "hello there"}])
    long = ChatRequest(messages=[{"role": "user", "content": "word " * INLINE_NEW_CHARS}])
    many = ChatRequest(messages=[{"role": "user", "content": f"turn {i}"}
                                 for i in range(INLINE_MESSAGES + 1)])

    async def counts() -> list[int]:
        return [await counter.count_chat_async(c) for c in (short, long, many)]

    expected = [counter_for("qwen3-14b", cache_bytes=0).count_chat(c)
                for c in (short, long, many)]
    assert asyncio.run(counts()) == expected


def test_long_rendered_prompt_is_split_in_the_pool_even_when_cached(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Splitting a prompt of megabytes would hold the loop: past INLINE_RENDERED_CHARS
    the whole count (split and cache lookups too) runs in the pool, cached or not."""
    counter = counter_for("qwen3-14b")
    segments = counter._segments
    threads: list[str] = []
    real_plan = segments.plan

    def plan(text: str) -> tuple[int, list[str]]:
        threads.append(threading.current_thread().name)
        return real_plan(text)

    monkeypatch.setattr(segments, "plan", plan)
    long = ChatRequest(messages=[
        {"role": "system", "content": "shared context " * (INLINE_RENDERED_CHARS // 14)},
        {"role": "user", "content": "ok?"}])
    short = ChatRequest(messages=[{"role": "user", "content": "hello there"}])
    expected = [counter_for("qwen3-14b", cache_bytes=0).count_chat(c) for c in (long, short)]

    async def counts() -> list[int]:
        return [await counter.count_chat_async(c) for c in (long, long, short)]

    assert asyncio.run(counts()) == [expected[0], expected[0], expected[1]]
    stats = counter.cache_stats()
    assert stats is not None and stats.hits >= 1  # the second long count was cached
    assert [t.startswith("kvgate-count") for t in threads] == [True, True, False]
