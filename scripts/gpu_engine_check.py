"""The vLLM engine's GPU-only checks, one JSON line each (run by scripts/gpu_check.sh; needs CUDA and vLLM):

    python scripts/gpu_engine_check.py runner   # the model runner vLLM chose, start-up time at the rank's engine
                                                # sizes against vLLM's serving defaults, CUDA-graph sizes captured
    python scripts/gpu_engine_check.py linear   # torch.nn.functional.linear after a ZeRO-3 partitioned build,
                                                # then an engine built and decoding in the same process
    python scripts/gpu_engine_check.py egl      # MUJOCO_EGL_DEVICE_ID of each local rank, and a frame it renders
    python scripts/gpu_engine_check.py all      # each of them in a process of its own

One engine per process: vLLM's sleep-mode allocator serves one engine instance per process (loading weights
asserts that it holds nothing yet), and its own sleep-mode tests fork a process per test. So `runner` builds each
of its two engines in a child process (`engine SIZES MODEL`), and `all` runs each check in a process of its own.

Imports nothing heavy at the top, so that `python -c "import runpy; ..."` checks it without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def standard_tiny_vl(out: Path) -> Path:
    """The built-in tiny Qwen2.5-VL without vagen's image hooks, which stock vLLM does not run."""
    import shutil

    from vagen.models import CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE, resolve_model_path

    source = resolve_model_path("builtin:tiny-vl", str(out / "cache"), seed=0)
    shutil.copytree(source, out / "tiny-vl", dirs_exist_ok=True)
    config = json.loads((out / "tiny-vl" / "config.json").read_text())
    for key in (CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE):
        config.pop(key, None)
    (out / "tiny-vl" / "config.json").write_text(json.dumps(config, indent=2))
    return out / "tiny-vl"


def engine(path: Path, **sizes):
    from vagen.decoding_vllm import VLLMDecoder
    from vagen.episode import ChatEncoder
    from vagen.models import load_policy

    return VLLMDecoder(path, ChatEncoder(load_policy(path)[1]), dtype="bfloat16", seed=0, **sizes)


# The two sizings `runner` compares: a rank's engine for 16 episodes of 2,048 tokens, and vLLM's serving defaults.
SIZINGS = {"rank_sizes": {"episodes": 16, "trajectory_length": 2048}, "serving_defaults": {}}


def engine_row(name: str, path: Path) -> dict:
    """Build one engine of sizing `name` on the model at `path` (in a process of its own: see the docstring) and
    read what vLLM made of it."""
    decoder = engine(path, **SIZINGS[name])
    config = decoder.llm.llm_engine.vllm_config
    row = {"start_s": round(decoder.start_seconds, 1), "runner": decoder.model_runner,
           "max_num_seqs": config.scheduler_config.max_num_seqs,
           "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
           "cudagraph_capture_sizes": list(config.compilation_config.cudagraph_capture_sizes or []),
           "activation_bytes": decoder.activation_bytes}
    decoder.close()
    return row


def in_child(args: list[str], timeout: float = 900) -> dict:
    """This script run with `args` in a child process, and the JSON line it printed last (or what went wrong)."""
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode not in (0, 1) or not lines:
        return {"ok": False, "error": f"`{' '.join(args)}` exited with {done.returncode}: {done.stderr[-1500:]}"}
    return json.loads(lines[-1])


def check_runner(work: Path) -> dict:
    """Model Runner V1 (vagen pins it) on CUDA, and the start-up of an engine sized for 16 episodes of 2,048
    tokens against one with vLLM's serving defaults: each engine in a child process."""
    from vagen.vllm_compat import runner_version

    path = standard_tiny_vl(work)
    row = {name: in_child(["engine", name, str(path)]) for name in SIZINGS}
    row["ok"] = all("runner" in row[k] and runner_version(row[k]["runner"]) == "V1" for k in SIZINGS)
    return row


def check_linear(work: Path) -> dict:
    """F.linear is torch's own after a ZeRO-3 partitioned build, and an engine built afterwards decodes."""
    import torch
    import torch.nn.functional as F

    from vagen.config import load_config
    from vagen.decoding import Sampling
    from vagen.distributed import init_distributed
    from vagen.episode import Episode
    from vagen.models import load_policy
    from vagen.train import partitioned_build

    path = standard_tiny_vl(work)
    dist = init_distributed()
    cfg = load_config("sokoban_visual", [f"model.path={path}", "train.deepspeed_config=deepspeed/zero3_bf16.json"])
    with partitioned_build(cfg, dist) as partitioned:
        load_policy(path, "bfloat16")
        inside = F.linear
    restored = F.linear is torch._C._nn.linear
    decoder = engine(path, episodes=4, trajectory_length=1024)
    encoder = decoder.encoder
    prompt = encoder.tokenizer("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    episode = Episode(env_name="sokoban", seed=0, group_id=0, system_prompt="", input_ids=prompt)
    ids = decoder.generate([episode], [0], Sampling(do_sample=False, temperature=1.0, max_new_tokens=8))[0].ids
    after_engine = F.linear is torch._C._nn.linear
    decoder.close()
    return {"partitioned": partitioned, "replaced_inside": inside is not torch._C._nn.linear,
            "restored_after_build": restored, "torch_linear_after_engine": after_engine, "generated": len(ids),
            "ok": partitioned and restored and after_engine and len(ids) > 0}


RENDER = """
import json, os
import numpy as np
from vagen.distributed import init_distributed
dist = init_distributed(need_group=False)
import envs_visual
image = envs_visual.make("navigation").reset(seed=0)[0].images[0]
print(json.dumps({"local_rank": dist.local_rank, "device": str(dist.device),
                  "MUJOCO_EGL_DEVICE_ID": os.environ.get("MUJOCO_EGL_DEVICE_ID"),
                  "frame_std": float(np.asarray(image).std())}))
"""


def check_egl(work: Path) -> dict:
    """Each local rank of this node (one process per visible GPU, LOCAL_RANK set as the launcher sets it)
    renders a navigation frame with MUJOCO_EGL_DEVICE_ID set to its own device."""
    import torch

    from vagen.distributed import egl_device_count

    ranks = []
    for local_rank in range(torch.cuda.device_count()):
        env = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_EGL_DEVICE_ID", "RANK", "WORLD_SIZE")}
        env.update(LOCAL_RANK=str(local_rank), MUJOCO_GL="egl", PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-c", RENDER], env=env, capture_output=True, text=True, timeout=300)
        ranks.append(json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0
                     else {"local_rank": local_rank, "error": done.stderr[-800:]})
    ok = bool(ranks) and all(r.get("MUJOCO_EGL_DEVICE_ID") is not None and r.get("frame_std", 0) > 5 for r in ranks)
    return {"egl_devices": egl_device_count(), "ranks": ranks, "ok": ok}


CHECKS = {"runner": check_runner, "linear": check_linear, "egl": check_egl}


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 3 and args[0] == "engine" and args[1] in SIZINGS:  # one engine of `runner`, in its own process
        print(json.dumps(engine_row(args[1], Path(args[2]))), flush=True)
        return 0
    if args == ["all"]:  # each check in a process of its own
        rows = [{"check": name, **in_child([name], timeout=1800)} for name in CHECKS]
        for row in rows:
            print(json.dumps(row), flush=True)
        return 0 if all(row["ok"] for row in rows) else 1
    if len(args) != 1 or args[0] not in CHECKS:
        print(f"usage: python scripts/gpu_engine_check.py {{{','.join([*CHECKS, 'all'])}}}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as work:
        row = {"check": args[0], **CHECKS[args[0]](Path(work))}
    print(json.dumps(row), flush=True)
    return 0 if row["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
