"""neuronctl: ahead-of-time compiled LLMs as reproducible, content-addressed build products."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("neuronctl")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+src"
