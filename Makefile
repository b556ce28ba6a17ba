# CPU machines: torch==2.13.0 first (the CPU build), then the rest. On a GPU box install your CUDA
# torch and `pip install -e ".[gpu]"` instead.
PYTHON ?= python3
NPROC ?= 2

.PHONY: install demo demo-tool demo-sft test bench

install:
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e ".[test]"

demo: install
	NPROC=$(NPROC) bash recipes/ppo_tiny.sh

demo-tool: install
	TASK=lookup NPROC=$(NPROC) bash recipes/ppo_tiny.sh

demo-sft: install
	NPROC=$(NPROC) bash recipes/sft_tiny.sh

test: install
	$(PYTHON) -m pytest tests -q -rs

bench: install
	$(PYTHON) bench/packing.py
	$(PYTHON) bench/train_throughput.py
	$(PYTHON) bench/rollout_throughput.py
	$(PYTHON) bench/ring_attention.py
