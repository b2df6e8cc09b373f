PYTHON ?= python3
PYTEST = $(PYTHON) -m pytest

.PHONY: install test test-eval test-floor test-slow test-all lint bench docs

# torch is pinned to the local CPU build: an unpinned torch pulls several GB of CUDA packages.
install:
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[dev]'
	@# The oci:// tests and bench/oci.py run a real registry: the CNCF distribution registry as
	@# Debian packages it (as root only; elsewhere those tests skip and say why).
	@if ! command -v docker-registry >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-registry; \
	fi

# The fast suite: what CI runs. Slow tests (AOTInductor, big checkpoints) are in test-slow.
# --durations: the slowest tests in every run's output, so a slow newcomer is seen in CI.
test:
	$(PYTEST) -m "not slow and not neuron and not hub and not eval" -n 2 --dist loadfile --durations=25

# docs/runtime.md's lm-eval recipe against `neuronctl serve` equals lm-eval's hf model (one
# small compile and two lm-eval runs, a few minutes on 2 cores: kept out of the parallel suite).
test-eval:
	$(PYTEST) -m "eval and not slow" -p no:xdist -q --durations=5

# The Hub error mapping at the lowest huggingface_hub pyproject allows (the suite runs on the
# newest): that version alone, in a scratch folder ahead of the installed one.
HUB_FLOOR = 0.25.2
test-floor:
	$(PYTHON) -m pip install -q --upgrade --no-deps --target .floor/hub huggingface_hub==$(HUB_FLOOR)
	PYTHONPATH=$(CURDIR)/.floor/hub:$(CURDIR) $(PYTEST) -p no:xdist -q tests/test_download.py \
		-k "map_without or mistyped"

test-slow:
	$(PYTEST) -m "slow and not neuron and not hub"

test-all:
	$(PYTEST) -m "not neuron and not hub"

# lint-imports: imports point one way (the layers of docs/architecture.md, pyproject.toml).
lint:
	$(PYTHON) -m ruff check neuronctl tests bench
	$(PYTHON) -m mypy neuronctl
	PYTHONPATH=$(CURDIR) lint-imports --no-cache

# bench/peers.py needs the bench extra (pip install -e '.[bench]'); without llama.cpp it
# says so and measures the rest.
bench:
	$(PYTHON) bench/peers.py
	$(PYTHON) bench/coldstart.py
	$(PYTHON) bench/kernel.py
	$(PYTHON) bench/load.py
	$(PYTHON) bench/shard.py
	$(PYTHON) bench/decode.py
	$(PYTHON) bench/validate.py
	$(PYTHON) bench/serve.py
	$(PYTHON) bench/hostile.py
	$(PYTHON) bench/remote.py
	$(PYTHON) bench/oci.py

# docs/cli.md is generated from the commands' own --help text.
docs:
	$(PYTHON) -m typer --app app neuronctl.cli.main utils docs --name neuronctl --title "neuronctl command reference" --output docs/cli.md
	$(PYTHON) -c "import html, pathlib; p = pathlib.Path('docs/cli.md'); p.write_text(html.unescape(p.read_text()))"
