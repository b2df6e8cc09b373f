"""NxD Inference backend (neuronx-distributed-inference); the SDK imports lazily."""
