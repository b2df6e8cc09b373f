"""Transformers NeuronX backend (transformers-neuronx); the SDK imports lazily."""
