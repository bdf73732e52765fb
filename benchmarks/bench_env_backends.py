"""What a step costs through each place environments can run: the trainer's process (`env.workers=0`), worker
processes (`env.backend=process`), Ray actors (`env.backend=ray`, a private local instance) and sessions on an
environment server over loopback HTTP (`env.backend=http` against `python -m vagen.env_server`, its `--workers`
worker processes), on the same levels and responses. Information only: nothing is asserted.

    python benchmarks/bench_env_backends.py [--configs sokoban_visual,navigation_visual] [--rounds 20]
        [--backends in-process,process,ray,http]

Two measures per config and backend:
- round trip: one environment, one request at a time (`step`, then `answers(block=True)`): the step's own
  time plus the transport's (pickling the observation's frames, the pipe or Ray's call, the answer);
- batch: `--envs` environments in `--workers` workers, every environment stepped, then every answer
  collected, `--rounds` times: wall time per step with the workers stepping in parallel.
Start-up is the pool's creation (for Ray with the instance's own start, for HTTP with the server's) until its
first answers. Bytes per frame: the observation pickled (what a pipe or Ray carries), and its frames as the PNG
parts an HTTP answer carries.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("MUJOCO_GL", "egl")

ACTIONS = {"sokoban": ["Up", "Left", "Down", "Right"], "navigation": ["moveahead", "rotateright", "moveahead",
                                                                      "rotateleft", "moveleft", "moveback"]}


def response(name: str, index: int, step: int) -> str:
    actions = ACTIONS[name]
    return f"<think>go</think><answer>{actions[(index + step) % len(actions)]}</answer>"


def start_server(config: str, workers: int):
    """`python -m vagen.env_server` for `config` on a free loopback port, answering /health: (process, url)."""
    import socket
    import subprocess

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "vagen.env_server", "--config", config, "--port", str(port),
                                "--workers", str(workers), "--max-sessions", "256"], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the environment server for {config} did not answer /health within 120 s")


def make_pool(backend: str, cfg_env, count: int, workers: int, url: str | None = None):
    from vagen.env_workers import EnvFactory, EnvWorkers, InProcessEnvs, build_env, env_params

    if backend == "http":
        from vagen.env_http import HttpEnvWorkers

        return HttpEnvWorkers([url], count, env_params(cfg_env), env_name=cfg_env.name)
    if backend == "in-process":
        return InProcessEnvs([build_env(cfg_env) for _ in range(count)], None)
    if backend == "process":
        return EnvWorkers(EnvFactory(cfg_env), count, workers, None)
    from vagen.env_ray import RayEnvWorkers

    return RayEnvWorkers(EnvFactory(cfg_env), count, workers, None)


def drain(pool, expected: int) -> list:
    answers = []
    while len(answers) < expected:
        answers += pool.answers(block=True)
    return answers


def measure(backend: str, config: str, count: int, workers: int, rounds: int) -> dict:
    from vagen.config import load_config
    from vagen.env_http import png_bytes

    cfg = load_config(config, [])
    name = cfg.env.name
    t0 = time.perf_counter()
    server, url = start_server(config, workers) if backend == "http" else (None, None)
    pool = make_pool(backend, cfg.env, count, workers, url)
    try:
        for i in range(count):
            pool.reset(i, 1000 + i)
        first = drain(pool, count)
        startup = time.perf_counter() - t0
        frame_bytes = len(pickle.dumps(first[0].value[0]))
        frames = [image for answer in first for image in answer.value[0].images]
        png = sum(len(png_bytes(image)) for image in frames) / max(1, len(frames))  # mean over the first frames
        # round trip: environment 0 alone
        t0 = time.perf_counter()
        for step in range(rounds):
            pool.step(0, response(name, 0, step))
            answer, = drain(pool, 1)
            if answer.value[2] or answer.value[3]:
                pool.reset(0, 2000 + step)
                drain(pool, 1)
        round_trip = (time.perf_counter() - t0) / rounds
        # batch: every environment each round
        t0 = time.perf_counter()
        for step in range(rounds):
            for i in range(count):
                pool.step(i, response(name, i, step))
            for answer in drain(pool, count):
                if answer.error is None and (answer.value[2] or answer.value[3]):
                    pool.reset(answer.index, 3000 + 100 * step + answer.index)
                    drain(pool, 1)
        batch = (time.perf_counter() - t0) / (rounds * count)
    finally:
        pool.close()
        if server is not None:
            server.terminate()
            server.wait()
    return {"startup": startup, "round_trip": round_trip, "batch": batch, "frame_bytes": frame_bytes, "png": png}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="sokoban_visual,navigation_visual")
    parser.add_argument("--backends", default="in-process,process,ray,http")
    parser.add_argument("--envs", type=int, default=16, help="environments of the batch measure")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)

    rows = []
    for config in args.configs.split(","):
        for backend in args.backends.split(","):
            result = measure(backend, config, args.envs, args.workers, args.rounds)
            print(f"{config} {backend}: {result}", flush=True)
            rows.append((config, backend, result))
    print(f"\n{args.envs} environments, {args.workers} workers, {args.rounds} rounds, {os.cpu_count()} CPU cores")
    print("| config | backend | start-up s | round trip ms per step | over in-process | over process | "
          "batch ms per step | observation pickled | frame as PNG |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = {config: result["round_trip"] for config, backend, result in rows if backend == "in-process"}
    process = {config: result["round_trip"] for config, backend, result in rows if backend == "process"}

    def over(config, result, against):
        return f"+{(result['round_trip'] - against[config]) * 1e3:.2f} ms" if config in against else "–"

    for config, backend, result in rows:
        print(f"| {config} | {backend if backend == 'in-process' else f'{backend}, {args.workers} workers'} | "
              f"{result['startup']:.2f} | {result['round_trip'] * 1e3:.2f} | {over(config, result, base)} | "
              f"{over(config, result, process) if backend == 'http' else '–'} | {result['batch'] * 1e3:.2f} | "
              f"{result['frame_bytes'] / 1024:.0f} KiB | {result['png'] / 1024:.1f} KiB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
