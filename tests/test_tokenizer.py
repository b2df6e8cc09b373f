"""The engine's tokenizer (tokenizers + jinja2, no transformers) agrees with transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from neuronctl.engine.tokenizer import EngineTokenizer
from tests.helpers import make_tokenizer

TEXTS = ["Hello there", "", "naïve café 東京 🙂", "  spaces\tand\nlines  "]
CHATS = [
    [{"role": "user", "content": "Say hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "é?"}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    make_tokenizer(out)
    return out


def test_encode_decode_and_chat_match_transformers(tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours, theirs = EngineTokenizer.load(tok_dir), AutoTokenizer.from_pretrained(str(tok_dir))
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    for chat in CHATS:
        text = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert ours.apply_chat_template(chat) == text
        assert ours.encode_chat(chat) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.eos_token_id == theirs.eos_token_id


def test_add_bos_token_in_the_config_is_handled_as_transformers_does(
    tok_dir: Path, tmp_path: Path
) -> None:
    """transformers 5 drops the flag when there is a tokenizer.json (tests/test_tokenizer_parity.py
    cites where); before 5 the engine keeps honouring it, as it did."""
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    ours, theirs = EngineTokenizer.load(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    for special in (True, False):
        assert ours.encode("hi", special) == theirs("hi", add_special_tokens=special)["input_ids"]


def test_with_transformers_4_add_bos_and_eos_token_still_apply(
    tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before 5, transformers let tokenizer_config's flags rebuild the post-processor."""
    import neuronctl.engine.tokenizer as module

    monkeypatch.setattr(module, "_transformers_major", lambda: 4)
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    flags = {"add_bos_token": True, "add_eos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **flags}))
    ours = EngineTokenizer.load(tmp_path)
    bos, eos, plain = ours.token_id("<s>"), ours.token_id("</s>"), ours.encode("hi", False)
    assert ours.encode("hi") == [bos, *plain, eos]


def test_chat_template_errors_and_missing_template_are_one_line(tok_dir: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    from neuronctl.errors import UsageError

    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    with pytest.raises(UsageError, match="no chat template"):
        EngineTokenizer.load(tmp_path).encode_chat(CHATS[0])
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ raise_exception('only user turns') }}"})
    )
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="only user turns"):
        EngineTokenizer.load(tmp_path).encode_chat(CHATS[0])


def test_loading_the_tokenizer_does_not_import_transformers(tok_dir: Path) -> None:
    code = (
        "import sys; from pathlib import Path; "
        "from neuronctl.engine.tokenizer import EngineTokenizer as T; "
        f"t = T.load(Path({str(tok_dir)!r})); t.encode_chat([{{'role': 'user', 'content': 'x'}}]); "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
