"""What each vLLM generation gets so that it reuses the artifact: the engine arguments and
variables of a `LaunchPlan`, one function per generation, every value from the manifest."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuronctl.errors import NeuronctlError
from neuronctl.spec import BuildSpec
from neuronctl.store.manifest import Manifest
from neuronctl.vllm.artifact import (
    NXDI,
    TNX,
    artifact_spec,
    framework_for,
    on_device_sampling,
    prefix_caching,
)
from neuronctl.vllm.detect import VllmTarget, resolve_target
from neuronctl.vllm.support import refuse
from neuronctl.vllm_generations import Generation

STDIN = "-"  # offline.py's --prompts for JSON lines on standard input

# neuronctl's quantization dtype (NxDI's name) -> vLLM's NEURON_QUANT_DTYPE spelling (TNx only).
QUANT_ENV = {"int8": "s8", "f8e4m3": "f8e4m3fn"}
TNX_COMPILE_CACHE = "neuron-compile-cache"  # inside a tnx artifact (backends/tnx COMPILE_CACHE)
PLUGIN_ENTRY = "neuron"  # vllm-neuron's entry point name (its setup.py)
# vLLM's --block-size choices from 0.9 on (CacheConfig BlockSize Literal).
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
# vLLM V1 keeps KV block 0 as its null block (v1/core/block_pool.py). From 0.2.0 the plugin's
# platform adds it to --num-gpu-blocks-override itself, and its own compile then uses that
# incremented count as pa_num_blocks (platform.py check_and_update_config).
C_NULL_BLOCK_ADDED = (0, 2)


@dataclass
class LaunchPlan:
    """Engine arguments (LLM(...) keywords; the CLI flags are their dashed names), the
    variables neuronctl sets, and why (one line per generation-specific decision)."""

    target: VllmTarget
    framework: str
    args: dict[str, Any]
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)
    max_prompt_tokens: int | None = None  # prompts longer than this crash NxDI
    serve_max_model_len: int | None = None  # the server's cap where there is no prompt cap


def plan_launch(
    artifact: Path,
    manifest: Manifest,
    target: str | VllmTarget | None = None,
    framework: str | None = None,
) -> LaunchPlan:
    fw = framework_for(manifest, framework)
    spec = artifact_spec(manifest)
    tgt = resolve_target(target)
    refuse(tgt, fw, spec, manifest)
    root = artifact.resolve()
    plan = LaunchPlan(tgt, fw, _common_args(root, spec), _common_env(root, spec, manifest, fw))
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


def _plan_a(plan: LaunchPlan, spec: BuildSpec) -> None:
    """TNx forks: TNx through VLLM_NEURON_FRAMEWORK (0.6.x reads it), block_size ==
    max_model_len, the fork's speculation flags. 0.6.x-neuron also loads NxDI artifacts the
    way B does (support.A_NXDI_ARCHS)."""
    args, v = plan.args, plan.target.vllm
    args["device"] = "neuron"  # 0.6.x forces block_size = max_model_len only for "neuron"
    if plan.framework == NXDI:
        # Unset, the fork picks TNx whenever it is installed (neuron_worker.py:35-42).
        plan.env["VLLM_NEURON_FRAMEWORK"] = NXDI
        plan.notes.append(
            "no --override-neuron-config: the 0.6.x-neuron fork setattr()s every override "
            "key raw onto the artifact's loaded neuron config (neuronx_distributed.py:136-138)"
        )
        _cap_by_max_model_len(plan)
        return
    plan.env["VLLM_NEURON_FRAMEWORK"] = TNX
    if v < (0, 6):
        args["block_size"] = spec.seq_len  # the TNx CB guide: must equal max_model_len
    _tnx_args(plan, spec)
    _fork_speculation(plan, spec)


def _plan_b(plan: LaunchPlan, spec: BuildSpec) -> None:
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


def _plan_c(plan: LaunchPlan, spec: BuildSpec) -> None:
    """vllm-neuron: overrides only inside --additional-config, prefix caching decides
    block_size and num_gpu_blocks_override, the prompt cap is max_prompt_length."""
    args, tgt = plan.args, plan.target
    # From 0.2.0 the platform adds vLLM's null block to the count given; before, it is ours.
    null_block = 0 if tgt.plugin_release >= C_NULL_BLOCK_ADDED else 1
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
    plan: LaunchPlan, spec: BuildSpec, blocks: tuple[int, int], null_block: int
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


def _cap_by_max_model_len(plan: LaunchPlan) -> None:
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


def _tnx_args(plan: LaunchPlan, spec: BuildSpec) -> None:
    plan.args["override_neuron_config"] = override_neuron_config(spec, TNX)
    if spec.quantized:
        plan.args["quantization"] = "neuron_quant"


def _fork_speculation(plan: LaunchPlan, spec: BuildSpec) -> None:
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
