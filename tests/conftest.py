"""Shared fixtures: a tiny offline model folder and a helper to launch torchrun workers."""

import contextlib
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

import rank_launcher
from rl2.chat.template import render_chat
from rl2.testing.tiny import save_tiny, sharpen_weights

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Distributed tests fork their ranks from preloaded modules (`rank_launcher`; the suite in ~12 minutes
# instead of ~20); RL2_FORK_RANKS=0 launches them through the real torchrun / python instead. A
# forked run whose process died by a signal is run again the real way (see `forked_or_real`).
FORK_RANKS = os.environ.get("RL2_FORK_RANKS", "1") != "0"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu_pins: also run under the versions the gpu extra pins (make test-gpu-pins)")
    if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
        # Workers share few cores: a test's ranks with OpenMP threads spinning on each core starve the other
        # workers' (a 20-step demo then took over 400 s instead of 40). `make test` sets it as well.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random-init 2-layer Qwen2 model with a locally trained tokenizer."""
    return save_tiny(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory) -> str:
    """A random-init tiny Qwen2.5-VL (`rl2.testing.tiny_vlm`) with the tiny tokenizer and an image processor."""
    folder = str(tmp_path_factory.mktemp("qwen2_5_vl"))
    run_python(["-m", "rl2.testing.tiny_vlm", folder, "--family", "qwen2_5_vl"])
    return folder


@pytest.fixture(scope="session")
def peaked_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with larger random weights (`sharpen_weights`: peaked next-token distributions)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = sharpen_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    folder = str(tmp_path_factory.mktemp("peaked"))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


def forked_or_real(forked, real) -> subprocess.CompletedProcess:
    """`forked()` when ranks are forked, else `real()`. A forked run whose process was killed by a signal
    is run again by `real()`, with a warning: forking is the tests' shortcut, and a crash it causes
    must not fail a test that the real launcher passes (a crash of rl2's own would recur there)."""
    if not FORK_RANKS:
        return real()
    result = forked()
    if result.returncode < 0:
        warnings.warn(f"a forked rank died by signal {-result.returncode}; running again under the real launcher:\n"
                      f"{result.stderr[-3000:]}")
        result = real()
    return result


def tokenize_prompt(messages: list[dict], tokenizer) -> list[int]:
    """Token ids of `messages` through the chat template with the generation prompt, as `RLDataset`
    gives them (test_data checks the two agree)."""
    text = render_chat(messages, tokenizer, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def counting_prompts(tokenizer, n: int, start: int = 0) -> list[dict]:
    """RL prompts of different lengths ("Count from i to i + 40:" and some padding words): under a max_length,
    answers of different lengths (the partial-rollout tests)."""
    rows = []
    for i in range(start, start + n):
        messages = [{"role": "user", "content": f"Count from {i} to {i + 40}:" + " and on" * (5 * (i % 5))}]
        rows.append({"prompt_ids": tokenize_prompt(messages, tokenizer), "messages": messages, "answer": str(i)})
    return rows


def run_torchrun(
    args: list[str], nproc: int = 2, timeout: int = 300, check: bool = True, env: dict | None = None,
    cwd: str = REPO,
) -> subprocess.CompletedProcess:
    """What `torchrun --nproc_per_node=nproc ARGS` does in `cwd`, on CPU, with ranks forked from preloaded
    modules (`rank_launcher`); the output is shown when it fails; `env` entries override (None removes)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": REPO, **(env or {})}
    env = {key: value for key, value in env.items() if value is not None}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    result = forked_or_real(
        lambda: rank_launcher.launch(args, nproc, env, cwd, timeout),
        lambda: subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd),
    )
    if check and result.returncode != 0:
        raise AssertionError(f"torchrun --nproc_per_node={nproc} {' '.join(args)} failed ({result.returncode}):\n"
                             f"{result.stdout[-5000:]}\n{result.stderr[-8000:]}")
    return result


@pytest.fixture(scope="session")
def demo_warmup(tmp_path_factory):
    """The README demo's SFT warm-up (`recipes/ppo_tiny.sh`, 200 steps, one rank) for a seed, run once per
    test process and seed (tests that share it share an xdist group): `warmup(seed)` is its checkpoint folder."""
    done = {}

    def warmup(seed: int) -> str:
        if seed not in done:
            out = tmp_path_factory.mktemp(f"demo_warmup_{seed}")
            env = {**os.environ, "OUT": str(out), "SFT_STEPS": "200", "PPO_STEPS": "0", "NPROC": "1",
                   "SEED": str(seed), "PYTHONPATH": REPO}
            result = run_demo([], env)
            assert result.returncode == 0, result.stderr[-5000:]
            done[seed] = str(out / "sft" / "step200")
        return done[seed]

    return warmup


def run_demo(args: list[str], env: dict[str, str], timeout: int = 400) -> subprocess.CompletedProcess:
    """`bash recipes/ppo_tiny.sh ARGS` in `env`, its torchrun ranks forked from preloaded modules
    (`TorchrunService`, as TORCHRUN) unless RL2_FORK_RANKS=0."""
    from torchrun_service import TorchrunService

    with TorchrunService() if FORK_RANKS else contextlib.nullcontext() as shim:
        if shim:
            env = {**env, "TORCHRUN": os.path.join(shim, "torchrun")}
        return subprocess.run(["bash", "recipes/ppo_tiny.sh", *args], capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=REPO)


def run_python(args: list[str], timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """A single-process run (world size 1, no torchrun), forked like `run_torchrun`'s ranks; `env`
    entries override (None removes)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": REPO, **(env or {})}
    env = {key: value for key, value in env.items() if value is not None}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = forked_or_real(
        lambda: rank_launcher.launch(args, 1, env, REPO, timeout, distributed=False),
        lambda: subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO),
    )
    if result.returncode != 0:
        raise AssertionError(f"{args} failed ({result.returncode}):\n{result.stdout[-5000:]}\n{result.stderr[-8000:]}")
    return result


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it. torchrun starts each rank in a session of its own, so
    killing torchrun's process group would leave the ranks training on."""
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        parent = int(stat[stat.rindex(b")") + 2:].split()[1])  # after "pid (comm) state"
        children.setdefault(parent, []).append(int(name))
    tree, frontier = [], [pid]
    while frontier:
        tree.append(frontier.pop())
        frontier += children.get(tree[-1], [])
    return tree[::-1]  # the deepest first: children before the parents that would re-parent them


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it."""
    for member in process_tree(pid):
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


# Gradients computed in another order (1 vs 2 ranks, packed rows vs separate ones, threads, processors)
# differ by float32 rounding of their sums: ~1e-7 to 1e-6 of the tensor's largest gradient. 1e-4 of it
# leaves a wide margin and stays ~100x below what one token more or less in a loss over ~100 tokens
# changes (~1e-2), let alone a wrong normalisation (a factor).
GRAD_RTOL = 1e-4


def assert_same_gradients(ours: dict, reference: dict, rtol: float = GRAD_RTOL) -> None:
    """Every parameter's gradient equals the reference's within `rtol` of the reference's largest
    element (of that tensor)."""
    assert ours.keys() == reference.keys()
    for name, expected in reference.items():
        atol = rtol * expected.abs().max().item()
        torch.testing.assert_close(ours[name], expected, rtol=0, atol=atol, msg=name)


def varlen_by_flash_semantics(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False,
                              aligned_to_end=True):
    """torch.nn.attention.varlen.varlen_attn on CPU, as documented for flash kernels: layout [T, H, D],
    window (-1, 0) is causal aligned to the end of each sequence's keys (`aligned_to_end=False`:
    to their start, sdpa's convention for is_causal, which a prefill after a cached prefix must not get)."""
    assert window_size == (-1, 0) and cu_q.dtype == cu_k.dtype == torch.int32
    q_bounds, k_bounds = cu_q.tolist(), cu_k.tolist()
    assert max_q == max(b - a for a, b in zip(q_bounds, q_bounds[1:]))
    assert max_k == max(b - a for a, b in zip(k_bounds, k_bounds[1:]))
    outputs = []
    for (qa, qb), (ka, kb) in zip(zip(q_bounds, q_bounds[1:]), zip(k_bounds, k_bounds[1:])):
        offset = (kb - ka) - (qb - qa) if aligned_to_end else 0
        visible = torch.arange(kb - ka)[None, :] <= torch.arange(qb - qa)[:, None] + offset
        out = torch.nn.functional.scaled_dot_product_attention(
            q[qa:qb].transpose(0, 1), k[ka:kb].transpose(0, 1), v[ka:kb].transpose(0, 1), attn_mask=visible,
            scale=scale, enable_gqa=enable_gqa)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


@pytest.fixture(scope="module")
def word_chain_url():
    """The OpenEnv word-chain game of tests/openenv_word_chain.py, served on loopback (its URL)."""
    pytest.importorskip("openenv.core")
    import time
    import urllib.request

    from server_process import REPO, free_port, python_env

    port = free_port()
    process = subprocess.Popen([sys.executable, f"{REPO}/tests/openenv_word_chain.py", str(port)], env=python_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                if process.poll() is not None:
                    raise RuntimeError(process.stdout.read())
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
