"""STAND-IN for neuronx_distributed_inference (tests only; records calls, writes fake files)."""
