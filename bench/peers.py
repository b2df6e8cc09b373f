"""neuronctl beside llama.cpp and transformers on this CPU, interleaved, in one process tree.

    python bench/peers.py                 # every row of the table (about 10 minutes)
    python bench/peers.py --rounds 1 --skip cold   # a quicker look

A random checkpoint with the SmolLM2-135M shape (bench/decode.py's, plus a byte-level
tokenizer) is made locally, compiled by neuronctl (bf16, fp32, int8; batch 1 and 8;
`--compiler inductor`) and converted to GGUF (BF16, F32 and Q8_0) with the `gguf` package.
Each system runs in its own worker process (so no two thread pools share the cores); every
round measures, back to back for each row, neuronctl's Runner, its Engine, llama.cpp (through
llama-cpp-python's C API: one llama_decode per step, as llama-batched-bench does) and
transformers eager; each figure is the best over the rounds. int8 against bf16 is also
measured in back-to-back pairs of the two Runners (`--pairs`), and each row's Engine over its
Runner too: rows of one round run a minute apart, and this host's speed moves by up to 2x
within minutes. Then the cold start: a fresh
`neuronctl generate` for one token, the same for llama.cpp and transformers, and the floor,
`python -c "import torch"`. Prints the host class (lscpu's model, the CPU flags that decide
the kernels), one JSON line per measurement, then every ratio with its target.

llama.cpp runs as its users get it: `llama_model_default_params`, i.e. weights repacked into
the CPU's extra buffer types (AMX where the CPU has it). A system whose worker crashes is
reported and never ends the bench: llama.cpp falls back to one token per llama_decode
(`decode-only`, one sequence), then to plain buffers (`no-repack`; bench/llamacpp.py), and the
table names the configuration a figure comes from; a system with none left is left out.
Needs the bench extra (`pip install -e '.[bench]'`: llama-cpp-python builds from
source with cmake); without llama.cpp the llama.cpp columns say so and the rest still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]
from decode import NEW, PROMPT, SHAPE, bandwidth_gbs, make_checkpoint  # noqa: E402
from llamacpp import MODES, LlamaCpp  # noqa: E402

# Greedy tokens by numpy, as the engine and the llama.cpp rows here pick them (torch.argmax
# hands a vocabulary-sized row to its thread pool).
from neuronctl.engine.sampling import argmax_rows  # noqa: E402

VOCAB = int(SHAPE["vocab_size"])
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. "  # 45 tokens byte-level, < PROMPT


# --- the checkpoint ------------------------------------------------------------------------


def make_model(out: Path) -> Path:
    """decode.py's checkpoint (with its byte-level tokenizer, ids 0..258, for `generate`)."""
    return make_checkpoint(out)


GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gguf(ckpt: Path, out: Path, kind: str) -> Path:
    """The checkpoint as llama.cpp's convert script would write it: kind BF16, F32 or Q8_0.

    2-D weights in `kind`, norms in F32; q/k rows permuted from Hugging Face's half-split
    rotary layout to GGML's interleaved one; a tied head is simply absent (llama.cpp then
    uses token_embd). The tokenizer is a placeholder SentencePiece vocabulary: the bench
    feeds token ids.
    """
    if out.is_file():
        return out
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    cfg = SHAPE
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    writer = gguf.GGUFWriter(str(out) + ".tmp", "llama")
    writer.add_name("smollm2-135m-shape-random")
    writer.add_block_count(int(cfg["num_hidden_layers"]))
    writer.add_context_length(int(cfg["max_position_embeddings"]))
    writer.add_embedding_length(int(cfg["hidden_size"]))
    writer.add_feed_forward_length(int(cfg["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(int(cfg["head_dim"]))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_rope_freq_base(float(cfg["rope_parameters"]["rope_theta"]))  # type: ignore[index]
    writer.add_vocab_size(VOCAB)
    file_types = {"BF16": gguf.LlamaFileType.MOSTLY_BF16, "F32": gguf.LlamaFileType.ALL_F32,
                  "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    writer.add_file_type(file_types[kind])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
                          + [f"t{i}" for i in range(259, VOCAB)])
    writer.add_token_scores([0.0] * VOCAB)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (VOCAB - 259)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for name, tensor in load_file(str(ckpt / "model.safetensors")).items():
        data = tensor.float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in name else kv_heads
            data = (data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:])
                    .swapaxes(1, 2).reshape(data.shape))
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{GGUF_NAMES[rest]}"
        if data.ndim == 1:
            writer.add_tensor(gname, data.astype(np.float32))
        else:
            writer.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(out) + ".tmp", out)
    return out


# --- the three systems ---------------------------------------------------------------------


def prompts(batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCAB, (batch, PROMPT), generator=gen).tolist()


class Neuronctl:
    """A compiled artifact's Runner, driven directly (no engine)."""

    def __init__(self, path: Path) -> None:
        from neuronctl.backends import get_backend
        from neuronctl.store.manifest import read_manifest

        self.runner = get_backend("torch").load(path, read_manifest(path))

    def decode(self, batch: int) -> float:
        runner, ids = self.runner, prompts(batch)
        slots = list(range(batch))
        tokens = argmax_rows(runner.prefill_batch(slots, ids))
        start = time.perf_counter()
        for step in range(NEW):
            tokens = argmax_rows(runner.decode(tokens, [PROMPT + step] * batch))
        return batch * NEW / (time.perf_counter() - start)

    def ttft(self) -> float:
        ids = prompts(1)[0]
        start = time.perf_counter()
        argmax_rows(self.runner.prefill(0, ids)[None])
        return time.perf_counter() - start


class Engine:
    """The same artifact served: neuronctl's Engine (scheduler, sampling, detokenizing) with
    `batch` concurrent greedy requests, as `serve` runs it minus HTTP. Decode tokens/s come
    from the token times, so prefill is left out as it is for the Runner."""

    def __init__(self, runner: Any, path: Path) -> None:
        from neuronctl.engine.engine import Engine as NeuronctlEngine
        from neuronctl.engine.loader import load_tokenizer

        self.engine = NeuronctlEngine(runner, load_tokenizer(path).new_decoder).start()

    def decode(self, batch: int) -> float:
        from neuronctl.engine.sampling import SamplingParams

        greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        outputs = self.engine.generate(prompts(batch), greedy)
        first = max(o.token_times[0] for o in outputs)  # every slot is decoding from here
        last = max(o.token_times[-1] for o in outputs)
        steps = sum(1 for o in outputs for t in o.token_times if first < t <= last)
        return steps / (last - first)


class Transformers:
    """transformers eager, as bench/decode.py measures it."""

    def __init__(self, ckpt: Path, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype))
        self.model.eval()

    @torch.no_grad()
    def _generate(self, ids: torch.Tensor, n: int) -> float:
        start = time.perf_counter()
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                            min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    def decode(self, batch: int) -> float:
        """Decode-only tokens/s: (T(64 new) - T(1 new)) over 63 steps."""
        ids = torch.tensor(prompts(batch))
        return batch * (NEW - 1) / max(self._generate(ids, NEW) - self._generate(ids, 1), 1e-9)

    @torch.no_grad()
    def ttft(self) -> float:
        ids = torch.tensor(prompts(1))
        start = time.perf_counter()
        int(self.model(ids, use_cache=True).logits[0, -1].argmax())
        return time.perf_counter() - start


class LlamaCppPeer:
    """llama.cpp (bench/llamacpp.py) measured as the other systems are."""

    def __init__(self, gguf_path: Path, n_seq: int, threads: int, mode: str) -> None:
        self.llm = LlamaCpp(str(gguf_path), n_seq, threads, PROMPT + NEW, mode)

    def decode(self, batch: int) -> float:
        tokens = self.llm.prefill(prompts(batch))
        start = time.perf_counter()
        for step in range(NEW):
            tokens = self.llm.step(tokens, PROMPT + step)
        return batch * NEW / (time.perf_counter() - start)

    def ttft(self) -> float:
        ids = prompts(1)
        start = time.perf_counter()
        self.llm.prefill(ids)
        return time.perf_counter() - start


# --- one process per system ---------------------------------------------------------------


def make_system(spec: dict[str, Any]) -> Any:
    kind = spec["kind"]
    if kind == "neuronctl":
        return Neuronctl(Path(spec["path"]))
    if kind == "engine":  # loaded as serve and generate load it
        from neuronctl.engine.loader import open_artifact

        return Engine(open_artifact(Path(spec["path"])).runner, Path(spec["path"]))
    if kind == "llama.cpp":
        return LlamaCppPeer(Path(spec["path"]), spec["n_seq"], spec["threads"], spec["mode"])
    return Transformers(Path(spec["path"]), spec["dtype"])


def serve_worker(spec: dict[str, Any]) -> None:
    """`peers.py --worker SPEC`: build one system, then answer {"op": "decode"|"ttft"} lines."""
    system = make_system(spec)
    out = sys.stdout
    sys.stdout = sys.stderr  # anything a library prints stays off the answer channel
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "decode":
            value = system.decode(request["batch"])
        else:
            value = system.ttft()
        print(json.dumps({"value": value}), file=out, flush=True)


class WorkerDied(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"exit {code}")
        self.code = code


class Worker:
    """A system in its own process. In one process, the thread pools of torch (OpenMP) and
    llama.cpp (ggml) spin after their work and take cores from whichever runs next: measured
    side by side in one process, llama.cpp ran at about half its own speed."""

    def __init__(self, spec: dict[str, Any], threads: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._read()  # ready

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerDied(self.proc.wait())
        return json.loads(line)

    def ask(self, **request: Any) -> float:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise WorkerDied(self.proc.wait()) from None
        return float(self._read()["value"])

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a system whose threads outlive its input
            self.proc.kill()
            self.proc.wait()


def configurations(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """What to run a system as, in order: llama.cpp as its users get it by default first,
    then its fallbacks (bench/llamacpp.py: decode-only for one sequence, then no repack)."""
    if spec["kind"] != "llama.cpp":
        return [spec]
    return [{**spec, "mode": mode} for mode in MODES
            if not (mode == "decode-only" and spec["n_seq"] != 1)]


class System:
    """One system of one row, in a Worker. A crash never ends the bench: it is reported, the
    next configuration takes over (its figures replace any of the crashed one, so a row's
    figures come from one configuration), and with none left the system is left out."""

    def __init__(self, name: str, row: str, spec: dict[str, Any], threads: int,
                 notes: list[str], start: Any = Worker) -> None:
        self.name, self.row, self.threads, self.notes = name, row, threads, notes
        self.configs = configurations(spec)
        self.start = start
        self.worker: Any = None
        self.crashed = False  # since the last take_crash()
        self._start()

    @property
    def mode(self) -> str:
        return str(self.configs[0].get("mode", "")) if self.configs else ""

    def _start(self) -> None:
        while self.configs and self.worker is None:
            try:
                self.worker = self.start(self.configs[0], self.threads)
            except WorkerDied as died:
                self._died(died, "load")

    def _died(self, died: WorkerDied, during: str) -> None:
        failed = self.mode
        self.configs.pop(0)
        self.worker, self.crashed = None, True
        then = (f"falling back to {self.mode}" if self.configs
                else "no configuration left: left out of this row")
        what = f"{self.name} ({failed})" if failed else self.name
        note = f"{self.row}: {what} died during {during} ({died}); {then}"
        self.notes.append(note)
        print(json.dumps({"crash": note}), flush=True)

    def ask(self, **request: Any) -> float | None:
        """The worker's answer, or None where no configuration of this system survives."""
        self._start()
        while self.worker is not None:
            try:
                return float(self.worker.ask(**request))
            except WorkerDied as died:
                self._died(died, request["op"])
                self._start()
        return None

    def decode(self, batch: int) -> float | None:
        return self.ask(op="decode", batch=batch)

    def ttft(self) -> float | None:
        return self.ask(op="ttft")

    def take_crash(self) -> bool:
        crashed, self.crashed = self.crashed, False
        return crashed

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


# --- quality ------------------------------------------------------------------------------


QUALITY_PROMPTS = [(9, 2), (20, 1), (24, 8), (40, 12), (60, 5)]  # (length, seed) as the tests


@torch.no_grad()
def quality(runner: Any, reference: Any, steps: int = 16) -> dict[str, float]:
    """Top-1 agreement and logit error of an artifact against float32 transformers.

    Teacher-forced along the reference's own greedy continuation of each prompt (random ids
    of the parity tests' lengths and seeds), so every step compares the same prefix.
    """
    agree, total, max_err, rel_err = 0, 0, 0.0, 0.0
    for length, seed in QUALITY_PROMPTS:
        ids = torch.randint(3, VOCAB, (length,),
                            generator=torch.Generator().manual_seed(seed)).tolist()
        seq = list(ids)
        for _ in range(steps):
            seq.append(int(reference(torch.tensor([seq])).logits[0, -1].argmax()))
        ref = reference(torch.tensor([seq])).logits[0, length - 1:-1].float()
        got = [runner.prefill(0, ids)]
        slots = runner.batch_size
        for pos in range(length, length + steps - 1):
            got.append(runner.decode([seq[pos]] + [0] * (slots - 1),
                                     [pos] + [-1] * (slots - 1))[0])
        got_t = torch.stack(got)
        agree += int((got_t.argmax(-1) == ref.argmax(-1)).sum())
        total += len(got)
        err = float((got_t - ref).abs().max())
        max_err = max(max_err, err)
        rel_err = max(rel_err, err / float(ref.abs().max()))
    return {"top1_agreement": agree / total, "max_logit_error": max_err,
            "max_logit_error_relative": rel_err}


# --- compile, measure, report --------------------------------------------------------------


COMPILER = "inductor"  # --compiler export: a quick smoke run of the script itself


def compile_artifact(ckpt: Path, store: Path, dtype: str, batch: int, quantized: bool) -> Path:
    from neuronctl.build import compile_model, resolve_build

    spec: dict[str, Any] = {
        "dtype": dtype, "batch_size": batch, "seq_len": PROMPT + NEW,
        "max_context_length": PROMPT, "context_buckets": str(PROMPT),
        "token_gen_buckets": str(PROMPT + NEW), "compiler": COMPILER,
    }
    if quantized:
        spec.update(quantized=True, quantization_type="per_channel_symmetric")
    start = time.perf_counter()
    outcome = compile_model(resolve_build(str(ckpt), spec, store_dir=store),
                            jobs=os.cpu_count() or 1)
    verb = "cache hit" if outcome.cache_hit else "compiled"
    print(f"# {verb} {dtype} batch {batch}{' int8' if quantized else ''} "
          f"in {time.perf_counter() - start:.1f} s", flush=True)
    return Path(outcome.path)


def llama_cpp_available() -> str | None:
    """None when llama-cpp-python and gguf import, else why not."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed (pip install -e '.[bench]')"
    return None


# The CPU flags that decide which kernels anyone's code can use (neuronctl's and llama.cpp's).
CLASS_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
               "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "bf16",
               "i8mm", "sve")


def host_class(flags: set[str]) -> str:
    """The host class in words: what separates the classes the bench's targets differ on."""
    if not flags & {"avx2", "asimd"}:
        return "no AVX2"
    if "asimd" in flags:
        return "arm64" + (" with BF16" if "bf16" in flags else "")
    parts = ["AVX-512" if "avx512f" in flags else "AVX2+FMA only"]
    parts += [name for flag, name in (("avx512_bf16", "BF16"), ("avx512_vnni", "VNNI"),
                                      ("avx_vnni", "AVX-VNNI"), ("amx_tile", "AMX"))
              if flag in flags]
    return " + ".join(parts)


def cpu_model() -> str:
    """lscpu's model name (with family and model), else /proc/cpuinfo's."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "Model name" in fields:
            return (f"{fields['Model name']} (family {fields.get('CPU family', '?')} "
                    f"model {fields.get('Model', '?')})")
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_facts() -> dict[str, Any]:
    from neuronctl.backends.torch.host import cpu_flags, cpu_isa, half_units

    flags = set(cpu_flags().split())
    facts = {"cpu": cpu_model(), "class": host_class(flags),
             "flags": " ".join(f for f in CLASS_FLAGS if f in flags) or "none",
             "isa": cpu_isa(), "half_units": half_units(),
             "threads": torch.get_num_threads(), "cores": os.cpu_count(),
             "torch": torch.__version__}
    try:
        from importlib.metadata import version

        facts["llama_cpp"] = version("llama-cpp-python")
    except Exception:
        pass
    return facts


def int8_target(flags: str) -> float:
    """int8 over bf16 batch-1 decode, per host class: 1.6x where the CPU has VNNI (int8 dot
    products), 1.4x on AVX2-only, where int8's loop is bound by issuing vector uops."""
    return 1.6 if {"avx512_vnni", "avx_vnni"} & set(flags.split()) else 1.4


def cold_start(args: list[str], env: dict[str, str]) -> tuple[float | None, str]:
    """Seconds from process start to exit, or None and why the process failed."""
    start = time.perf_counter()
    done = subprocess.run(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if done.returncode:
        tail = done.stderr.strip().splitlines()[-1:] or [""]
        return None, f"exit {done.returncode}: {tail[0][:200]}"
    return time.perf_counter() - start, ""


def cold_commands(
    artifact: Path, ckpt: Path, gguf_path: Path | None
) -> dict[str, list[tuple[str, list[str]]]]:
    """Per system, its cold-start command and then its fallbacks, each with a name."""
    py = sys.executable
    ids = prompts(1)[0]
    commands: dict[str, list[tuple[str, list[str]]]] = {
        "import torch": [("", [py, "-c", "import torch"])],
        "neuronctl": [("", [py, "-m", "neuronctl.cli.main", "generate", "--artifacts",
                            str(artifact), "--prompt", PROMPT_TEXT, "--max-tokens", "1"])],
        "transformers": [("", [py, "-c", (
            "import sys, torch\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
            "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)\n"
            "ids = tok(sys.argv[2], return_tensors='pt').input_ids\n"
            "print(tok.decode(model.generate(ids, max_new_tokens=1, do_sample=False)[0, -1:]))"
        ), str(ckpt), PROMPT_TEXT])],
    }
    if gguf_path is not None:  # bench/llamacpp.py imports no torch
        commands["llama.cpp"] = [
            (mode, [py, str(HERE / "llamacpp.py"), str(gguf_path), json.dumps(ids), mode])
            for mode in MODES
        ]
    return commands


def cold_starts(commands: dict[str, list[tuple[str, list[str]]]], runs: int,
                env: dict[str, str], notes: list[str]) -> dict[str, list[float]]:
    """Each system's cold starts; one that fails is reported and its next fallback used."""
    cold: dict[str, list[float]] = {}
    for run in range(runs):
        for name, variants in commands.items():
            while variants:
                mode, args = variants[0]
                secs, why = cold_start(args, env)
                if secs is not None:
                    cold.setdefault(name, []).append(secs)
                    print(json.dumps({"run": run, "cold_start": name, "mode": mode,
                                      "s": round(secs, 2)}), flush=True)
                    break
                variants.pop(0)
                cold.pop(name, None)  # one configuration's figures only
                then = f"falling back to {variants[0][0]}" if variants else "left out"
                note = f"cold start: {name}{f' ({mode})' if mode else ''} failed ({why}); {then}"
                notes.append(note)
                print(json.dumps({"crash": note}), flush=True)
    return cold


def best(values: list[float], higher: bool) -> float:
    return max(values) if higher else min(values)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        serve_worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=7,
                        help="back-to-back pairs for the int8 and served targets")
    parser.add_argument("--cold-runs", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/neuronctl-bench-peers"))
    parser.add_argument("--fresh", action="store_true", help="recompile and reconvert")
    parser.add_argument("--skip", default="", help="comma list of: transformers, llama.cpp,"
                        " cold, batch8, int8, quality")
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "export"],
                        help="export only to check the script quickly; its figures mean little")
    opts = parser.parse_args()
    global COMPILER
    COMPILER = opts.compiler
    skip = set(filter(None, opts.skip.split(",")))
    if opts.fresh:
        shutil.rmtree(opts.work, ignore_errors=True)
    ckpt = make_model(opts.work / "smollm2-135m-shape")
    store = opts.work / "store"
    threads = torch.get_num_threads()
    facts = host_facts()
    facts["read_bandwidth_gbs"] = round(bandwidth_gbs(3), 1)
    print(json.dumps({"host": facts}), flush=True)
    why_no_llama = "skipped" if "llama.cpp" in skip else llama_cpp_available()
    if why_no_llama:
        print(f"# llama.cpp: {why_no_llama}; its columns are left empty", flush=True)

    rows: list[tuple[str, str, int, bool]] = []  # (label, dtype, batch, quantized)
    for dtype in ("bfloat16", "float32"):
        rows.append((f"{dtype} batch 1", dtype, 1, False))
        if "batch8" not in skip:
            rows.append((f"{dtype} batch 8", dtype, 8, False))
    if "int8" not in skip:
        rows.append(("int8 batch 1", "bfloat16", 1, True))
    gguf_kind = {"bfloat16": "BF16", "float32": "F32"}

    systems: dict[str, dict[str, System]] = {}
    notes: list[str] = []  # crashes and fallbacks, printed under the table
    artifacts: dict[str, Path] = {}
    for label, dtype, batch, quantized in rows:
        artifacts[label] = path = compile_artifact(ckpt, store, dtype, batch, quantized)
        specs: dict[str, dict[str, Any]] = {"neuronctl": {"kind": "neuronctl", "path": str(path)}}
        if not quantized:
            specs["engine"] = {"kind": "engine", "path": str(path)}
        if not why_no_llama:
            kind = "Q8_0" if quantized else gguf_kind[dtype]
            gguf_path = write_gguf(ckpt, opts.work / f"model-{kind}.gguf", kind)
            specs["llama.cpp"] = {"kind": "llama.cpp", "path": str(gguf_path), "n_seq": batch,
                                  "threads": threads, "mode": "default"}
        if "transformers" not in skip and not quantized:
            specs["transformers"] = {"kind": "transformers", "path": str(ckpt), "dtype": dtype}
        systems[label] = {name: System(name, label, spec, threads, notes)
                          for name, spec in specs.items()}

    decode: dict[tuple[str, str], list[float]] = {}
    ttft: dict[tuple[str, str], list[float]] = {}
    modes: dict[tuple[str, str], str] = {}
    for round_ in range(opts.rounds):
        for label, _dtype, batch, quantized in rows:
            for name, system in systems[label].items():
                wants_ttft = batch == 1 and not quantized and name != "engine"
                tok_s, secs, crashed = measure(system, batch, wants_ttft)
                if crashed:  # a row's figures come from one configuration
                    decode.pop((label, name), None)
                    ttft.pop((label, name), None)
                modes[(label, name)] = system.mode
                for table, key, value in ((decode, "decode_tok_s", tok_s),
                                          (ttft, "ttft_ms", secs)):
                    if value is None:
                        continue
                    table.setdefault((label, name), []).append(value)
                    shown = round(value * 1e3 if table is ttft else value, 1)
                    print(json.dumps({"round": round_, "row": label, "system": name,
                                      "mode": system.mode, key: shown}), flush=True)

    pairs = int8_pairs(systems, opts.pairs)
    served = served_pairs(systems, rows, opts.pairs)
    scores: dict[str, dict[str, float]] = {}
    if "quality" not in skip:
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        for label, dtype, batch, quantized in rows:
            if batch == 1:
                name = "int8" if quantized else dtype
                scores[name] = quality(Neuronctl(artifacts[label]).runner, reference)
                print(json.dumps({"quality": name, **scores[name]}), flush=True)

    for entry in systems.values():
        for worker in entry.values():
            worker.close()
    cold: dict[str, list[float]] = {}
    if "cold" not in skip:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        gguf_path = None if why_no_llama else opts.work / "model-BF16.gguf"
        artifact = compile_artifact(ckpt, store, "bfloat16", 1, False)
        commands = cold_commands(artifact, ckpt, gguf_path)
        if "transformers" in skip:
            commands.pop("transformers")
        cold = cold_starts(commands, opts.cold_runs, env, notes)
    facts["read_bandwidth_gbs_after"] = round(bandwidth_gbs(3), 1)
    report(facts, rows, decode, ttft, cold, pairs, served, modes, notes)
    for name, score in scores.items():
        print(f"quality {name} vs float32 transformers: top-1 agreement "
              f"{score['top1_agreement']:.3f}, max logit error {score['max_logit_error']:.4f} "
              f"({score['max_logit_error_relative']:.4f} of the largest logit)")


def measure(system: System, batch: int, wants_ttft: bool) -> tuple[float | None,
                                                                   float | None, bool]:
    """Decode tokens/s (and TTFT) of one round, all from one configuration: where the system
    crashed and a fallback took over, the fallback measures both again. The last item says
    whether a crash happened (earlier rounds' figures are then another configuration's)."""
    crashed = False
    while True:
        tok_s = system.decode(batch)
        secs = system.ttft() if wants_ttft and tok_s is not None else None
        if not system.take_crash():
            return tok_s, secs, crashed
        crashed = True
        if not system.configs:
            return None, None, crashed


def int8_pairs(systems: dict[str, dict[str, System]], count: int) -> list[float]:
    """int8 over bf16 batch-1 decode, each ratio from the two Runners measured back to back
    (bf16, then int8), `count` times: the host's swings move both sides of a pair alike."""
    bf16, int8 = (systems.get(label, {}).get("neuronctl")
                  for label in ("bfloat16 batch 1", "int8 batch 1"))
    if bf16 is None or int8 is None:
        return []
    return back_to_back(bf16, int8, 1, count, "int8 over bf16")


def served_pairs(
    systems: dict[str, dict[str, System]], rows: list[tuple[str, str, int, bool]], count: int
) -> dict[str, list[float]]:
    """Per row, the Engine over the Runner from back-to-back pairs: best-of-rounds figures
    of the two come from different minutes, and one run here read 0.85 where the host's
    read bandwidth fell 14 % between them."""
    out = {}
    for label, _dtype, batch, _quantized in rows:
        runner, engine = (systems[label].get(name) for name in ("neuronctl", "engine"))
        if runner is not None and engine is not None:
            out[label] = back_to_back(runner, engine, batch, count, f"{label} served")
    return out


def back_to_back(first: System, second: System, batch: int, count: int, what: str) -> list[float]:
    """`count` ratios of `second`'s decode over `first`'s, each pair measured back to back."""
    ratios = []
    for pair in range(count):
        slow, fast = first.decode(batch), second.decode(batch)
        if slow is None or fast is None:
            return ratios  # a worker died (reported): no more pairs
        ratios.append(fast / slow)
        print(json.dumps({"pair": pair, "what": what, "first_tok_s": round(slow, 1),
                          "second_tok_s": round(fast, 1), "ratio": round(fast / slow, 3)}),
              flush=True)
    return ratios


def report(
    facts: dict[str, Any],
    rows: list[tuple[str, str, int, bool]],
    decode: dict[tuple[str, str], list[float]],
    ttft: dict[tuple[str, str], list[float]],
    cold: dict[str, list[float]],
    pairs: list[float],
    served_ratios: dict[str, list[float]],
    modes: dict[tuple[str, str], str],
    notes: list[str],
) -> None:
    def get(table: dict[Any, list[float]], key: Any, higher: bool) -> float | None:
        return best(table[key], higher) if key in table else None

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a and b else "-"

    def verdict(value: float | None, target: float, strict: bool = False) -> str:
        if value is None:
            return "not measured"
        return "met" if (value > target if strict else value >= target) else "NOT met"

    print(f"\nhost: {facts['cpu']} ({facts['class']}; flags {facts['flags']}); ISA "
          f"{facts['isa']}; half-precision units {facts['half_units']}; {facts['threads']} "
          f"threads; read bandwidth {facts['read_bandwidth_gbs']}-"
          f"{facts['read_bandwidth_gbs_after']} GB/s; torch {facts['torch']}; llama.cpp "
          f"{facts.get('llama_cpp', '-')}")
    print("\n| what | neuronctl | llama.cpp | transformers | vs llama.cpp | vs transformers |"
          " target |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    lines: list[tuple[str, float | None, float | None, float | None, str]] = []
    for label, _dtype, batch, quantized in rows:
        if quantized:
            continue
        nc = get(decode, (label, "neuronctl"), True)
        lc = get(decode, (label, "llama.cpp"), True)
        hf = get(decode, (label, "transformers"), True)
        strict = batch > 1  # level at batch 1, ahead at batch 8
        target = (f"{'>' if strict else '>='} 1.0x llama.cpp: "
                  f"{verdict(nc / lc if nc and lc else None, 1.0, strict)}")
        lines.append((f"{label} decode, tok/s", nc, lc, hf, target))
        served = get(decode, (label, "engine"), True)
        if served:
            paired = served_ratios.get(label)
            ratio_ = statistics.median(paired) if paired else served / nc if nc else None
            how = f"median of {len(paired)} back-to-back pairs" if paired else "best of rounds"
            lines.append((f"{label} decode through the engine, tok/s", served, lc, hf,
                          f">= 0.9x the Runner: {ratio_ or 0:.2f}x ({how}), "
                          f"{verdict(ratio_, 0.9)}"))
    for dtype in ("bfloat16", "float32"):
        key = f"{dtype} batch 1"
        nc = get(ttft, (key, "neuronctl"), False)
        lc = get(ttft, (key, "llama.cpp"), False)
        hf = get(ttft, (key, "transformers"), False)
        speedup = lc / nc if nc and lc else None
        lines.append((f"{dtype} TTFT, {PROMPT}-token prompt, ms", _ms(nc), _ms(lc), _ms(hf),
                      f"<= llama.cpp: {verdict(speedup, 1.0)}"))
    for label, nc, lc, hf, target in lines:
        # For times the ratio is theirs over ours, so > 1 always means neuronctl is faster.
        flip = "ms" in label
        row = label.split(" decode")[0].split(" TTFT")[0]
        mode = modes.get((row if "batch" in row else f"{row} batch 1", "llama.cpp"), "default")
        shown = _fmt(lc) if lc is None or mode == "default" else f"{_fmt(lc)} ({mode})"
        print(f"| {label} | {_fmt(nc)} | {shown} | {_fmt(hf)} | "
              f"{ratio(lc, nc) if flip else ratio(nc, lc)} | "
              f"{ratio(hf, nc) if flip else ratio(nc, hf)} | {target} |")
    if "import torch" in cold and "neuronctl" in cold:
        floor = best(cold["import torch"], False)
        nc = best(cold["neuronctl"], False)
        lc = get(cold, "llama.cpp", False)
        hf = get(cold, "transformers", False)
        print(f"| process start -> first token, s (floor `import torch` {floor:.2f} s) | "
              f"{nc:.2f} | {_fmt(lc)} | {_fmt(hf)} | {ratio(lc, nc)} | {ratio(hf, nc)} | "
              f"<= 1.5x the floor: {nc / floor:.2f}x, {verdict(1.5 - nc / floor, 0.0)} |")
    int8 = get(decode, ("int8 batch 1", "neuronctl"), True)
    if int8:
        bf16 = get(decode, ("bfloat16 batch 1", "neuronctl"), True)
        q8 = get(decode, ("int8 batch 1", "llama.cpp"), True)
        paired = statistics.median(pairs) if pairs else None
        target = int8_target(facts["flags"])
        q8_mode = modes.get(("int8 batch 1", "llama.cpp"), "default")
        q8_shown = _fmt(q8) if q8 is None or q8_mode == "default" else f"{_fmt(q8)} ({q8_mode})"
        print(f"| int8 batch 1 decode, tok/s (llama.cpp Q8_0) | {int8:.1f} | {q8_shown} | - | "
              f"{ratio(int8, q8)} | - | >= {target}x bf16: {_times(paired)} (median of "
              f"{len(pairs)} back-to-back pairs), {verdict(paired, target)}; best of rounds "
              f"{ratio(int8, bf16)}; > Q8_0: {verdict(int8 / q8 if q8 else None, 1.0, True)} |")
    print("\nratios are neuronctl's speed over the peer's (> 1: neuronctl is faster); each "
          "figure is the best of the rounds; llama.cpp runs with its default model parameters "
          "(weight repacking on: AMX buffers where the CPU has AMX) unless a cell names the "
          "fallback it fell to (bench/llamacpp.py)")
    for note in notes:
        print(f"- {note}")


def _ms(secs: float | None) -> float | None:
    return None if secs is None else secs * 1e3


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main()
