"""Launch vLLM over a neuronctl artifact so that it loads it as-is, never recompiling.

vLLM's Neuron integration checks nothing: a launch whose settings differ from the artifact's
recompiles (and its default path deletes the directory first). Which flags, variables and
config keys keep it on its reuse path depends on the vLLM *generation* (docs/neuron.md,
neuronctl/vllm_generations.py), so every launch is planned for one `VllmTarget`:

- A `tnx-fork`: the Transformers NeuronX forks, vLLM 0.3.3 / 0.5.0 / 0.6.x-neuron (tnx; nxdi
  on 0.6.x-neuron, whose NxDI loader takes NEURON_COMPILED_ARTIFACTS as B's does).
- B `v0`: the V0 in-tree Neuron worker, the AWS 0.7.2 fork and upstream 0.8-0.10.1 (NxDI or TNx).
- C `plugin`: the vllm-neuron platform plugin 0.1-0.5 on vLLM 0.10.2-0.16 (NxDI only).
- D `native`: vllm-neuron 0.21+ (torch.compile, no NxDI): refused, see docs/neuron.md.

One module per job, each importing only those above it in this list:

- artifact.py: what the launch reads from the artifact's manifest (framework, spec, features).
- detect.py: which vLLM the launch is for (`VllmTarget`: installed, or `--vllm-target`).
- support.py: which artifacts each generation can load; `refuse` for the rest.
- rules.py: the engine arguments and variables each generation gets (`LaunchPlan`).
- launch.py: the argv and environment of a launch (`serve_launch`, `generate_launch`), and
  the vLLM child process `generate` runs (`run_with_prompts`).
- dirname.py: the md5 directory name vLLM B's NxDI loader computes (`neuronctl hash --vllm`).
- offline.py: the program `generate_launch` runs inside vLLM (`python -m neuronctl.vllm`).

Every value comes from the artifact's manifest; the rules per generation, with the source
lines they come from, are pinned in tests/test_vllm.py and tabulated in docs/neuron.md.
neuronctl's own code imports from the modules; the names below are for scripts that drive a
launch from outside the package (`Target` is VllmTarget's short name there: in neuronctl a
target is a vLLM target, nothing else).
"""

from neuronctl.vllm.artifact import NXDI, TNX
from neuronctl.vllm.detect import VllmTarget
from neuronctl.vllm.dirname import vllm_dirname_exact
from neuronctl.vllm.launch import generate_launch, serve_launch
from neuronctl.vllm.rules import PLUGIN_ENTRY, LaunchPlan, plan_launch

Target = VllmTarget

__all__ = [
    "NXDI",
    "PLUGIN_ENTRY",
    "TNX",
    "LaunchPlan",
    "Target",
    "VllmTarget",
    "generate_launch",
    "plan_launch",
    "serve_launch",
    "vllm_dirname_exact",
]
