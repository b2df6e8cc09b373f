"""Launch vLLM over a neuronctl artifact so that it loads it as-is, never recompiling.

vLLM's Neuron integration checks nothing: a launch whose settings differ from the artifact's
recompiles (and its default path deletes the directory first). Which flags, variables and
config keys keep it on its reuse path depends on the vLLM *generation* (docs/neuron.md),
so every launch is planned for one `Target`:

- A `tnx-fork`: the Transformers NeuronX forks, vLLM 0.3.3 / 0.5.0 / 0.6.x-neuron (tnx only).
- B `v0`: the V0 in-tree Neuron worker, the AWS 0.7.2 fork and upstream 0.8-0.10.1 (NxDI or TNx).
- C `plugin`: the vllm-neuron platform plugin 0.1-0.5 on vLLM 0.10.2-0.16 (NxDI only).
- D `native`: vllm-neuron 0.21+ (torch.compile, no NxDI): refused, see docs/neuron.md.

The target is detected from package metadata (vLLM's version, the `vllm.platform_plugins`
entry points, the vllm-neuron distribution) or named with `--vllm-target NAME[@VERSION]`.
Every value comes from the artifact's manifest; the rules per generation, with the source
lines they come from, are pinned in tests/test_vllm.py and tabulated in docs/neuron.md.

`python -m neuronctl.vllm generate ...` is the small offline program `generate_launch` runs.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.spec import BuildSpec
from neuronctl.store.manifest import Manifest
from neuronctl.vllm_generations import (
    D_HINT,
    Generation,
    generation_for,
    platform_plugins,
    version_tuple,
)

NXDI = "neuronx-distributed-inference"
TNX = "transformers-neuronx"
FRAMEWORK_BACKENDS = {NXDI: "nxdi", TNX: "tnx"}
FRAMEWORK_ALIASES = {"nxdi": NXDI, "tnx": TNX, NXDI: NXDI, TNX: TNX}
# neuronctl's quantization dtype (NxDI's name) -> vLLM's NEURON_QUANT_DTYPE spelling (TNx only).
QUANT_ENV = {"int8": "s8", "f8e4m3": "f8e4m3fn"}
TNX_COMPILE_CACHE = "neuron-compile-cache"  # inside a tnx artifact (backends/tnx COMPILE_CACHE)
PLUGIN_DIST = "vllm-neuron"
PLUGIN_ENTRY = "neuron"  # vllm-neuron's entry point name (its setup.py)
# vLLM's --block-size choices from 0.9 on (CacheConfig BlockSize Literal).
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
# The 0.3/0.5 CLI's --block-size choices; 0.6.x-neuron has [8, 16, 32].
OLD_BLOCK_SIZES = (8, 16, 32, 128)
# The version assumed when a generation is named without one and none is installed.
DEFAULT_VLLM = {
    Generation.TNX_FORK: (0, 6, 2),
    Generation.V0: (0, 9, 2),
    Generation.PLUGIN: (0, 13, 0),
}
DEFAULT_PLUGIN = (0, 4, 1)  # Inf2's last plugin (SDK 2.28, vLLM 0.13)
# The on-device sampling both vLLM B's and vllm-neuron's NxDI loaders compile by default
# (_get_default_neuron_config: OnDeviceSamplingConfig(dynamic=True, deterministic=False)); the
# nxdi backend builds with it unless told otherwise (spec.NXDI_DEFAULT_SAMPLING).
VLLM_SAMPLING = {"dynamic": True, "deterministic": False}
# Architectures each generation's Neuron loader serves (None: whatever NxDI has).
A_ARCHS: dict[tuple[int, ...], set[str]] = {
    (0, 3): {"LlamaForCausalLM"},  # TNx continuous-batching guide, vLLM 0.3.3
    (0, 5): {"LlamaForCausalLM", "MistralForCausalLM"},  # the same guide, vLLM 0.5.0
    (0, 6): {"LlamaForCausalLM", "MistralForCausalLM"},  # v0.6.x-neuron loader/neuron.py:36
}
B_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "DbrxForCausalLM", "MixtralForCausalLM"}
B_FORK_EXTRA = {"Qwen2ForCausalLM"}  # neuron-2.24-vllm-v0.7.2 neuronx_distributed.py:70
# vllm-neuron resolves an architecture through NxDI's utils/constants.py MODEL_TYPES (its
# loader's _get_neuron_model_cls), so what it serves is what the NxDI of the SDK its README
# names has: 2.26 for 0.1.0/0.2.0, 2.27 for 0.2.2, 2.28 for 0.4.1/0.5.0. Keyed by the first
# plugin release of each SDK. None of them has "mistral" (from 2.29) or "gemma3" (2.29).
C_MODEL_TYPES: dict[tuple[int, ...], frozenset[str]] = {
    (0, 1): frozenset(
        {"llama", "llama4", "mllama", "mixtral", "dbrx", "qwen2", "qwen3", "qwen3_moe"}
    ),
}
C_MODEL_TYPES[(0, 2, 2)] = C_MODEL_TYPES[(0, 1)] | {"gpt_oss"}
C_MODEL_TYPES[(0, 4)] = C_MODEL_TYPES[(0, 2, 2)] | {"pixtral", "qwen2_vl", "qwen3_vl"}
C_SDK = {(0, 1): "2.26", (0, 2, 2): "2.27", (0, 4): "2.28"}
# The model name the plugin looks up for an architecture whose lowercased prefix is not it.
C_MODEL_NAMES = {"gptoss": "gpt_oss", "qwen3moe": "qwen3_moe", "qwen2vl": "qwen2_vl",
                 "qwen3vl": "qwen3_vl"}  # fmt: skip
# vLLM V1 keeps KV block 0 as its null block (v1/core/block_pool.py). From 0.2.0 the plugin's
# platform adds it to --num-gpu-blocks-override itself, and its own compile then uses that
# incremented count as pa_num_blocks (platform.py check_and_update_config).
C_NULL_BLOCK_ADDED = (0, 2)
# 0.1.0 has no CPU sampling: NeuronCausalLM.sample raises "CPU sampler not implemented".
C_CPU_SAMPLING = (0, 2)


def _dotted(version: tuple[int, ...] | None) -> str:
    return ".".join(str(v) for v in version) if version else "?"


@dataclass(frozen=True)
class Target:
    """The vLLM a launch is written for."""

    generation: Generation
    vllm: tuple[int, ...]
    plugin: tuple[int, ...] | None = None  # vllm-neuron version (C, D)
    platform_plugins: tuple[str, ...] = ()  # installed vllm.platform_plugins entry points
    frameworks: frozenset[str] | None = None  # NxDI / TNx installed here; None: not known
    detected: bool = False

    def describe(self) -> str:
        text = f"{self.generation.letter} ({self.generation.value}, vLLM {_dotted(self.vllm)}"
        if self.plugin:
            text += f", vllm-neuron {_dotted(self.plugin)}"
        how = "installed" if self.detected else "--vllm-target"
        return text + f"; {how})"


# --- which vLLM is installed -----------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def installed_frameworks() -> frozenset[str]:
    return frozenset(fw for fw in (NXDI, TNX) if _dist_version(fw) is not None)


def detect_target() -> Target | None:
    """The installed vLLM's target, or None when vLLM is not installed here."""
    version = _dist_version("vllm")
    if version is None:
        return None
    vllm = version_tuple(version)
    plugin_text = _dist_version(PLUGIN_DIST)
    plugin = version_tuple(plugin_text) if plugin_text else None
    generation = generation_for(vllm, plugin)
    if generation is None:
        raise NeuronctlError(
            f"vLLM {version} is installed without the vllm-neuron plugin: it has no Neuron "
            "support (the in-tree Neuron worker ended with 0.10.1)",
            f"install vllm-neuron (generation C) or pass --vllm-target; {D_HINT}",
        )
    return Target(
        generation,
        vllm,
        plugin,
        platform_plugins(),
        installed_frameworks(),
        detected=True,
    )


TARGET_NAMES = {
    "a": Generation.TNX_FORK,
    "tnx-fork": Generation.TNX_FORK,
    "b": Generation.V0,
    "v0": Generation.V0,
    "c": Generation.PLUGIN,
    "plugin": Generation.PLUGIN,
    "d": Generation.NATIVE,
    "native": Generation.NATIVE,
}
TARGET_HELP = (
    "vLLM to write the launch for: tnx-fork (A: vLLM 0.3-0.6 with TNx), v0 (B: the V0 Neuron "
    "worker, 0.7.2 fork and 0.8-0.10.1), plugin (C: vllm-neuron 0.1-0.5 on vLLM 0.10.2-0.16); "
    "add @VERSION for the vLLM version (plugin@0.4.1 names the plugin's). "
    "Default: the installed one."
)


def parse_target(text: str) -> Target:
    """`NAME[@VERSION]` -> Target (the installed one's details when it is the same generation)."""
    name, _, version = text.strip().partition("@")
    generation = TARGET_NAMES.get(name.lower())
    if generation is None:
        raise UsageError(
            f"--vllm-target: unknown vLLM target {text!r}",
            "use tnx-fork, v0 or plugin (optionally @VERSION, e.g. v0@0.7.2, plugin@0.4.1)",
        )
    if generation is Generation.NATIVE:
        raise UsageError("--vllm-target native (vllm-neuron 0.21+) is not supported", D_HINT)
    wanted = version_tuple(version) if version else None
    if version and not wanted:
        raise UsageError(f"--vllm-target: unreadable version {version!r}", "e.g. v0@0.9.2")
    try:
        installed = detect_target()
    except NeuronctlError:
        installed = None
    if installed is not None and installed.generation is generation and not wanted:
        return replace(installed, detected=False)
    if generation is Generation.PLUGIN:
        plugin = wanted or DEFAULT_PLUGIN
        return Target(generation, plugin_vllm(plugin), plugin)
    vllm = wanted or DEFAULT_VLLM[generation]
    if generation_for(vllm, None) is not generation:
        raise UsageError(
            f"--vllm-target {text}: vLLM {_dotted(vllm)} is not generation {generation.letter}",
            "tnx-fork is vLLM < 0.7, v0 is 0.7-0.10.1",
        )
    return Target(generation, vllm)


def plugin_vllm(plugin: tuple[int, ...]) -> tuple[int, ...]:
    """The vLLM each vllm-neuron release pins (its requirements/core.txt)."""
    for since, vllm in (((0, 5), (0, 16, 0)), ((0, 4), (0, 13, 0)), ((0, 2), (0, 11, 0))):
        if plugin >= since:
            return vllm
    return (0, 10, 2)


def resolve_target(requested: str | Target | None = None) -> Target:
    """--vllm-target, else the installed vLLM, else generation C's default (where Inf2 is)."""
    if isinstance(requested, Target):
        return requested
    if requested:
        return parse_target(requested)
    installed = detect_target()
    if installed is not None:
        if installed.generation is Generation.NATIVE:
            raise UsageError(
                f"the installed vllm-neuron {_dotted(installed.plugin)} is generation D", D_HINT
            )
        return installed
    return Target(Generation.PLUGIN, DEFAULT_VLLM[Generation.PLUGIN], DEFAULT_PLUGIN)


def require_target(requested: str | Target | None) -> Target:
    """For the CLI: no silent default when nothing is installed and nothing was named."""
    if not requested and _dist_version("vllm") is None:
        raise UsageError(
            "vLLM is not installed here, so neuronctl cannot tell which vLLM will launch",
            "pass --vllm-target tnx-fork|v0|plugin (e.g. plugin@0.4.1, v0@0.9.2)",
        )
    return resolve_target(requested)


def cli_target(
    manifest: Manifest, requested: str | Target | None, framework: str | None = None
) -> Target:
    """For the CLI: what is wrong with the artifact first, then which vLLM."""
    framework_for(manifest, framework)
    artifact_spec(manifest)
    return require_target(requested)


# --- the artifact ------------------------------------------------------------------------------


def artifact_spec(manifest: Manifest) -> BuildSpec:
    spec = manifest.spec  # typed when read_manifest validated it
    if not isinstance(spec, BuildSpec):  # a Manifest.model_construct()ed by a caller
        spec = BuildSpec.model_validate(spec)
    if spec.dtype == "auto" or "auto" in (spec.context_buckets, spec.token_gen_buckets):
        raise NeuronctlError("the artifact's manifest spec is not finalized (has 'auto' values)")
    return spec


def framework_for(manifest: Manifest, framework: str | None = None) -> str:
    """The vLLM framework that can load this artifact; `framework` may only confirm it."""
    native = {v: k for k, v in FRAMEWORK_BACKENDS.items()}.get(manifest.backend)
    if native is None:
        raise UsageError(
            f"this artifact was built by the {manifest.backend!r} backend, which vLLM cannot load",
            "serve it with `neuronctl serve` (built-in engine) or rebuild with --backend nxdi",
        )
    if framework is None:
        return native
    wanted = FRAMEWORK_ALIASES.get(framework)
    if wanted is None:
        raise UsageError(f"unknown framework {framework!r}", "use nxdi or tnx")
    if wanted != native:
        # vLLM would fail to load it with the other library and recompile.
        raise UsageError(
            f"this artifact was compiled for {native}, not {wanted}",
            f"use --framework {manifest.backend} or rebuild with "
            f"--backend {FRAMEWORK_BACKENDS[wanted]}",
        )
    return native


def architecture(manifest: Manifest) -> str:
    archs = manifest.architecture.get("architectures") or ["?"]
    return str(archs[0])


def on_device_sampling(spec: BuildSpec, framework: str) -> bool:
    """Whether the compiled graph samples on device (what the backend built, overrides too)."""
    from neuronctl.backends import nxdi_neuron_config, tnx_neuron_config

    if framework == NXDI:
        return bool(nxdi_neuron_config(spec).get("on_device_sampling_config"))
    return bool(tnx_neuron_config(spec).get("on_device_generation"))


def prefix_caching(spec: BuildSpec) -> tuple[int, int] | None:
    """(pa_block_size, pa_num_blocks) of an NxDI artifact compiled with a block KV layout."""
    o = spec.override_neuron_config
    if not (o.get("is_prefix_caching") or o.get("is_block_kv_layout")):
        return None
    return int(o.get("pa_block_size") or 0), int(o.get("pa_num_blocks") or 0)


# --- what each generation gets -------------------------------------------------------------------


@dataclass
class Plan:
    """Engine arguments (LLM(...) keywords; the CLI flags are their dashed names), the
    variables neuronctl sets, and why (one line per generation-specific decision)."""

    target: Target
    framework: str
    args: dict[str, Any]
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)
    max_prompt_tokens: int | None = None  # prompts longer than this crash NxDI
    serve_max_model_len: int | None = None  # the server's cap where there is no prompt cap


@dataclass
class VllmLaunch:
    argv: list[str]
    env: dict[str, str]  # only the variables neuronctl sets; merged over os.environ by the caller
    target: Target | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        t = self.target
        return {
            "generation": t.generation.letter if t else None,
            "vllm_target": t.generation.value if t else None,
            "vllm_version": _dotted(t.vllm) if t else None,
            "plugin_version": _dotted(t.plugin) if t and t.plugin else None,
            "detected": t.detected if t else None,
            "argv": self.argv,
            "env": self.env,
            "notes": self.notes,
        }


def refuse(target: Target, framework: str, spec: BuildSpec, manifest: Manifest) -> None:
    """Raise for a combination that cannot reuse the artifact (vLLM would recompile or fail)."""
    gen, arch, why = target.generation, architecture(manifest), None
    if gen is Generation.NATIVE:
        raise UsageError("vllm-neuron 0.21+ (generation D) is not supported", D_HINT)
    if gen is Generation.TNX_FORK and framework == NXDI:
        why = "generation A (vLLM < 0.7) is supported for Transformers NeuronX artifacts only"
    elif gen is Generation.PLUGIN and framework == TNX:
        why = "the vllm-neuron plugin runs NxD Inference only (TNx ended with SDK 2.26)"
    elif gen is Generation.PLUGIN and spec.draft_model:
        why = "vllm-neuron serves EAGLE speculation only, not a draft model (its README)"
    elif gen is Generation.PLUGIN:
        why = _plugin_refusal(_plugin(target), framework, spec, arch)
    elif gen is not Generation.PLUGIN and prefix_caching(spec):
        why = "block-KV (prefix caching) artifacts are launched for vllm-neuron (C) only"
    elif gen is Generation.TNX_FORK and arch not in a_archs(target.vllm):
        why = f"vLLM {_dotted(target.vllm)}'s TNx loader does not serve {arch}"
    elif gen is Generation.V0 and framework == NXDI and arch not in b_archs(target.vllm):
        why = f"vLLM {_dotted(target.vllm)}'s NxDI loader does not serve {arch}"
    elif gen is Generation.V0 and framework == TNX and target.vllm >= (0, 8):
        if target.frameworks is not None and NXDI in target.frameworks:
            why = (
                "upstream vLLM 0.8+ cannot be told to use TNx (VLLM_NEURON_FRAMEWORK="
                "transformers-neuronx raises AttributeError) and picks NxD Inference, which is "
                "installed here"
            )
    if why:
        raise NeuronctlError(
            f"vLLM {target.describe()} cannot reuse this {FRAMEWORK_BACKENDS[framework]} "
            f"artifact: {why}",
            "pick another --vllm-target or rebuild for it; see docs/neuron.md",
        )


def _plugin(target: Target) -> tuple[int, ...]:
    return target.plugin or DEFAULT_PLUGIN


def plugin_model_name(arch: str) -> str | None:
    """The MODEL_TYPES key vllm-neuron's _get_neuron_model_cls looks `arch` up under."""
    if arch == "LlavaForConditionalGeneration":
        return "pixtral"
    model, sep, _task = arch.removeprefix("Neuron").partition("For")
    if not sep:
        return None
    return C_MODEL_NAMES.get(model.lower(), model.lower())


def _c_release(plugin: tuple[int, ...]) -> tuple[int, ...]:
    """The first plugin release of the SDK `plugin` names (C_MODEL_TYPES' key)."""
    return max((k for k in C_MODEL_TYPES if plugin >= k), default=(0, 1))


def c_model_types(plugin: tuple[int, ...]) -> frozenset[str]:
    return C_MODEL_TYPES[_c_release(plugin)]


def _plugin_refusal(
    plugin: tuple[int, ...], framework: str, spec: BuildSpec, arch: str
) -> str | None:
    if plugin_model_name(arch) not in c_model_types(plugin):
        elsewhere = " or vLLM 0.9's NxDI loader (--vllm-target v0)" if arch in B_ARCHS else ""
        return (
            f"vllm-neuron {_dotted(plugin)} looks {arch} up in the MODEL_TYPES of the NxD "
            f"Inference of SDK {C_SDK[_c_release(plugin)]}, which lacks it, and raises "
            f"ValueError at start-up (serve it with `neuronctl serve`{elsewhere})"
        )
    if plugin < C_CPU_SAMPLING and not on_device_sampling(spec, framework):
        return (
            "vllm-neuron 0.1.0 has no CPU sampler and this artifact was compiled without "
            "on-device sampling, so every request would fail (rebuild with the default "
            "on-device sampling, vLLM's own config, or use vllm-neuron 0.2.0+)"
        )
    return None


def a_archs(vllm: tuple[int, ...]) -> set[str]:
    return A_ARCHS.get(vllm[:2], A_ARCHS[(0, 6)] if vllm >= (0, 6) else A_ARCHS[(0, 3)])


def b_archs(vllm: tuple[int, ...]) -> set[str]:
    return B_ARCHS | (B_FORK_EXTRA if vllm[:2] == (0, 7) else set())


def plan_launch(
    artifact: Path,
    manifest: Manifest,
    target: str | Target | None = None,
    framework: str | None = None,
) -> Plan:
    fw = framework_for(manifest, framework)
    spec = artifact_spec(manifest)
    tgt = resolve_target(target)
    refuse(tgt, fw, spec, manifest)
    root = artifact.resolve()
    plan = Plan(tgt, fw, _common_args(root, spec), _common_env(root, spec, manifest, fw))
    if not on_device_sampling(spec, fw) and tgt.generation is not Generation.PLUGIN:
        # A/B's runners assume on-device sampling unless told otherwise; for TNx the variable
        # also keeps vLLM's NeuronConfig (hence the NEFF cache key) the compiled one. Never for
        # C: there it only makes the loader call `Sampler()`, a module from 0.2.0 on
        # (`from vllm.v1.sample import sampler as Sampler`), so start-up fails; its runner
        # follows the loaded artifact's on_device_sampling_config by itself.
        plan.env["NEURON_ON_DEVICE_SAMPLING_DISABLED"] = "1"
    if fw == NXDI and spec.effective_max_context_length() < spec.seq_len:
        plan.max_prompt_tokens = spec.effective_max_context_length()
    {
        Generation.TNX_FORK: _plan_a,
        Generation.V0: _plan_b,
        Generation.PLUGIN: _plan_c,
    }[tgt.generation](plan, spec)
    return plan


def _common_args(root: Path, spec: BuildSpec) -> dict[str, Any]:
    return {
        # The artifact holds config.json and the tokenizer, so it is the model directory too.
        "model": str(root),
        "tensor_parallel_size": spec.tp_degree,
        "max_num_seqs": spec.batch_size,
        "max_model_len": spec.seq_len,
        "dtype": spec.dtype,
    }


def _common_env(root: Path, spec: BuildSpec, manifest: Manifest, fw: str) -> dict[str, str]:
    env: dict[str, str] = {}
    if fw == NXDI:
        env["NEURON_COMPILED_ARTIFACTS"] = str(root)
    else:
        # Read by vLLM's TNx loader only; the NEFFs are found through the compile cache.
        env["NEURON_CONTEXT_LENGTH_BUCKETS"] = _ints(spec.context_buckets)  # type: ignore[arg-type]
        env["NEURON_TOKEN_GEN_BUCKETS"] = _ints(spec.token_gen_buckets)  # type: ignore[arg-type]
        if spec.quantized:
            env["NEURON_QUANT_DTYPE"] = QUANT_ENV[spec.quantization_dtype]
        env["NEURON_COMPILE_CACHE_URL"] = str(root / TNX_COMPILE_CACHE)
    cc_flags = spec.cc_flags or str(manifest.host.get("NEURON_CC_FLAGS", ""))
    if cc_flags:
        env["NEURON_CC_FLAGS"] = cc_flags
    return env


def _ints(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def _plan_a(plan: Plan, spec: BuildSpec) -> None:
    """TNx forks: TNx through VLLM_NEURON_FRAMEWORK (0.6.x reads it), block_size ==
    max_model_len, the fork's speculation flags."""
    args, v = plan.args, plan.target.vllm
    plan.env["VLLM_NEURON_FRAMEWORK"] = TNX
    args["device"] = "neuron"  # 0.6.x forces block_size = max_model_len only for "neuron"
    if v < (0, 6):
        args["block_size"] = spec.seq_len  # the TNx CB guide: must equal max_model_len
    _tnx_args(plan, spec)
    _fork_speculation(plan, spec)


def _plan_b(plan: Plan, spec: BuildSpec) -> None:
    """V0 worker: --device neuron before 0.9, the platform sets block_size itself, no NxDI
    override (it is setattr'd raw onto the loaded config), speculation per version."""
    args, v = plan.args, plan.target.vllm
    if v < (0, 9):
        args["device"] = "neuron"  # deprecated in 0.9 (auto-detected), gone in 0.10
    if plan.framework == NXDI:
        plan.env["VLLM_NEURON_FRAMEWORK"] = NXDI
        plan.notes.append(
            "no --override-neuron-config: vLLM loads the artifact's neuron_config.json and "
            "setattr()s every override key raw onto it, which only a no-op can survive"
        )
        _cap_by_max_model_len(plan)
    else:
        if v < (0, 8):
            plan.env["VLLM_NEURON_FRAMEWORK"] = TNX
        else:
            plan.notes.append(
                "VLLM_NEURON_FRAMEWORK left unset: upstream 0.8+ raises AttributeError when it "
                "names TNx; unset picks TNx only when NxD Inference is not installed"
            )
        _tnx_args(plan, spec)
    if v < (0, 8):
        _fork_speculation(plan, spec)
    elif spec.draft_model:
        args["speculative_config"] = {
            "model": spec.draft_model,
            "num_speculative_tokens": spec.num_speculative_tokens,
        }


def _plan_c(plan: Plan, spec: BuildSpec) -> None:
    """vllm-neuron: overrides only inside --additional-config, prefix caching decides
    block_size and num_gpu_blocks_override, the prompt cap is max_prompt_length."""
    args, tgt = plan.args, plan.target
    # From 0.2.0 the platform adds vLLM's null block to the count given; before, it is ours.
    null_block = 0 if _plugin(tgt) >= C_NULL_BLOCK_ADDED else 1
    blocks = prefix_caching(spec)
    if blocks is None:
        # platform.py forces block_size = max_model_len: one block per sequence (README 0.4.1:
        # exactly max_num_seqs), plus the null block.
        args["enable_prefix_caching"] = False
        args["num_gpu_blocks_override"] = spec.batch_size + null_block
    else:
        _prefix_caching_args(plan, spec, blocks, null_block)
    if not on_device_sampling(spec, plan.framework):
        plan.notes.append(
            "no on-device sampling in this artifact: the plugin's runner samples on the CPU "
            "(NEURON_ON_DEVICE_SAMPLING_DISABLED is not set: it breaks start-up from 0.2.0)"
        )
    additional: dict[str, Any] = {}
    if plan.max_prompt_tokens is not None:
        if tgt.plugin is None or tgt.plugin >= (0, 2, 2):
            additional["max_prompt_length"] = plan.max_prompt_tokens
        else:
            _cap_by_max_model_len(plan)
    if additional:
        args["additional_config"] = additional
    if len(tgt.platform_plugins) > 1:
        plan.env["VLLM_PLUGINS"] = PLUGIN_ENTRY
        plan.notes.append(
            f"VLLM_PLUGINS={PLUGIN_ENTRY}: {len(tgt.platform_plugins)} platform plugins are "
            f"installed ({', '.join(tgt.platform_plugins)}); this also disables general plugins"
        )


def _prefix_caching_args(
    plan: Plan, spec: BuildSpec, blocks: tuple[int, int], null_block: int
) -> None:
    """vLLM's KV block count must be the compiled pa_num_blocks once the platform has added
    the null block (0.2.0+; the plugin's own compile uses that incremented count), and every
    sequence needs ceil(max_model_len / block_size) blocks besides the null one."""
    block_size, num_blocks = blocks
    needed = -(-spec.seq_len // block_size) * spec.batch_size + 1 if block_size else 0
    if block_size not in BLOCK_SIZES or num_blocks < needed:
        raise NeuronctlError(
            f"this block-KV artifact (pa_block_size={block_size}, pa_num_blocks={num_blocks}) "
            f"cannot be launched: vLLM's --block-size takes {list(BLOCK_SIZES)} and "
            f"vllm-neuron needs at least {needed} blocks (one is vLLM's null block)",
            f"rebuild with a supported pa_block_size and pa_num_blocks >= {needed}",
        )
    plan.args["enable_prefix_caching"] = True
    plan.args["block_size"] = block_size
    plan.args["num_gpu_blocks_override"] = num_blocks - 1 + null_block


def _cap_by_max_model_len(plan: Plan) -> None:
    """No prompt-only cap in this vLLM: cap the whole sequence at the context length, so a
    long prompt is refused by vLLM instead of raising inside NxDI (which stops the engine)."""
    cap = plan.max_prompt_tokens
    if cap is None:
        return
    plan.notes.append(
        f"--max-model-len {cap} (not {plan.args['max_model_len']}): this vLLM has no prompt-"
        "length cap and NxDI raises for prompts longer than the artifact's max_context_length; "
        "`neuronctl generate --engine vllm` checks prompts itself and keeps the full length"
    )
    plan.serve_max_model_len = cap


def _tnx_args(plan: Plan, spec: BuildSpec) -> None:
    plan.args["override_neuron_config"] = override_neuron_config(spec, TNX)
    if spec.quantized:
        plan.args["quantization"] = "neuron_quant"


def _fork_speculation(plan: Plan, spec: BuildSpec) -> None:
    if spec.draft_model:
        plan.args["speculative_model"] = spec.draft_model
        plan.args["num_speculative_tokens"] = spec.num_speculative_tokens
        plan.args["speculative_max_model_len"] = spec.seq_len


def override_neuron_config(
    spec: BuildSpec, framework: str, generation: Generation = Generation.V0
) -> dict[str, Any]:
    """What `--override-neuron-config` (generations A and B) carries.

    NxDI (B): nothing. vLLM builds NeuronConfig(**(defaults | override)) before it reads the
    artifact, then setattr()s each override key raw onto the artifact's loaded config before
    load(): a string torch_dtype or a dict on_device_sampling_config there raises, and
    quantized=True without quantized_checkpoints_path asserts. With NEURON_COMPILED_ARTIFACTS
    set the artifact's neuron_config.json is what runs, so an override can only hurt.
    TNx (A, B): the plain NeuronConfig keys the tnx backend compiled with."""
    if generation is Generation.PLUGIN or framework == NXDI:
        return {}
    from neuronctl.backends import tnx_vllm_override

    return tnx_vllm_override(spec)


# --- argv ----------------------------------------------------------------------------------------


def _flag_value(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def _flags(args: Mapping[str, Any]) -> list[str]:
    argv: list[str] = []
    for name, value in args.items():
        if value == {} and name == "override_neuron_config":
            continue
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{name.replace('_', '-')}")
        else:
            argv += [flag, _flag_value(value)]
    return argv


def serve_launch(
    artifact: Path,
    manifest: Manifest,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    framework: str | None = None,
    target: str | Target | None = None,
    extra_args: Sequence[str] = (),
) -> VllmLaunch:
    """The OpenAI-compatible vLLM server over the artifact (the api_server module works in
    every generation, `vllm serve` only in newer ones)."""
    plan = plan_launch(artifact, manifest, target, framework)
    args = dict(plan.args)
    if plan.serve_max_model_len is not None:
        args["max_model_len"] = plan.serve_max_model_len
    if plan.target.generation is Generation.TNX_FORK and "block_size" in args:
        if args["block_size"] not in OLD_BLOCK_SIZES:
            raise NeuronctlError(
                f"vLLM {_dotted(plan.target.vllm)}'s CLI cannot take --block-size "
                f"{args['block_size']} (choices {list(OLD_BLOCK_SIZES)}) and TNx needs it equal "
                "to max_model_len",
                "use `neuronctl generate --engine vllm` (offline, no CLI) or vLLM 0.6.x-neuron",
            )
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *_flags(args)]
    argv += ["--host", host, "--port", str(port)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    argv += list(extra_args)
    return VllmLaunch(argv=argv, env=plan.env, target=plan.target, notes=plan.notes)


def generate_launch(
    artifact: Path,
    manifest: Manifest,
    prompts_file: Path,
    *,
    framework: str | None = None,
    target: str | Target | None = None,
    sampling: Mapping[str, Any] | None = None,
) -> VllmLaunch:
    """Offline LLM(...).generate over the prompts in `prompts_file` (one per line, or JSONL
    with {"prompt": ...}); prints one JSON line per prompt: {prompt, text, token_ids}."""
    plan = plan_launch(artifact, manifest, target, framework)
    args = {k: v for k, v in plan.args.items() if v != {} or k != "override_neuron_config"}
    argv = [
        sys.executable,
        "-m",
        "neuronctl.vllm",
        "generate",
        "--engine-args",
        json.dumps(args, sort_keys=True),
        "--prompts",
        str(prompts_file.resolve()),
        "--sampling",
        json.dumps(dict(sampling or {}), sort_keys=True),
    ]
    if plan.max_prompt_tokens is not None:
        argv += ["--max-prompt-tokens", str(plan.max_prompt_tokens)]
    notes = [n for n in plan.notes if not n.startswith("--max-model-len")]
    return VllmLaunch(argv=argv, env=plan.env, target=plan.target, notes=notes)


def env_exports(
    artifact: Path,
    manifest: Manifest,
    framework: str | None = None,
    target: str | Target | None = None,
) -> dict[str, str]:
    """The variables that make this generation of vLLM reuse the artifact."""
    return plan_launch(artifact, manifest, target, framework).env


# --- vLLM's default-path directory name ----------------------------------------------------------


def b_neuron_config(spec: BuildSpec) -> dict[str, Any]:
    """The NeuronConfig kwargs vLLM B derives from neuronctl's own B launch of this spec: its
    `_get_default_neuron_config` (vllm model_loader/neuronx_distributed.py) over
    --tensor-parallel-size, --max-num-seqs, --max-model-len (capped at max_context_length,
    see _plan_b) and --dtype, with no --override-neuron-config (neuronctl passes none)."""
    max_model_len = spec.effective_max_context_length()
    return {
        "tp_degree": spec.tp_degree,
        "ctx_batch_size": 1,
        "batch_size": spec.batch_size,
        "max_context_length": max_model_len,
        "seq_len": max_model_len,
        "enable_bucketing": True,
        "is_continuous_batching": True,
        "quantized": False,
        "torch_dtype": spec.dtype,
        "padding_side": "right",
        "on_device_sampling_config": dict(VLLM_SAMPLING),
        "sequence_parallel_enabled": True,
        "lora_serving_config": None,
    }


def no_vllm_dirname(spec: BuildSpec) -> str | None:
    """Why vLLM computes no `<model>/neuron-compiled-artifacts/<md5>` name for this build, or
    None when it does (generation B's NxDI loader, without NEURON_COMPILED_ARTIFACTS)."""
    if spec.backend == "torch":
        return "vLLM cannot load a torch-backend artifact (build with --backend nxdi)"
    if spec.backend == "tnx":
        return "vLLM's Transformers NeuronX path has no such directory (it reuses NEFFs "\
            "through the compile cache)"
    if spec.draft_model:
        return "vLLM B hashes a speculation config neuronctl does not reproduce"
    return None


def vllm_dirname_exact(
    spec: BuildSpec, config: Mapping[str, Any], model_path: str | None = None
) -> tuple[str, bool]:
    """The md5 directory name vLLM B's NxDI loader computes under
    `<model>/neuron-compiled-artifacts/` for `--model model_path` (default spec.model) and
    neuronctl's B launch of `spec`, and whether it is exact.

    vLLM hashes `InferenceConfig.to_json_string()` of the config it builds from its own
    defaults and `--model`, which includes that path as `_name_or_path` (load_weights). So the
    name is exact only with the SDK installed and `model_path` the local directory vLLM is
    given, spelled the same way. vLLM deletes that directory before loading and recompiles
    into it, so it names where a recompile goes, never an artifact to reuse. vllm-neuron
    (generation C) hashes the same way but is always given NEURON_COMPILED_ARTIFACTS here.
    """
    from neuronctl.backends import nxdi_inference_config_json

    why = no_vllm_dirname(spec)
    if why:
        raise UsageError(f"no vLLM directory name: {why}")
    kwargs = b_neuron_config(spec)
    path = model_path if model_path is not None else spec.model
    try:
        text = nxdi_inference_config_json(kwargs, config, path)
        exact = path is not None and Path(path).joinpath("config.json").is_file()
    except ImportError:
        data = {**dict(config), "neuron_config": kwargs}
        text = json.dumps(data, indent=2, sort_keys=True)
        exact = False
    return hashlib.md5(text.encode()).hexdigest(), exact


def vllm_dirname(spec: BuildSpec, config: Mapping[str, Any], model_path: str | None = None) -> str:
    return vllm_dirname_exact(spec, config, model_path)[0]


# --- the offline program generate_launch runs (inside the vLLM environment) ----------------------


def read_prompts(path: Path) -> list[str]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for line in lines:
        item = json.loads(line)
        prompts.append(item if isinstance(item, str) else item["prompt"])
    return prompts


def too_long(lengths: Sequence[int], cap: int | None) -> list[int]:
    """Indexes of prompts longer than the artifact's context encoding accepts."""
    return [] if cap is None else [i for i, n in enumerate(lengths) if n > cap]


def _generate_main(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m neuronctl.vllm generate")
    parser.add_argument("--engine-args", required=True)
    parser.add_argument("--prompts", required=True, type=Path)
    parser.add_argument("--sampling", default="{}")
    parser.add_argument("--max-prompt-tokens", type=int, default=None)
    opts = parser.parse_args(argv)
    from vllm import LLM, SamplingParams  # only present on the serving host

    llm = LLM(**json.loads(opts.engine_args))
    prompts = read_prompts(opts.prompts)
    tokenizer = llm.get_tokenizer()
    long = too_long([len(tokenizer.encode(p)) for p in prompts], opts.max_prompt_tokens)
    if long:
        sys.stderr.write(
            f"error: prompt {long[0] + 1} is longer than the artifact's max_context_length "
            f"({opts.max_prompt_tokens} tokens); NxD Inference would raise inside vLLM\n"
        )
        return 1
    outputs = llm.generate(prompts, SamplingParams(**json.loads(opts.sampling)))
    for prompt, out in zip(prompts, outputs, strict=True):
        first = out.outputs[0]
        row = {"prompt": prompt, "text": first.text, "token_ids": list(first.token_ids)}
        sys.stdout.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["generate"]:
        sys.exit("usage: python -m neuronctl.vllm generate --engine-args JSON --prompts FILE")
    sys.exit(_generate_main(sys.argv[2:]))
