"""The engine's tokenizer gives transformers' AutoTokenizer's ids and text, per tokenizer class.

transformers (5.24.0, huggingface/transformers) does not serve tokenizer.json as saved when
tokenizer_config names a class with its own __init__: it keeps the vocabulary, merges and
post-processor from the file (src/transformers/tokenization_utils_tokenizers.py:122-151) and the
class builds the rest:
- Qwen2Tokenizer: NFC normalizer; pre-tokenizer Sequence[Split(its regex, isolated),
  ByteLevel(add_prefix_space=False, use_regex=False)]; ByteLevel decoder
  (src/transformers/models/qwen2/tokenization_qwen2.py:33, 61-87). Its regex splits digits one
  by one, so "3 + 4 =" is 6 pieces where GPT-2's byte-level regex (a Qwen tokenizer.json's own
  pre-tokenizer) makes 5.
- LlamaTokenizer: no normalizer; Metaspace(prepend_scheme "first" unless legacy, "never" without
  add_prefix_space); decoder Replace, ByteFallback, Fuse, Strip
  (src/transformers/models/llama/tokenization_llama.py:105-133,
  src/transformers/tokenization_utils_base.py:3770-3777) -- unless tokenizer.json is byte-level
  (Llama 3), which AutoTokenizer serves as saved (src/transformers/models/auto/
  tokenization_auto.py:843-862).
- add_bos_token / add_eos_token in tokenizer_config are dropped when there is a tokenizer.json
  (src/transformers/tokenization_utils_base.py:1818-1820), so tokenizer.json's post-processor
  stays (the llama fixture asks for an EOS its post-processor does not add).
Before transformers 5 none of this happens: the engine then reads tokenizer.json as saved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from neuronctl.engine.tokenizer import EngineTokenizer

TRICKY = [
    "3 + 4 =",
    "12345678",
    "Hello  world\n\n",
    "don't",
    "e\u0301 and \u00e9",  # NFC makes the first one the second
    "東京は晴れ、気温は23度です。",
    "emoji 🙂👍🏽 and ZWJ 👩‍👩‍👧",
    "  leading spaces\tand tabs\r\n",
    "x<|im_end|>y",
    "a</s>b <s> c",
    "",
]
CORPUS = [
    "The year 2024 had 365 days; 3 + 4 = 7 and 12 * 12 = 144.",
    "Hello world! Don't panic, it's fine. They'll see what we've done.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 🙂 👍🏽 🚀 — café naïve résumé e\u0301",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "Numbers 1234567890 and more numbers 0987654321 with spaces   and\ttabs.",
]


def _train(pre_tokenizer: Any, alphabet: list[str], vocab_size: int) -> tuple[dict, list]:
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet,
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(CORPUS * 3, trainer)
    saved = json.loads(tok.to_str())["model"]
    return saved["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                            for m in saved["merges"]]  # fmt: skip


def _write(out: Path, tok: Any, config: dict[str, Any], model_type: str) -> Path:
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    return out


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2-style checkpoint whose tokenizer.json keeps GPT-2's plain byte-level
    pre-tokenizer, so only Qwen2Tokenizer's rebuild makes the digits come out one by one."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    vocab, merges = _train(byte_level, pre_tokenizers.ByteLevel.alphabet(), 600)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(tok.token_to_id(s)): {
                "content": s,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for s in specials
        },  # fmt: skip
    }
    return _write(tmp_path_factory.mktemp("qwen") / "tok", tok, config, "qwen2")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-2-style (sentencepiece-converted) tokenizer.json: Prepend/Replace normalizer, byte
    fallback, a BOS-only post-processor; tokenizer_config asks for BOS and EOS (ignored)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    vocab, merges = _train(metaspace, [], 400)
    base = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    full = {t: i for i, t in enumerate(base)}
    for token in sorted(vocab, key=vocab.__getitem__):
        full.setdefault(token, len(full))
    tok = Tokenizer(models.BPE(full, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in base[:3]])
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": True,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
    }
    return _write(tmp_path_factory.mktemp("llama") / "tok", tok, config, "llama")


def _assert_same(path: Path) -> None:
    import transformers
    from transformers import AutoTokenizer

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4 serves tokenizer.json as saved; these fixtures pin 5")

    ours, theirs = EngineTokenizer.load(path), AutoTokenizer.from_pretrained(str(path))
    for text in TRICKY:
        for special in (True, False):
            ids = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
        expected = theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids) == expected, text
        stream = ours.new_decoder()
        assert "".join(stream(i) for i in ids) + stream.flush() == expected, text
        assert [ours.token_str(i) for i in ids] == [
            theirs.decode([i], skip_special_tokens=False) for i in ids
        ], text


def test_qwen2_digits_split_as_transformers_splits_them(qwen_dir: Path) -> None:
    """The fixture shows the difference: tokenizer.json as saved joins " 4" and "12345678"."""
    from tokenizers import Tokenizer

    saved = Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))
    ours = EngineTokenizer.load(qwen_dir)
    pieces = [p for p, _ in ours._tok.pre_tokenizer.pre_tokenize_str("3 + 4 = 12")]
    assert pieces == ["3", "Ġ+", "Ġ", "4", "Ġ=", "Ġ", "1", "2"]
    for text in ("3 + 4 =", "12345678"):
        assert ours.encode(text) != saved.encode(text).ids
    assert len(ours.encode("12345678")) == 8
    assert ours.decode(ours.encode("e\u0301")) == "\u00e9"  # NFC


def test_qwen2_matches_transformers(qwen_dir: Path) -> None:
    _assert_same(qwen_dir)


def test_llama_matches_transformers(llama_dir: Path) -> None:
    _assert_same(llama_dir)


def _variant(src: Path, out: Path, model_type: str, **config: Any) -> Path:
    """src's tokenizer.json under another tokenizer_class / model_type."""
    saved = json.loads((src / "tokenizer_config.json").read_text())
    out.mkdir()
    (out / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({**saved, **config}))
    (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    return out


@pytest.mark.parametrize(
    ("source", "model_type", "tokenizer_class"),
    [
        ("qwen", "llama", "LlamaTokenizerFast"),  # byte-level (Llama 3): served as saved
        ("qwen", "dbrx", "GPT2Tokenizer"),
        ("qwen", "qwen3", "Qwen2TokenizerFast"),
        ("llama", "mistral", "LlamaTokenizer"),  # mistral: served as saved
        ("llama", "llama", "LlamaTokenizerFast"),
        ("llama", "gemma3_text", "GemmaTokenizer"),
    ],
)
def test_other_classes_and_families_match_transformers(
    source: str, model_type: str, tokenizer_class: str, qwen_dir: Path, llama_dir: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    src = qwen_dir if source == "qwen" else llama_dir
    _assert_same(_variant(src, tmp_path / "tok", model_type, tokenizer_class=tokenizer_class))


def test_llama_legacy_and_prefix_space_flags_match_transformers(
    llama_dir: Path, tmp_path: Path
) -> None:
    for i, flags in enumerate(({"legacy": True}, {"add_prefix_space": False})):
        _assert_same(_variant(llama_dir, tmp_path / str(i), "llama", **flags))
