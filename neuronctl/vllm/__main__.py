"""`python -m neuronctl.vllm generate ...`: the offline program (offline.py)."""

import sys

from neuronctl.vllm.offline import main

sys.exit(main(sys.argv[1:]))
