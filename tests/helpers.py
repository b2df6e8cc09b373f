"""Tiny random checkpoints and tokenizers, made locally: nothing is downloaded in tests.

`make_checkpoint` writes a real Hugging Face checkpoint directory (config.json,
generation_config.json, safetensors — single file or index-sharded — and a tokenizer) using
transformers itself, so the files are exactly what a user's download looks like.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB_SIZE = 320  # 256 byte tokens + 3 specials + padding tokens; divisible by 8 for tp tests
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(out: Path, vocab_size: int = VOCAB_SIZE, adds_bos: bool = False) -> None:
    """A byte-level BPE tokenizer with no merges: every text round-trips, ids < vocab_size.
    `adds_bos`: its post-processor puts <s> first, and tokenizer_config says add_bos_token (as a
    Llama checkpoint's files do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_tokens = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(sorted(byte_tokens))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [BOS, EOS, PAD]
    specials += [f"<extra_{i}>" for i in range(vocab_size - len(vocab) - len(specials))]
    tok.add_special_tokens(specials)
    if adds_bos:
        bos = [(BOS, tok.token_to_id(BOS))]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=bos
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    if adds_bos:
        config_file = out / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config.update(add_bos_token=True, tokenizer_class="PreTrainedTokenizerFast")
        config_file.write_text(json.dumps(config, indent=2))


def make_checkpoint(
    out: Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = VOCAB_SIZE,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    sharded: bool = False,
    seed: int = 0,
    tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random checkpoint of `arch` (a model_type of neuronctl/families.py) into
    `out` and return `out`."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(
        arch,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=256,  # the ids make_tokenizer gives <s>, </s>, <pad>
        eos_token_id=257,
        pad_token_id=258,
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(getattr(torch, dtype))
    _perturb_norms(model, seed)
    out.mkdir(parents=True, exist_ok=True)
    # Small shards force model.safetensors.index.json, the layout of every large model.
    model.save_pretrained(out, max_shard_size="20KB" if sharded else "10GB")
    if tokenizer:
        make_tokenizer(out, vocab_size)
    return out


def _perturb_norms(model: Any, seed: int) -> None:
    """Random init leaves RMSNorm weights at 1 and biases at 0; make them count in parity tests."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn(param.shape, generator=gen).to(param.dtype) * 0.1)


def fine_tuned_copy(checkpoint: Path, out: Path) -> Path:
    """A copy of `checkpoint` at `out` whose first tensor differs: new weights, the same
    architecture and spec, so a compile of it may reuse the original's graphs."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    tensors = load_file(str(out / "model.safetensors"))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def graph_weights_qwen2(
    tmp_path: Path, tied: bool, quantized: bool, blocked: bool
) -> tuple[Path, Any]:
    """A tiny qwen2 checkpoint (qkv bias) written as a torch artifact's weights file (bf16,
    int8 per-channel where `quantized`, blocked for the kernel where `blocked`) into
    tmp_path/weights; that folder and the model's ModelArgs."""
    from types import SimpleNamespace

    import torch

    from neuronctl.backends.torch.config import args_from_config
    from neuronctl.backends.torch.quantize import QuantizedCheckpoint
    from neuronctl.backends.torch.weights import GRAPH_WEIGHTS, write_graph_weights
    from neuronctl.checkpoints import open_checkpoint

    ckpt = open_checkpoint(str(make_checkpoint(tmp_path / "ckpt", "qwen2",
                                               tie_word_embeddings=tied)), None)
    if quantized:
        spec = SimpleNamespace(quantization_type="per_channel_symmetric")
        ckpt = QuantizedCheckpoint.wrap(ckpt, spec)  # type: ignore[arg-type]
    args = args_from_config(ckpt.config)
    write_graph_weights(ckpt, args, torch.bfloat16, quantized, blocked,
                        tmp_path / "weights" / GRAPH_WEIGHTS)
    return tmp_path / "weights", args


def read_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Any:
    """Run the real `neuronctl` entry point in a subprocess; returns CompletedProcess."""
    import os
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "neuronctl.cli.main", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {}), "COLUMNS": "200"},
        cwd=cwd,
        timeout=600,
    )


def spec_flags(spec: dict[str, Any]) -> list[str]:
    """A spec dict (conftest's TINY_SPEC, SMALLEST_SPEC) as `compile` flags."""
    return [arg for k, v in spec.items() for arg in (f"--{k.replace('_', '-')}", str(v))]


def run_in_process(args: list[str], capsys: Any, monkeypatch: Any) -> tuple[int, str, str]:
    """Run the CLI in this process (argv patched); return (exit code, stdout, stderr)."""
    import sys

    from neuronctl.cli.main import main

    monkeypatch.setattr(sys, "argv", ["neuronctl", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def wait_until(condition: Any, timeout: float, what: str, poll: float = 0.02) -> float:
    """Poll `condition()` until it is true; fail naming `what` if `timeout` seconds pass first.

    Returns the seconds waited. Tests wait on the event itself, never a fixed sleep: a busy
    host makes a sleep too short, and an idle one makes it too long."""
    import time

    started = time.monotonic()
    deadline = started + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(poll)
    return time.monotonic() - started


def cli_in_process(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Any:
    """`cli` without the process: the same entry point (`neuronctl.cli.main.main`, its error
    mapping and exit codes) run here, seconds faster as torch is already imported. Returns a
    CompletedProcess like `cli`. For tests about what a command prints and decides; a test
    about a real process (signals, a child's environment, import costs, a server) uses `cli`.

    The process state a command may change (environment, working directory, torch's thread
    count, logging) is restored afterwards."""
    import contextlib
    import io
    import logging
    import os
    import subprocess
    import sys

    import torch

    from neuronctl.cli import _common
    from neuronctl.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    saved_threads = torch.get_num_threads()
    logger = logging.getLogger("neuronctl")  # log.setup binds a handler to this stderr
    saved_log = (logger.level, list(logger.handlers))
    saved_widths = [(c, c._width) for c in (_common.console, _common.err_console)]
    code = 0
    try:
        os.environ.update({**(env or {}), "COLUMNS": "200"})
        for console, _ in saved_widths:
            console.width = 200  # as `cli` sets COLUMNS for the child
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = ["neuronctl", *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(saved_threads)
        logger.setLevel(saved_log[0])
        logger.handlers[:] = saved_log[1]
        for console, width in saved_widths:
            console._width = width
    return subprocess.CompletedProcess(["neuronctl", *args], code, out.getvalue(), err.getvalue())


def publish_stub_artifact(
    store: Any, dirname: str, model: str, spec: dict[str, Any], keys: dict[str, str],
    digest: str = "d",
) -> Path:
    """An artifact of `store` that is a manifest and one small weights file, no graphs: for
    the commands that list, show, resolve or remove artifacts without loading one."""
    from neuronctl.store.manifest import Manifest, Source

    def build(staging: Path) -> Manifest:
        (staging / "weights").mkdir()
        (staging / "weights" / "tp0_sharded_checkpoint.safetensors").write_bytes(b"w" * 100)
        return Manifest(
            backend="torch",
            backend_versions={"torch": "2.13.0"},
            spec=spec,
            keys=keys,
            source=Source(model=model, digest=digest),
            architecture={},
        )

    return Path(store.publish(dirname, build).path)
