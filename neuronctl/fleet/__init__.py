"""Manifests for the orchestrators fleets run (Kubernetes, KServe, vLLM's production-stack,
LeaderWorkerSet, KubeRay), written from a compiled artifact and the remote that holds it.

  instances.py    Neuron instance types (devices, cores) and whether the named instance type
                  and SDK load the artifact as compiled (validate's version rule)
  workload.py     what every target says alike: install step, server launch (vllm/launch.py
                  or `neuronctl serve`), Neuron resources, memory, probes, grace period;
                  refusals
  targets.py      one function per orchestrator: the workload as its objects
  schemacheck.py  every document checked offline: kubernetes-validate for Kubernetes' own
                  objects, the vendored CRD schemas (schemas/) for the rest
  rayserve.py     the RayService's Ray Serve application: each replica installs, serves and
                  reports the server's health (imports Ray: the `ray` extra)
  farm.py         `compile --plan FILE --ray`: a build plan compiled on a Ray cluster, one
                  task per entry, claims on the remote, a status and log per entry
"""
