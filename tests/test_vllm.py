"""The vLLM launch: built from the artifact's manifest only, per vLLM generation.

Each generation's rules are pinned against the public source they come from; the docstrings
cite file:line at a commit of these repositories:

- B: aws-neuron/upstreaming-to-vllm `dd417b3` (main, = upstream vLLM 0.9 Neuron code) and its
  branch `neuron-2.24-vllm-v0.7.2` (`490ab20f1`, the AWS 0.7.2 fork).
- A: the same repository's `v0.6.x-neuron` branch (`c097c1891`); for 0.3.3 / 0.5.0 the
  vLLM examples of aws-neuron/aws-neuron-sdk
  libraries/transformers-neuronx/transformers-neuronx-developer-guide-for-continuous-batching.rst.
- C: vllm-project/vllm-neuron tags `0.1.0` (`97bb429`), `0.2.0` (`a967125`); the AWS
  release commits in the whn09/vllm-neuron fork: `ad82965` (0.2.2+lts), `4fac6b7`
  (Release 0.4.1), `3afb0a9` (Release 0.5.0).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.spec import ModelShape, OnDeviceSampling, build_spec, finalize
from neuronctl.store.manifest import Manifest, Source, write_manifest
from neuronctl.vllm.artifact import NXDI, TNX, artifact_spec, framework_for
from neuronctl.vllm.detect import (
    VllmTarget,
    detect_target,
    parse_target,
    require_target,
    resolve_target,
)
from neuronctl.vllm.dirname import (
    b_neuron_config,
    no_vllm_dirname,
    vllm_dirname,
    vllm_dirname_exact,
)
from neuronctl.vllm.launch import env_exports, generate_launch, serve_launch
from neuronctl.vllm.offline import read_prompts, too_long
from neuronctl.vllm.rules import override_neuron_config
from neuronctl.vllm.support import plugin_model_name
from neuronctl.vllm_generations import Generation, generation_for, version_tuple
from tests import standins
from tests.helpers import run_in_process

ARCH = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 320,
}
A6 = "tnx-fork@0.6.2"
B9 = "v0@0.9.2"
B_FORK = "v0@0.7.2"
C41 = "plugin@0.4.1"


def make_manifest(
    backend: str = "nxdi", arch: str = "LlamaForCausalLM", **fields: object
) -> Manifest:
    # Non-default values everywhere, so a value taken from a default cannot pass.
    values: dict[str, object] = {
        "backend": backend,
        "tp_degree": 4,
        "batch_size": 3,
        "seq_len": 1024,
        "max_context_length": 512,
        "dtype": "float16",
        "context_buckets": [96, 512],
        "token_gen_buckets": [384, 1024],
        "override_neuron_config": {"fused_qkv": True} if backend == "nxdi" else {},
        "cc_flags": "--model-type=transformer -O1",
    }
    values.update(fields)
    spec = finalize(build_spec(values), ModelShape(num_attention_heads=8, num_key_value_heads=4))
    return Manifest(
        backend=backend,
        backend_versions={"neuronx-cc": "2.15.0"},
        spec=spec.model_dump(mode="json"),
        keys={"graph_key": "g", "weights_key": "w", "artifact_key": "a" * 64},
        source=Source(model="org/model", digest="d"),
        architecture={**ARCH, "architectures": [arch]},
    )


def flags(argv: list[str]) -> dict[str, str]:
    """--name value pairs of an argv (a flag followed by another flag maps to "")."""
    out = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            out[arg[2:]] = "" if nxt.startswith("--") else nxt
    return out


def serve(tmp_path: Path, target: str | VllmTarget, backend: str = "nxdi", **fields: object):
    return serve_launch(tmp_path, make_manifest(backend, **fields), target=target)


# --- which vLLM -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vllm_version", "plugin", "generation"),
    [
        ((0, 3, 3), None, Generation.TNX_FORK),
        ((0, 6, 2), None, Generation.TNX_FORK),
        ((0, 7, 2), None, Generation.V0),
        ((0, 9, 2), None, Generation.V0),
        ((0, 10, 1, 1), None, Generation.V0),
        ((0, 10, 2), None, None),
        ((0, 11, 0), None, None),
        ((0, 10, 2), (0, 1), Generation.PLUGIN),
        ((0, 13, 0), (0, 4, 1), Generation.PLUGIN),
        ((0, 16, 0), (0, 5, 0), Generation.PLUGIN),
        ((0, 21, 0), (0, 21, 0), Generation.NATIVE),
    ],
)
def test_generation_for(vllm_version, plugin, generation) -> None:  # type: ignore[no-untyped-def]
    assert generation_for(vllm_version, plugin) is generation


def fake_dist(root: Path, name: str, version: str, entry_points: str = "") -> None:
    """A real .dist-info on sys.path, which importlib.metadata reads like an installed one."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_points:
        (info / "entry_points.txt").write_text(entry_points)


PLUGIN_EP = "[vllm.platform_plugins]\nneuron = vllm_neuron:register\n"


def test_detects_the_plugin_from_package_metadata(tmp_path: Path, monkeypatch) -> None:
    """vllm-neuron registers `neuron = vllm_neuron:register` in vllm.platform_plugins
    (whn09/vllm-neuron 4fac6b7 setup.py:46-47, 3afb0a9 setup.py:46-47)."""
    fake_dist(tmp_path, "vllm", "0.13.0")
    fake_dist(tmp_path, "vllm-neuron", "0.4.1", PLUGIN_EP)
    monkeypatch.syspath_prepend(str(tmp_path))
    target = detect_target()
    assert target is not None and target.detected
    assert target.generation is Generation.PLUGIN
    assert (target.vllm, target.plugin) == ((0, 13, 0), (0, 4, 1))
    assert "neuron" in target.platform_plugins
    assert resolve_target(None) == target
    # --vllm-target of the same generation keeps what was detected.
    assert parse_target("plugin").platform_plugins == target.platform_plugins


def test_two_platform_plugins_get_vllm_plugins(tmp_path: Path, monkeypatch) -> None:
    """vLLM raises "Only one platform plugin can be activated" when two activate
    (upstreaming-to-vllm dd417b3 vllm/platforms/__init__.py:229-232); VLLM_PLUGINS filters
    them by entry-point name (vllm/plugins/__init__.py:27,43-50)."""
    fake_dist(tmp_path, "vllm", "0.13.0")
    fake_dist(tmp_path, "vllm-neuron", "0.4.1", PLUGIN_EP)
    fake_dist(tmp_path, "other-plugin", "1.0", "[vllm.platform_plugins]\nother = o:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    launch = serve_launch(tmp_path, make_manifest())
    assert launch.env["VLLM_PLUGINS"] == "neuron"
    assert any("VLLM_PLUGINS" in n for n in launch.notes)


def test_one_platform_plugin_needs_no_vllm_plugins(tmp_path: Path) -> None:
    target = VllmTarget(Generation.PLUGIN, (0, 13, 0), (0, 4, 1), ("neuron",))
    assert "VLLM_PLUGINS" not in serve(tmp_path, target).env


def test_vllm_without_the_plugin_after_0_10_1_is_refused(tmp_path: Path, monkeypatch) -> None:
    fake_dist(tmp_path, "vllm", "0.11.0")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(NeuronctlError, match="no Neuron"):
        detect_target()


def test_native_vllm_neuron_is_refused_with_what_to_do(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(UsageError) as exc:
        parse_target("native")
    assert "VLLM_NEURON_DISABLE_WARMUP_COMPILE" in str(exc.value)
    fake_dist(tmp_path, "vllm", "0.21.0")
    fake_dist(tmp_path, "vllm-neuron", "0.21.0", PLUGIN_EP)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match="generation D"):
        resolve_target(None)


@pytest.mark.parametrize(
    ("text", "generation", "version", "plugin"),
    [
        ("tnx-fork", Generation.TNX_FORK, (0, 6, 2), None),
        ("A@0.5.0", Generation.TNX_FORK, (0, 5, 0), None),
        ("v0", Generation.V0, (0, 9, 2), None),
        ("v0@0.7.2", Generation.V0, (0, 7, 2), None),
        ("plugin", Generation.PLUGIN, (0, 13, 0), (0, 4, 1)),
        ("plugin@0.5.0", Generation.PLUGIN, (0, 16, 0), (0, 5, 0)),
        ("C@0.2.2", Generation.PLUGIN, (0, 11, 0), (0, 2, 2)),
    ],
)
def test_parse_target(text: str, generation: Generation, version, plugin) -> None:  # type: ignore[no-untyped-def]
    target = parse_target(text)
    assert (target.generation, target.vllm, target.plugin) == (generation, version, plugin)
    assert not target.detected


@pytest.mark.parametrize("text", ["cuda", "v0@0.12.0", "tnx-fork@0.9.0", "v0@x"])
def test_bad_targets_are_usage_errors(text: str) -> None:
    with pytest.raises(UsageError, match="--vllm-target"):
        parse_target(text)


def test_cli_needs_a_target_when_no_vllm_is_installed() -> None:
    with pytest.raises(UsageError, match="--vllm-target"):
        require_target(None)


# --- generation B: the V0 Neuron worker ------------------------------------------------------


def test_b_nxdi_serve_reuses_the_artifact(tmp_path: Path) -> None:
    """Upstream 0.9 (upstreaming-to-vllm dd417b3):
    - `--block-size` takes only BlockSize = Literal[1, 8, 16, 32, 64, 128] (vllm/config.py:1454)
      and the platform sets block_size = max_model_len itself (vllm/platforms/neuron.py:54-56):
      never pass it.
    - `--device` is deprecated in 0.9 (vllm/engine/arg_utils.py:775-777): not passed.
    - NEURON_COMPILED_ARTIFACTS names the directory it loads
      (model_loader/neuronx_distributed.py:168-169).
    - every override key is setattr'd raw onto the loaded config before load()
      (neuronx_distributed.py:183-186): no --override-neuron-config at all.
    - on-device sampling is assumed unless NEURON_ON_DEVICE_SAMPLING_DISABLED
      (vllm/worker/neuron_model_runner.py:98-109).
    """
    manifest = make_manifest(on_device_sampling="off")
    launch = serve_launch(tmp_path, manifest, port=9123, served_model_name="m", target=B9)
    assert launch.argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    f = flags(launch.argv)
    assert f["model"] == str(tmp_path.resolve())
    assert f["tensor-parallel-size"] == "4"
    assert f["max-num-seqs"] == "3"
    assert f["dtype"] == "float16"
    assert f["port"] == "9123" and f["served-model-name"] == "m"
    for absent in ("block-size", "device", "override-neuron-config", "additional-config"):
        assert absent not in f
    assert launch.env == {
        "NEURON_COMPILED_ARTIFACTS": str(tmp_path.resolve()),
        "VLLM_NEURON_FRAMEWORK": "neuronx-distributed-inference",
        "NEURON_CC_FLAGS": "--model-type=transformer -O1",
        "NEURON_ON_DEVICE_SAMPLING_DISABLED": "1",
    }
    assert launch.target is not None and launch.target.generation is Generation.V0


def test_b_caps_prompts_through_max_model_len(tmp_path: Path) -> None:
    """NxDI raises ValueError("... longer than max_context_length") inside the engine
    (NxDI models/model_wrapper.py) and V0 vLLM has no prompt-only cap: the server gets
    --max-model-len = max_context_length, the offline program a prompt check instead."""
    assert flags(serve(tmp_path, B9).argv)["max-model-len"] == "512"
    full = serve(tmp_path, B9, max_context_length=1024)
    assert flags(full.argv)["max-model-len"] == "1024"
    assert not any("max-model-len" in n for n in full.notes)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    gen = generate_launch(tmp_path, make_manifest(), prompts, target=B9)
    f = flags(gen.argv)
    assert json.loads(f["engine-args"])["max_model_len"] == 1024
    assert f["max-prompt-tokens"] == "512"


def test_b_on_device_sampling_artifact_keeps_it(tmp_path: Path) -> None:
    """The default nxdi build samples on device as vLLM 0.9 compiles itself
    (model_loader/neuronx_distributed.py:599-600): no variable."""
    launch = serve(tmp_path, B9, on_device_sampling={"top_k": 5, "dynamic": True})
    assert "NEURON_ON_DEVICE_SAMPLING_DISABLED" not in launch.env
    assert "NEURON_ON_DEVICE_SAMPLING_DISABLED" not in serve(tmp_path, B9).env


def test_b_fork_and_0_8_take_device_neuron(tmp_path: Path) -> None:
    """The 0.7.2 fork still takes --device neuron (neuron-2.24-vllm-v0.7.2
    vllm/engine/arg_utils.py:688) and sets block_size = max_model_len itself without a block
    KV layout (arg_utils.py:1321-1325); from 0.10 --device is gone."""
    fork = flags(serve(tmp_path, B_FORK).argv)
    assert fork["device"] == "neuron" and "block-size" not in fork
    assert "device" not in flags(serve(tmp_path, "v0@0.10.1").argv)


def test_b_speculation_in_each_spelling(tmp_path: Path) -> None:
    """The fork has --speculative-model/--num-speculative-tokens (neuron-2.24-vllm-v0.7.2
    arg_utils.py:723); upstream 0.9 only --speculative-config JSON (dd417b3
    arg_utils.py:785-789)."""
    spec = {"draft_model": "org/draft", "num_speculative_tokens": 5}
    fork = flags(serve(tmp_path, B_FORK, **spec).argv)
    assert fork["speculative-model"] == "org/draft"
    assert fork["num-speculative-tokens"] == "5"
    assert fork["speculative-max-model-len"] == "1024"
    upstream = flags(serve(tmp_path, B9, **spec).argv)
    assert "speculative-model" not in upstream
    assert json.loads(upstream["speculative-config"]) == {
        "model": "org/draft",
        "num_speculative_tokens": 5,
    }


def test_b_tnx_leaves_the_framework_unset_on_upstream(tmp_path: Path) -> None:
    """dd417b3 vllm/platforms/neuron.py:117-121 returns self.TRANSFORMERS_NEURONX, an
    attribute NeuronPlatform lacks, when VLLM_NEURON_FRAMEWORK names TNx; unset, it picks
    NxDI when installed (:123-126), else TNx (:128). The 0.7.2 fork reads it safely
    (neuron-2.24-vllm-v0.7.2 vllm/worker/utils.py:74)."""
    upstream = serve(tmp_path, B9, "tnx", quantized=True)
    assert "VLLM_NEURON_FRAMEWORK" not in upstream.env
    assert upstream.env["NEURON_QUANT_DTYPE"] == "s8"
    assert flags(upstream.argv)["quantization"] == "neuron_quant"
    fork = serve(tmp_path, B_FORK, "tnx")
    assert fork.env["VLLM_NEURON_FRAMEWORK"] == "transformers-neuronx"
    with_nxdi = VllmTarget(Generation.V0, (0, 9, 2), frameworks=frozenset({NXDI, TNX}))
    with pytest.raises(NeuronctlError, match="picks NxD Inference"):
        serve(tmp_path, with_nxdi, "tnx")
    tnx_only = VllmTarget(Generation.V0, (0, 9, 2), frameworks=frozenset({TNX}))
    assert "VLLM_NEURON_FRAMEWORK" not in serve(tmp_path, tnx_only, "tnx").env


def test_b_refuses_models_its_loader_does_not_serve(tmp_path: Path) -> None:
    """_NEURON_SUPPORTED_MODELS: Llama, Mistral, Dbrx, Mixtral, Mllama at dd417b3
    (model_loader/neuronx_distributed.py:52-68); the 2.24 fork adds Qwen2 (its :70-72)."""
    with pytest.raises(NeuronctlError, match="does not serve Qwen2ForCausalLM"):
        serve(tmp_path, B9, arch="Qwen2ForCausalLM")
    assert serve(tmp_path, B_FORK, arch="Qwen2ForCausalLM").argv
    assert serve(tmp_path, C41, arch="Qwen2ForCausalLM").argv  # C: whatever NxDI has


def test_b_override_is_nothing_for_nxdi(tmp_path: Path) -> None:
    spec = artifact_spec(make_manifest(quantized=True, on_device_sampling={"top_k": 5}))
    assert override_neuron_config(spec, NXDI) == {}


# --- generation C: the vllm-neuron plugin -----------------------------------------------------


def test_c_nxdi_serve_follows_the_plugin_rules(tmp_path: Path) -> None:
    """vllm-neuron 0.4.1 (whn09/vllm-neuron 4fac6b7) and 0.5.0 (3afb0a9):
    - with prefix caching off block_size is forced to max_model_len (platform.py:300-302;
      0.5.0 :379-381) and num_gpu_blocks_override must be exactly max_num_seqs
      (README.md:288-291); the platform adds the null block itself (platform.py:252).
    - overrides live in additional_config["override_neuron_config"] (underscore key,
      worker/neuronx_distributed_model_loader.py:1014) and are ignored when
      NEURON_COMPILED_ARTIFACTS loads (:221-223, :250-255): none are sent.
    - the prompt cap is additional_config["max_prompt_length"] (platform.py:235-237; 0.5.0
      :314-316), which must equal the artifact's max_context_length
      (worker/neuronx_distributed_model_runner.py:662-690).
    - NxDI only, no --device, no VLLM_NEURON_FRAMEWORK (platform.py:332-349).
    """
    for target in (C41, "plugin@0.5.0"):
        launch = serve(tmp_path, target)
        f = flags(launch.argv)
        assert "no-enable-prefix-caching" in f and "enable-prefix-caching" not in f
        assert f["num-gpu-blocks-override"] == "3"
        assert f["max-model-len"] == "1024"
        assert json.loads(f["additional-config"]) == {"max_prompt_length": 512}
        for absent in ("block-size", "device", "override-neuron-config", "speculative-model"):
            assert absent not in f
        assert launch.env == {
            "NEURON_COMPILED_ARTIFACTS": str(tmp_path.resolve()),
            "NEURON_CC_FLAGS": "--model-type=transformer -O1",
        }
    assert "additional-config" not in flags(serve(tmp_path, C41, max_context_length=1024).argv)


PLUGINS = ("plugin@0.1.0", "plugin@0.2.0", "plugin@0.2.2", "plugin@0.4.1", "plugin@0.5.0")


@pytest.mark.parametrize("target", PLUGINS)
def test_c_default_build_serves_on_every_release(tmp_path: Path, target: str) -> None:
    """The default nxdi build compiles the on-device sampling vLLM compiles itself,
    OnDeviceSamplingConfig(dynamic=True, deterministic=False) (loader
    `_get_default_neuron_config`: 4fac6b7 :1067-1069), so it is launched on 0.1.0 too, whose
    NeuronCausalLM.sample raises NotImplementedError("CPU sampler not implemented") without it
    (97bb429 loader :376). No release gets NEURON_ON_DEVICE_SAMPLING_DISABLED: it only makes
    NeuronModelBase.__init__ call `Sampler()` (97bb429/a967125/ad82965 loader :70, 4fac6b7 and
    3afb0a9 :81), a module from 0.2.0 on (`from vllm.v1.sample import sampler as Sampler`,
    a967125 :47, 4fac6b7 :54). Without prefix caching vLLM needs one block per sequence
    besides its null block 0 (vLLM 0.10.2 v1/core/block_pool.py:69); from 0.2.0 the platform
    adds that block to --num-gpu-blocks-override (a967125 platform.py:158, ad82965 :229,
    4fac6b7 :252, 3afb0a9 :331), 0.1.0's does not (97bb429 platform.py, no such line)."""
    manifest = make_manifest()
    assert manifest.spec.on_device_sampling == OnDeviceSampling(dynamic=True)
    launch = serve(tmp_path, target)
    f = flags(launch.argv)
    assert "NEURON_ON_DEVICE_SAMPLING_DISABLED" not in launch.env
    assert "no-enable-prefix-caching" in f and "block-size" not in f
    assert f["num-gpu-blocks-override"] == ("4" if target == "plugin@0.1.0" else "3")


@pytest.mark.parametrize("target", PLUGINS)
def test_c_without_on_device_sampling(tmp_path: Path, target: str) -> None:
    """`--on-device-sampling off`: 0.1.0 cannot sample on the CPU (97bb429 loader :376), so
    the launch is refused with what to do; 0.2.0+ sample on the CPU when the loaded artifact
    has no on_device_sampling_config (a967125 runner :140, :230-238) and must not be told
    NEURON_ON_DEVICE_SAMPLING_DISABLED (start-up TypeError, see above)."""
    if target == "plugin@0.1.0":
        with pytest.raises(NeuronctlError, match="no CPU sampler.*vllm-neuron 0.2.0"):
            serve(tmp_path, target, on_device_sampling="off")
        return
    launch = serve(tmp_path, target, on_device_sampling="off")
    assert "NEURON_ON_DEVICE_SAMPLING_DISABLED" not in launch.env
    assert any("samples on the CPU" in n for n in launch.notes)


@pytest.mark.parametrize("target", PLUGINS)
def test_c_prefix_caching_block_count_per_release(tmp_path: Path, target: str) -> None:
    """With prefix caching on, block_size must be given (4fac6b7 platform.py:305-308) and
    vLLM's block count must be the compiled pa_num_blocks once the platform has added the null
    block: from 0.2.0 it adds 1 (platform.py lines above) and the plugin's own compile uses
    that count as pa_num_blocks (4fac6b7 loader `_handle_pa_num_blocks` :1122-1168), so
    neuronctl passes pa_num_blocks - 1; 0.1.0 adds nothing, so it gets pa_num_blocks. The
    sequences need ceil(1024 / 32) * 3 = 96 blocks besides the null one (4fac6b7 loader
    `_validate_neuron_config` :1183-1200)."""
    block_kv = {"is_prefix_caching": True, "is_block_kv_layout": True, "pa_block_size": 32}
    launch = serve(tmp_path, target, override_neuron_config={**block_kv, "pa_num_blocks": 97})
    f = flags(launch.argv)
    assert "enable-prefix-caching" in f and "no-enable-prefix-caching" not in f
    assert f["block-size"] == "32"
    assert f["num-gpu-blocks-override"] == ("97" if target == "plugin@0.1.0" else "96")
    with pytest.raises(NeuronctlError, match="pa_num_blocks >= 97"):
        serve(tmp_path, target, override_neuron_config={**block_kv, "pa_num_blocks": 96})


@pytest.mark.parametrize("target", PLUGINS)
@pytest.mark.parametrize(
    ("arch", "served"),
    [("LlamaForCausalLM", True), ("Qwen3ForCausalLM", True), ("Qwen3MoeForCausalLM", True),
     ("MistralForCausalLM", False), ("Gemma3ForCausalLM", False)],
)  # fmt: skip
def test_c_refuses_architectures_its_sdk_cannot_load(
    tmp_path: Path, target: str, arch: str, served: bool
) -> None:
    """The plugin resolves the architecture through NxDI utils/constants.py MODEL_TYPES
    (`_get_neuron_model_cls`: 97bb429 loader :633-655, 4fac6b7 :921-977), raising ValueError
    "is not supported on Neuron for now" for a name it lacks. The SDKs the releases' READMEs
    name (NxDI e07f056 = 2.26, fcb5a86 = 2.27, cd3abf3 = 2.28 utils/constants.py:47) have no
    "mistral" and no "gemma3"; NxDI main adds them (constants.py:55, :65)."""
    if served:
        assert serve(tmp_path, target, arch=arch).argv
        return
    with pytest.raises(NeuronctlError, match=f"looks {arch} up in the MODEL_TYPES"):
        serve(tmp_path, target, arch=arch)


def test_plugin_model_name_follows_the_loader() -> None:
    """4fac6b7 loader :945-972: the part before "For", lowercased, with its special cases."""
    assert plugin_model_name("LlamaForCausalLM") == "llama"
    assert plugin_model_name("NeuronQwen3MoeForCausalLM") == "qwen3_moe"
    assert plugin_model_name("GptOssForCausalLM") == "gpt_oss"
    assert plugin_model_name("LlavaForConditionalGeneration") == "pixtral"
    assert plugin_model_name("Llama") is None


def test_c_before_0_2_2_caps_through_max_model_len(tmp_path: Path) -> None:
    """max_prompt_length appears in 0.2.2+lts (whn09 ad82965 platform.py:217-218); the
    vllm-project 0.2.0 tag's platform.py has no such key."""
    f = flags(serve(tmp_path, "plugin@0.2.0").argv)
    assert f["max-model-len"] == "512" and "additional-config" not in f
    assert "additional-config" in flags(serve(tmp_path, "plugin@0.2.2").argv)


def test_c_prefix_caching_artifact_limits(tmp_path: Path) -> None:
    """vLLM's --block-size choices (CacheConfig BlockSize); block-KV artifacts only on C."""
    block_kv = {"is_prefix_caching": True, "is_block_kv_layout": True, "pa_block_size": 32}
    with pytest.raises(NeuronctlError, match="--block-size takes"):
        serve(tmp_path, C41, override_neuron_config={**block_kv, "pa_block_size": 48})
    with pytest.raises(NeuronctlError, match="C\\) only"):
        serve(tmp_path, B9, override_neuron_config={**block_kv, "pa_num_blocks": 96})


def test_c_refuses_tnx_and_draft_models(tmp_path: Path) -> None:
    """The plugin's framework is NxDI only (platform.py:343-349); draft-model speculation is
    only on the legacy V0 fork (README.md:297)."""
    with pytest.raises(NeuronctlError, match="NxD Inference only"):
        serve(tmp_path, C41, "tnx")
    with pytest.raises(NeuronctlError, match="EAGLE"):
        serve(tmp_path, C41, draft_model="org/draft", num_speculative_tokens=4)


def test_c_generate_passes_additional_config_as_a_dict(tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    launch = generate_launch(tmp_path, make_manifest(), prompts, target=C41)
    engine = json.loads(flags(launch.argv)["engine-args"])
    assert engine["additional_config"] == {"max_prompt_length": 512}
    assert engine["enable_prefix_caching"] is False
    assert engine["num_gpu_blocks_override"] == 3
    assert "override_neuron_config" not in engine and "block_size" not in engine


# --- generation A: the TNx forks --------------------------------------------------------------


def test_a_tnx_serve(tmp_path: Path) -> None:
    """v0.6.x-neuron: --block-size choices are [8, 16, 32] (vllm/engine/arg_utils.py:355-358)
    and block_size is forced to max_model_len only when device == "neuron" (:880-881), so
    --device neuron and no --block-size; VLLM_NEURON_FRAMEWORK is read safely
    (vllm/worker/neuron_worker.py:35-42); buckets (model_loader/neuron.py:296-298) and
    NEURON_QUANT_DTYPE (layers/quantization/neuron_quant.py:21) come from the environment."""
    launch = serve(tmp_path, A6, "tnx", quantized=True, quantization_dtype="f8e4m3fn")
    f = flags(launch.argv)
    assert f["device"] == "neuron" and "block-size" not in f
    assert f["max-model-len"] == "1024" and f["quantization"] == "neuron_quant"
    assert json.loads(f["override-neuron-config"]) == {"on_device_embedding": True}
    assert launch.env["VLLM_NEURON_FRAMEWORK"] == "transformers-neuronx"
    assert launch.env["NEURON_QUANT_DTYPE"] == "f8e4m3fn"
    assert launch.env["NEURON_CONTEXT_LENGTH_BUCKETS"] == "96,512"
    assert launch.env["NEURON_TOKEN_GEN_BUCKETS"] == "384,1024"
    cache = tmp_path.resolve() / "neuron-compile-cache"
    assert launch.env["NEURON_COMPILE_CACHE_URL"] == str(cache)
    assert "NEURON_COMPILED_ARTIFACTS" not in launch.env  # read by the NxDI loader only


def test_a_speculation_uses_the_fork_flags(tmp_path: Path) -> None:
    """v0.6.x-neuron arg_utils.py:619 --speculative-model."""
    f = flags(serve(tmp_path, A6, "tnx", draft_model="org/d", num_speculative_tokens=3).argv)
    assert f["speculative-model"] == "org/d" and f["num-speculative-tokens"] == "3"


def test_a_before_0_6_needs_block_size_equal_to_max_model_len(tmp_path: Path) -> None:
    """Seeds 000/003: block_size must equal max_model_len for TNx continuous batching; the
    0.3/0.5 CLI only takes --block-size 8/16/32/128, so serving seq_len 1024 is refused and
    the offline program passes it in Python."""
    with pytest.raises(NeuronctlError, match="cannot take --block-size 1024"):
        serve(tmp_path, "tnx-fork@0.5.0", "tnx")
    f = flags(serve(tmp_path, "tnx-fork@0.5.0", "tnx", seq_len=128, max_context_length=128,
                    context_buckets=[128], token_gen_buckets=[128]).argv)  # fmt: skip
    assert f["block-size"] == "128"
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    launch = generate_launch(tmp_path, make_manifest("tnx"), prompts, target="A@0.5.0")
    assert json.loads(flags(launch.argv)["engine-args"])["block_size"] == 1024


def test_a_refuses_unserved_models(tmp_path: Path) -> None:
    with pytest.raises(NeuronctlError, match="does not serve MistralForCausalLM"):
        serve(tmp_path, "tnx-fork@0.3.3", "tnx", arch="MistralForCausalLM")


A_NXDI_LOADER = "vllm/model_executor/model_loader/neuronx_distributed.py"


def test_a_0_6_loads_nxdi_artifacts_as_b_does(tmp_path: Path) -> None:
    """The v0.6.x-neuron fork (c097c1891) has an NxD Inference loader: with
    VLLM_NEURON_FRAMEWORK=neuronx-distributed-inference (vllm/worker/neuron_worker.py:35-42;
    unset, TNx wins when installed) it loads NEURON_COMPILED_ARTIFACTS
    (neuronx_distributed.py:124-125), setattr()s every override key onto the loaded config
    (:136-138, so none is passed), and its vLLM-built config asks for on-device sampling
    unconditionally (:421-437, read at :81 and :97), so an artifact compiled without it is
    refused. vLLM 0.3/0.5 have no such loader. It serves Llama, DBRX, Mixtral (:41-50)."""
    launch = serve(tmp_path, A6)
    f = flags(launch.argv)
    assert launch.env["VLLM_NEURON_FRAMEWORK"] == NXDI
    assert launch.env["NEURON_COMPILED_ARTIFACTS"] == str(tmp_path.resolve())
    assert f["device"] == "neuron" and f["max-model-len"] == "512"  # max_context_length
    assert "override-neuron-config" not in f and "block-size" not in f
    for target, fields, why in (
        ("tnx-fork@0.5.0", {}, "only the Transformers NeuronX loader"),
        (A6, {"arch": "MistralForCausalLM"}, "does not serve MistralForCausalLM"),
        (A6, {"on_device_sampling": "off"}, "without on-device sampling"),
        (A6, {"draft_model": "org/d", "num_speculative_tokens": 3}, "speculation"),
    ):
        with pytest.raises(NeuronctlError, match=why):
            serve(tmp_path, target, "nxdi", **fields)  # type: ignore[arg-type]
    loader = git_show(UPSTREAMING, "c097c1891", A_NXDI_LOADER).splitlines()
    assert "NEURON_COMPILED_ARTIFACTS" in loader[123] and "setattr" in loader[137]
    assert "self.config.neuron_config = neuron_config" in loader[119]
    assert "on_device_sampling_config=on_device_sampling_config" in "".join(loader[420:437])
    served = set(re.findall(r'^\s+"(\w+)": \(', "\n".join(loader[40:50]), re.M))
    assert served == {"LlamaForCausalLM", "DbrxForCausalLM", "MixtralForCausalLM",
                      "MllamaForConditionalGeneration"}  # fmt: skip
    worker = git_show(UPSTREAMING, "c097c1891", "vllm/worker/neuron_worker.py").splitlines()
    assert 'os.environ.get("VLLM_NEURON_FRAMEWORK")' in worker[34]


def test_tnx_sampling_env_follows_what_was_compiled(tmp_path: Path) -> None:
    """vLLM's TNx path adds a dynamic on-device GenerationConfig to the NeuronConfig unless
    NEURON_ON_DEVICE_SAMPLING_DISABLED (dd417b3 neuron_model_runner.py:108-130), which changes
    the HLO, hence the NEFF cache key."""
    plain = serve(tmp_path, A6, "tnx")
    assert plain.env["NEURON_ON_DEVICE_SAMPLING_DISABLED"] == "1"
    sampled = serve(tmp_path, A6, "tnx", on_device_sampling={"top_k": 5, "dynamic": True})
    assert "NEURON_ON_DEVICE_SAMPLING_DISABLED" not in sampled.env


# --- shared ---------------------------------------------------------------------------------


def test_launch_as_dict_names_the_generation(tmp_path: Path) -> None:
    data = serve(tmp_path, C41).as_dict()
    assert data["generation"] == "C" and data["vllm_target"] == "plugin"
    assert data["vllm_version"] == "0.13.0" and data["plugin_version"] == "0.4.1"
    assert data["detected"] is False and data["argv"][1:3] == [
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]


def test_relative_artifact_path_is_made_absolute(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = env_exports(Path("art"), make_manifest(), target=C41)
    assert env["NEURON_COMPILED_ARTIFACTS"] == str(tmp_path.resolve() / "art")


def test_extra_args_are_appended(tmp_path: Path) -> None:
    launch = serve_launch(
        tmp_path, make_manifest(), target=C41, extra_args=["--enforce-eager"]
    )
    assert launch.argv[-1] == "--enforce-eager"


@pytest.mark.parametrize(
    ("backend", "framework", "ok"),
    [
        ("nxdi", None, "neuronx-distributed-inference"),
        ("nxdi", "nxdi", "neuronx-distributed-inference"),
        ("tnx", "transformers-neuronx", "transformers-neuronx"),
        ("nxdi", "tnx", None),
        ("tnx", "nxdi", None),
        ("torch", None, None),
        ("nxdi", "cuda", None),
    ],
)
def test_framework_for(backend: str, framework: str | None, ok: str | None) -> None:
    manifest = make_manifest(backend) if backend != "torch" else make_manifest("nxdi")
    manifest = manifest.model_copy(update={"backend": backend})
    if ok is None:
        with pytest.raises(UsageError):
            framework_for(manifest, framework)
    else:
        assert framework_for(manifest, framework) == ok


def test_generate_launch_runs_the_offline_program(tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    launch = generate_launch(
        tmp_path, make_manifest("tnx"), prompts, sampling={"top_k": 7}, target=B_FORK
    )
    assert launch.argv[:4] == [sys.executable, "-m", "neuronctl.vllm", "generate"]
    f = flags(launch.argv)
    engine = json.loads(f["engine-args"])
    assert engine["max_num_seqs"] == 3 and engine["max_model_len"] == 1024
    assert engine["tensor_parallel_size"] == 4 and engine["device"] == "neuron"
    assert "block_size" not in engine
    assert json.loads(f["sampling"]) == {"top_k": 7}
    assert f["prompts"] == str(prompts.resolve())
    assert "max-prompt-tokens" not in f  # TNx: not an NxDI context-length limit
    assert launch.env["VLLM_NEURON_FRAMEWORK"] == "transformers-neuronx"


def test_too_long() -> None:
    assert too_long([3, 600, 512, 513], 512) == [1, 3]
    assert too_long([10_000], None) == []


def test_read_prompts_text_and_jsonl(tmp_path: Path) -> None:
    text = tmp_path / "p.txt"
    text.write_text("a b\n\nc\n")
    assert read_prompts(text) == ["a b", "c"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "x"}\n"y"\n')
    assert read_prompts(jsonl) == ["x", "y"]


def test_vllm_dirname_follows_the_nxdi_config(tmp_path: Path) -> None:
    spec = make_manifest().spec  # typed: the manifest reads it back as a BuildSpec
    name, exact = vllm_dirname_exact(spec, ARCH)
    assert len(name) == 32 and int(name, 16) >= 0
    assert not exact  # no SDK here
    other = make_manifest(batch_size=2).spec
    assert vllm_dirname(other, ARCH) != name
    assert vllm_dirname(spec, ARCH) == name


def test_vllm_dirname_hashes_what_vllm_b_builds_from_its_own_defaults() -> None:
    """vLLM B hashes InferenceConfig(NeuronConfig(**(_get_default_neuron_config(...) |
    override))) (dd417b3 model_loader/neuronx_distributed.py:160-167, defaults :594-617)
    over neuronctl's B flags, which carry no override: not the build kwargs.
    Its max_model_len is the B launch's, capped at max_context_length (_plan_b)."""
    spec = make_manifest().spec
    kwargs = b_neuron_config(spec)
    assert kwargs["seq_len"] == kwargs["max_context_length"] == 512
    assert kwargs["on_device_sampling_config"] == {"dynamic": True, "deterministic": False}
    assert kwargs["sequence_parallel_enabled"] is True and "fused_qkv" not in kwargs
    # The build's own settings (here fused_qkv, buckets) do not move vLLM's name.
    same = make_manifest(override_neuron_config={}, context_buckets=[512]).spec
    assert vllm_dirname(same, ARCH) == vllm_dirname(spec, ARCH)


@pytest.mark.parametrize(
    ("backend", "fields", "why"),
    [("torch", {}, "cannot load a torch-backend"), ("tnx", {}, "compile cache"),
     ("nxdi", {"draft_model": "org/d", "num_speculative_tokens": 2}, "speculation")],
)  # fmt: skip
def test_no_vllm_dirname_says_why(backend: str, fields: dict, why: str) -> None:
    spec = build_spec({"backend": backend, "dtype": "bfloat16", **fields})
    assert why in (no_vllm_dirname(spec) or "")
    with pytest.raises(UsageError, match=why):
        vllm_dirname(spec, ARCH)


def test_hash_vllm_for_a_torch_build_says_there_is_none(tiny_llama, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from neuronctl.cli.main import app

    args = ["hash", str(tiny_llama), "--vllm", "--json", "--store", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["vllm_dirname"] is None and "torch-backend" in data["vllm_dirname_note"]
    assert data["vllm_dirname_plugin"] is None
    assert "none for vllm-neuron (generation C)" in data["vllm_dirname_plugin_note"]
    text = CliRunner().invoke(app, args[:-3] + ["--store", str(tmp_path)]).output
    assert "vllm_dirname_plugin" in text and "generation C" in text


def test_env_exports_work_from_a_written_manifest(tmp_path: Path) -> None:
    from neuronctl.store.manifest import read_manifest

    write_manifest(tmp_path, make_manifest("tnx"))
    env = env_exports(tmp_path, read_manifest(tmp_path), "tnx", target=A6)
    assert env["NEURON_CONTEXT_LENGTH_BUCKETS"] == "96,512"


def test_version_tuple() -> None:
    """The one version reader, vllm's and doctor's (packaging's release numbers)."""
    assert version_tuple("0.6.dev0+neuron215") == (0, 6)
    assert version_tuple("0.10.1.1") == (0, 10, 1, 1)
    assert version_tuple("0.2.2+lts") == (0, 2, 2)
    assert version_tuple("2.1.0") == (2, 1, 0)
    assert version_tuple("0.5.3rc1") == (0, 5, 3)
    assert version_tuple("not a version") == ()


# --- the launch against the real vLLM sources (when their git mirrors are on this host) -------

# Bare git mirrors laid out as <owner>+<name>/repo (`git clone --bare
# https://github.com/<owner>/<name> $NEURONCTL_MIRRORS/<owner>+<name>/repo`); unset, the
# tests that read them skip and say so.
MIRRORS_VAR = "NEURONCTL_MIRRORS"
MIRRORS = Path(os.environ.get(MIRRORS_VAR) or "/nonexistent-set-NEURONCTL_MIRRORS")
UPSTREAMING = MIRRORS / "aws-neuron+upstreaming-to-vllm" / "repo"
PLUGIN_REPOS = {
    "97bb429": MIRRORS / "vllm-project+vllm-neuron" / "repo",  # 0.1.0
    "a967125": MIRRORS / "vllm-project+vllm-neuron" / "repo",  # 0.2.0
    "ad82965": MIRRORS / "whn09+vllm-neuron" / "repo",  # 0.2.2+lts
    "4fac6b7": MIRRORS / "whn09+vllm-neuron" / "repo",  # 0.4.1
    "3afb0a9": MIRRORS / "whn09+vllm-neuron" / "repo",  # 0.5.0
}


def git_show(repo: Path, ref: str, path: str) -> str:
    if not os.environ.get(MIRRORS_VAR):
        pytest.skip(
            f"set {MIRRORS_VAR} to a folder of bare git mirrors laid out as "
            "<owner>+<name>/repo (aws-neuron/upstreaming-to-vllm, vllm-project/vllm-neuron, "
            "whn09/vllm-neuron) to check launches against the real vLLM sources"
        )
    if not repo.is_dir():
        pytest.skip(f"no git mirror at {repo} (under {MIRRORS_VAR})")
    out = subprocess.run(
        ["git", f"--git-dir={repo}", "show", f"{ref}:{path}"], capture_output=True, text=True
    )
    if out.returncode != 0:
        pytest.skip(f"{ref}:{path} not in {repo}")
    return out.stdout


@functools.cache
def reads_env(repo: Path, ref: str, package: str) -> frozenset[str]:
    """The environment variable names a source tree reads (os.getenv / os.environ / envs)."""
    out = subprocess.run(
        ["git", f"--git-dir={repo}", "grep", "-h", "-o", "-E", '"[A-Z][A-Z0-9_]+"', ref, "--",
         f"{package}/*.py"],
        capture_output=True, text=True,
    )  # fmt: skip
    return frozenset(word.strip('"') for word in out.stdout.split())


def block_size_choices(ref: str) -> list[int]:
    config = git_show(UPSTREAMING, ref, "vllm/config.py")
    found = re.search(r"BlockSize = Literal\[([^\]]*)\]", config)
    if not found:
        args = git_show(UPSTREAMING, ref, "vllm/engine/arg_utils.py")
        found = re.search(r"'--block-size',[^)]*?choices=\[([^\]]*)\]", args, re.S)
    assert found, f"no --block-size choices at {ref}"
    return [int(x) for x in found.group(1).split(",")]


V0_LAUNCHES = [  # (target, source ref, backend, spec fields)
    (A6, "c097c1891", "nxdi", {}),
    (A6, "c097c1891", "tnx", {"quantized": True}),
    (A6, "c097c1891", "tnx", {"draft_model": "org/d", "num_speculative_tokens": 3}),
    (B_FORK, "490ab20f1", "nxdi", {"draft_model": "org/d", "num_speculative_tokens": 3}),
    (B_FORK, "490ab20f1", "tnx", {"quantized": True}),
    (B9, "dd417b3", "nxdi", {"draft_model": "org/d", "num_speculative_tokens": 3}),
    (B9, "dd417b3", "nxdi", {"on_device_sampling": {"top_k": 5}}),
    (B9, "dd417b3", "tnx", {"quantized": True}),
]


@pytest.mark.parametrize(("target", "ref", "backend", "fields"), V0_LAUNCHES)
def test_a_and_b_launches_against_their_source(tmp_path, target, ref, backend, fields) -> None:  # type: ignore[no-untyped-def]
    """Checked against that vLLM's source, on neuronctl's own argv: every
    flag exists in that vLLM's argparse (engine/arg_utils.py, entrypoints/openai/cli_args.py),
    a --block-size is one of its choices, every variable is read by that vLLM (the compiler's
    and the TNx cache's excepted), TNx is never named where the platform raises for it, and an
    NxDI artifact's shorter context length caps what the server admits."""
    launch = serve(tmp_path, target, backend, **fields)
    cli = git_show(UPSTREAMING, ref, "vllm/engine/arg_utils.py")
    cli += git_show(UPSTREAMING, ref, "vllm/entrypoints/openai/cli_args.py")
    f = flags(launch.argv)
    for name in f:
        assert f'"--{name}"' in cli or f"'--{name}'" in cli, f"--{name} unknown at {ref}"
    if "block-size" in f:
        assert int(f["block-size"]) in block_size_choices(ref)
    read = reads_env(UPSTREAMING, ref, "vllm")
    for var in set(launch.env) - {"NEURON_CC_FLAGS", "NEURON_COMPILE_CACHE_URL"}:
        assert var in read, f"{var} is not read at {ref}"
    if ref == "dd417b3":  # vllm/platforms/neuron.py:121 returns self.TRANSFORMERS_NEURONX
        assert launch.env.get("VLLM_NEURON_FRAMEWORK") != TNX
    if backend == "nxdi":
        assert int(f["max-model-len"]) <= 512  # the fixture's max_context_length


@pytest.mark.parametrize(("target", "ref"), [
    ("plugin@0.1.0", "97bb429"), ("plugin@0.2.0", "a967125"), ("plugin@0.2.2", "ad82965"),
    ("plugin@0.4.1", "4fac6b7"), ("plugin@0.5.0", "3afb0a9"),
])  # fmt: skip
def test_c_launches_against_the_plugin_source(tmp_path: Path, target: str, ref: str) -> None:
    """Every variable neuronctl sets is read by that plugin release, every additional_config
    key is one it reads, and a prompt cap is in place one way or the other."""
    repo = PLUGIN_REPOS[ref]
    git_show(repo, ref, "setup.py")  # skips without the mirror
    launch = serve(tmp_path, target)
    for var in set(launch.env) - {"NEURON_CC_FLAGS"}:
        assert var in reads_env(repo, ref, "vllm_neuron"), f"{var} is not read at {ref}"
    f = flags(launch.argv)
    additional = json.loads(f.get("additional-config", "{}"))
    platform = git_show(repo, ref, "vllm_neuron/platform.py")
    for key in additional:
        read = re.search(rf'additional_config\.get\(\s*"{key}"', platform)
        assert read, f"additional_config[{key!r}] is not read at {ref}"
    assert additional.get("max_prompt_length") == 512 or f["max-model-len"] == "512"


# --- the CLI over a built artifact ----------------------------------------------------------

neuron_standins = standins.neuron_standins  # the stand-in SDK fixture


def run_cli(args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    return run_in_process(args, capsys, monkeypatch)


def test_dry_runs_show_what_each_generation_runs(  # type: ignore[no-untyped-def]
    neuron_standins, tiny_llama, tmp_path, capsys, monkeypatch
) -> None:
    import neuronctl.doctor as doctor
    from tests.test_nxdi import compile_nxdi

    _build, outcome = compile_nxdi(tiny_llama, tmp_path / "store")
    monkeypatch.setattr(doctor, "neuron_cores", lambda: (2, "neuron-ls: 1 devices"))
    art = str(outcome.path)
    serve_args = ["serve", "--engine", "vllm", "--artifacts", art, "--dry-run"]
    code, out, err = run_cli([*serve_args, "--json", "--vllm-target", C41], capsys, monkeypatch)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["generation"] == "C" and plan["plugin_version"] == "0.4.1"
    assert json.loads(flags(plan["argv"])["additional-config"]) == {"max_prompt_length": 64}
    assert plan["env"]["NEURON_COMPILED_ARTIFACTS"] == str(outcome.path.resolve())
    code, out, err = run_cli([*serve_args, "--vllm-target", B9], capsys, monkeypatch)
    assert code == 0 and "vLLM generation B (v0, vLLM 0.9.2" in err
    assert "export VLLM_NEURON_FRAMEWORK=neuronx-distributed-inference" in out
    assert "--max-model-len 64" in out and "--block-size" not in out
    code, out, err = run_cli([*serve_args, "--vllm-target", "tnx-fork"], capsys, monkeypatch)
    assert code == 0 and "vLLM generation A" in err, err  # the 0.6.x-neuron fork's NxDI loader
    assert "export VLLM_NEURON_FRAMEWORK=neuronx-distributed-inference" in out
    code, _, err = run_cli([*serve_args, "--vllm-target", "tnx-fork@0.5.0"], capsys, monkeypatch)
    assert code == 1 and "only the Transformers NeuronX loader" in err
    code, _, err = run_cli(serve_args, capsys, monkeypatch)  # no vLLM here, none named
    assert code == 2 and "--vllm-target" in err
    gen_args = ["generate", "--engine", "vllm", "--artifacts", art, "-p", "hi", "--dry-run"]
    code, out, err = run_cli([*gen_args, "--vllm-target", B_FORK], capsys, monkeypatch)
    assert code == 0 and "neuronctl.vllm generate" in out and "--max-prompt-tokens 64" in out
    assert '"device": "neuron"' in out  # in --engine-args: the fork still takes it


def test_dry_run_for_a_named_target_works_on_a_build_host(  # type: ignore[no-untyped-def]
    neuron_standins, tiny_llama, tmp_path, capsys, monkeypatch
) -> None:
    """No NeuronCores here: the launch for a named vLLM is printed, the serving host's checks
    are skipped and said so once; a bad --vllm-target is a usage error before anything."""
    import neuronctl.doctor as doctor
    from tests.test_nxdi import compile_nxdi

    _build, outcome = compile_nxdi(tiny_llama, tmp_path / "store", tp_degree=2)
    monkeypatch.setattr(doctor, "neuron_cores", lambda: (0, "no /dev/neuron*"))
    args = ["serve", "--engine", "vllm", "--artifacts", str(outcome.path), "--dry-run"]
    code, out, err = run_cli([*args, "--vllm-target", C41], capsys, monkeypatch)
    assert code == 0, err
    assert err.count("skipping the checks of the serving host") == 1
    assert "NeuronCores" not in err.replace("(Neuron SDK versions, NeuronCores", "")
    assert "--num-gpu-blocks-override 3" in out
    code, _, err = run_cli([*args, "--vllm-target", "plugn@0.4.1"], capsys, monkeypatch)
    assert code == 2 and "unknown vLLM target 'plugn@0.4.1'" in err
    code, _, err = run_cli(args[:-1] + ["--vllm-target", C41], capsys, monkeypatch)
    # A real launch still needs the cores; the nxdi backend's check says so, once.
    assert code == 1 and err.count("NeuronCores") == 1
    code, _, err = run_cli(["serve", "--artifacts", str(outcome.path), "--vllm-target", C41],
                           capsys, monkeypatch)
    assert code == 2 and "only applies to --engine vllm" in err


def test_generate_dry_run_for_a_named_target_works_on_a_build_host(  # type: ignore[no-untyped-def]
    neuron_standins, tiny_llama, tmp_path, capsys, monkeypatch
) -> None:
    """generate takes serve's path: on a host without NeuronCores the launch for a named vLLM
    prints, the serving host's checks are skipped and said so once, and a bad --vllm-target
    is a usage error before the artifact is looked at (here: one that does not exist)."""
    import neuronctl.doctor as doctor
    from tests.test_nxdi import compile_nxdi

    _build, outcome = compile_nxdi(tiny_llama, tmp_path / "store", tp_degree=2)
    monkeypatch.setattr(doctor, "neuron_cores", lambda: (0, "no /dev/neuron*"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the kept prompts file
    args = ["generate", "--engine", "vllm", "-p", "hi", "--artifacts", str(outcome.path)]
    code, out, err = run_cli([*args, "--dry-run", "--vllm-target", C41], capsys, monkeypatch)
    assert code == 0, err
    assert err.count("skipping the checks of the serving host") == 1
    assert "NeuronCores" not in err.replace("(Neuron SDK versions, NeuronCores", "")
    assert "vLLM generation C" in err and "neuronctl.vllm generate" in out
    code, _, err = run_cli(
        ["generate", "--engine", "vllm", "-p", "hi", "--artifacts", str(tmp_path / "none"),
         "--dry-run", "--vllm-target", "plugn@0.4.1"], capsys, monkeypatch
    )  # fmt: skip
    assert code == 2 and "unknown vLLM target 'plugn@0.4.1'" in err
    code, _, err = run_cli([*args, "--vllm-target", C41], capsys, monkeypatch)
    # A real run still needs the cores; the nxdi backend's check says so, once.
    assert code == 1 and err.count("NeuronCores") == 1


def test_vllm_dirname_is_stable_and_names_the_model_path(  # type: ignore[no-untyped-def]
    neuron_standins, tiny_llama, tmp_path
) -> None:
    """vLLM hashes InferenceConfig.to_json_string(), which holds the HF config's
    `_name_or_path`: the --model path (vllm model_loader/neuronx_distributed.py, load_weights:
    `load_pretrained_config(model_name_or_path)` then `hashlib.md5(config.to_json_string())`).
    So the name is exact for one path, and the same on every call (no temporary directory)."""
    import shutil

    spec = make_manifest().spec
    config = json.loads((tiny_llama / "config.json").read_text())
    first, exact = vllm_dirname_exact(spec, config, str(tiny_llama))
    assert exact and vllm_dirname(spec, config, str(tiny_llama)) == first
    copy = tmp_path / "elsewhere"
    shutil.copytree(tiny_llama, copy)
    assert vllm_dirname(spec, config, str(copy)) != first  # another --model, another name
    name, exact = vllm_dirname_exact(spec, config, "org/not-a-local-dir")
    assert not exact and vllm_dirname(spec, config, "org/not-a-local-dir") == name


# --- what `serve --engine vllm` hands vLLM besides the artifact -------------------------------


API_KEY_READERS = {  # ref -> where its OpenAI server reads VLLM_API_KEY beside --api-key
    "c097c1891": "vllm/entrypoints/openai/api_server.py:436",  # A, v0.6.x-neuron
    "490ab20f1": "vllm/entrypoints/openai/api_server.py:688",  # B, the AWS 0.7.2 fork
    "dd417b3": "vllm/entrypoints/openai/api_server.py:1063",  # B, upstream 0.9
}


def test_the_api_key_reaches_vllm_through_its_variable_never_argv(tmp_path: Path) -> None:
    """vLLM's server reads `envs.VLLM_API_KEY or args.api_key` (API_KEY_READERS): the key is
    passed in the environment, where `ps` does not show it, and a printed launch names the
    variable without its value."""
    from neuronctl.vllm.launch import shell_lines

    for target in (A6, B_FORK, B9, C41):
        launch = serve_launch(tmp_path, make_manifest("tnx" if target == A6 else "nxdi"),
                              api_key="s3cret-key", target=target)  # fmt: skip
        assert launch.env["VLLM_API_KEY"] == "s3cret-key"
        assert "s3cret-key" not in " ".join(launch.argv) and "--api-key" not in launch.argv
        printed = json.dumps(launch.as_dict()) + "\n".join(shell_lines(launch))
        assert "s3cret-key" not in printed
        assert 'export VLLM_API_KEY="${VLLM_API_KEY:?' in "\n".join(shell_lines(launch))
        assert launch.as_dict()["secret_env"] == ["VLLM_API_KEY"]
    for ref, where in API_KEY_READERS.items():
        path, line = where.split(":")
        source = git_show(UPSTREAMING, ref, path).splitlines()
        assert "VLLM_API_KEY" in source[int(line) - 1] and "api_key" in source[int(line) - 1]


def test_vllm_names_the_model_as_the_builtin_server_does(tmp_path: Path) -> None:
    """Without --served-model-name vLLM calls the model by its --model (here a path clients
    cannot know); the launch names it by the Hub id, as `neuronctl serve` does."""
    manifest = make_manifest()
    manifest.source.revision = "0123abcd" * 5  # compiled from the Hub at this commit
    launch = serve_launch(tmp_path, manifest, target=B9)
    assert flags(launch.argv)["served-model-name"] == "org/model"
    assert flags(serve(tmp_path, B9).argv)["served-model-name"] == "model"  # a local folder
    named = serve_launch(tmp_path, make_manifest(), served_model_name="mine", target=B9)
    assert flags(named.argv)["served-model-name"] == "mine"


def test_launch_of_an_unvalidated_manifest_names_the_model_by_its_folder(tmp_path: Path) -> None:
    """The real-source harness builds its manifest with `Manifest.model_construct`, the
    source a plain mapping; the launch must still be written (named by the artifact's folder)
    so that the harness can run it through vLLM's own argument parser."""
    real = make_manifest()
    fields = {name: getattr(real, name) for name in Manifest.model_fields}
    loose = Manifest.model_construct(**{**fields, "source": {"digest": "d"}})
    launch = serve_launch(tmp_path, loose, target=B9)
    assert flags(launch.argv)["served-model-name"] == tmp_path.resolve().name
    assert launch.argv[:-2] == serve_launch(tmp_path, real, target=B9).argv[:-2]


def test_log_level_reaches_uvicorn_where_vllm_has_the_flag(tmp_path: Path) -> None:
    """--uvicorn-log-level is in cli_args.py from the 0.6 fork on (v0.6.x-neuron :82)."""
    launch = serve_launch(tmp_path, make_manifest(), log_level="debug", target=B9)
    assert flags(launch.argv)["uvicorn-log-level"] == "debug"
    with pytest.raises(UsageError, match="no --uvicorn-log-level"):
        old = make_manifest("tnx", seq_len=128, max_context_length=128, context_buckets=[128],
                            token_gen_buckets=[128])  # fmt: skip
        serve_launch(tmp_path, old, log_level="debug", target="tnx-fork@0.5.0")
    for ref in ("c097c1891", "490ab20f1", "dd417b3"):
        assert '"--uvicorn-log-level"' in git_show(
            UPSTREAMING, ref, "vllm/entrypoints/openai/cli_args.py"
        )


FAKE_VLLM = '''
class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw
class _Out:
    def __init__(self, text):
        self.text, self.token_ids = text, [len(text)]
class _Req:
    def __init__(self, text):
        self.outputs = [_Out(text)]
class _Tok:
    def encode(self, text):
        return text.split()
class LLM:
    def __init__(self, **kw):
        self.kw = kw
    def get_tokenizer(self):
        return _Tok()
    def generate(self, prompts, params):
        return [_Req(p.upper() + " " + self.kw["model"].rsplit("/", 1)[-1]) for p in prompts]
'''


def test_serve_and_generate_with_vllm_read_the_manifest_once(  # type: ignore[no-untyped-def]
    neuron_standins, tiny_llama, tmp_path, capsys, monkeypatch
) -> None:
    """The reuse checks read manifest.json; the launch and the load rule use what they read
    (serve read it three times: the checks, the trust check, the launch)."""
    import neuronctl.doctor as doctor
    import neuronctl.store.manifest as manifest_mod
    from tests.test_nxdi import compile_nxdi

    _build, outcome = compile_nxdi(tiny_llama, tmp_path / "store")
    monkeypatch.setattr(doctor, "neuron_cores", lambda: (2, "neuron-ls: 1 devices"))
    reads: list[Path] = []
    read_capped = manifest_mod.read_capped

    def counted(path: Path, cap: int) -> bytes:
        if Path(path).name == manifest_mod.MANIFEST:
            reads.append(Path(path))
        return read_capped(path, cap)

    monkeypatch.setattr(manifest_mod, "read_capped", counted)
    art = str(outcome.path)
    for args in (["serve", "--engine", "vllm", art, "--dry-run", "--vllm-target", B9],
                 ["generate", "--engine", "vllm", art, "-p", "hi", "--dry-run",
                  "--vllm-target", B9]):  # fmt: skip
        reads.clear()
        code, _, err = run_cli(args, capsys, monkeypatch)
        assert code == 0, err
        assert len(reads) == 1, (args[0], reads)


def test_vllm_dry_runs_paste_on_the_serving_host(  # type: ignore[no-untyped-def]
    neuron_standins, tiny_llama, tmp_path, capsys, monkeypatch
) -> None:
    """A dry run prints what the serving host runs: `python3`, not this host's venv python;
    no file of this host's cache (the prompts go on standard input); the API key by name.
    The printed generate launch is pasted into bash, over a vLLM stand-in, and answers.
    Flags only the built-in server has are refused, not dropped."""
    import neuronctl.doctor as doctor
    from tests.test_nxdi import compile_nxdi

    _build, outcome = compile_nxdi(tiny_llama, tmp_path / "store")
    monkeypatch.setattr(doctor, "neuron_cores", lambda: (2, "neuron-ls: 1 devices"))
    monkeypatch.setenv("NEURONCTL_API_KEY", "s3cret-key")
    art = str(outcome.path)
    serve_args = ["serve", "--engine", "vllm", art, "--dry-run", "--vllm-target", B9]
    code, out, err = run_cli(serve_args, capsys, monkeypatch)
    assert code == 0, err
    assert "s3cret-key" not in out + err and "VLLM_API_KEY" in out
    assert sys.executable not in out and "python3 -m vllm.entrypoints.openai.api_server" in out
    for flag, value in (("--max-queue", "5"), ("--max-body-bytes", "10"),
                        ("--max-prompt-chars", "9")):  # fmt: skip
        code, _, err = run_cli([*serve_args, flag, value], capsys, monkeypatch)
        assert code == 2 and f"{flag} (" in err and "--engine builtin only" in err
    cache = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    gen_args = ["generate", "--engine", "vllm", art, "-p", "hi there", "-p", "EOF", "--dry-run",
                "--vllm-target", B9]  # fmt: skip
    code, out, err = run_cli(gen_args, capsys, monkeypatch)
    assert code == 0, err
    assert sys.executable not in out and str(cache) not in out and not cache.exists()
    fake = tmp_path / "serving-host"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    ran = subprocess.run(["bash", "-e"], input=out, capture_output=True, text=True, env=env)
    assert ran.returncode == 0, ran.stderr
    rows = [json.loads(line) for line in ran.stdout.splitlines()]
    name = outcome.path.resolve().name
    assert [r["text"] for r in rows] == [f"HI THERE {name}", f"EOF {name}"]
