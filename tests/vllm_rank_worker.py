"""Run under the DeepSpeed launcher by tests/test_vllm.py: each of two gloo ranks builds its own vLLM engine
over the shipped text warm start, as training does (after `init_distributed`), and writes what the engine's
worker was built with (its rank, local rank and device) and the greedy ids of its own prompt."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from child_env import worker_args  # noqa: E402

from vagen.config import checkpoints_dir  # noqa: E402
from vagen.decoding import Sampling  # noqa: E402
from vagen.decoding_vllm import VLLMDecoder  # noqa: E402
from vagen.distributed import init_distributed  # noqa: E402
from vagen.episode import ChatEncoder, Episode  # noqa: E402
from vagen.models import load_policy  # noqa: E402

PROMPTS = ["Push the box left, then up.", "Which way is the target from the player?"]


def engine_worker(worker):
    """Runs inside the engine's worker: what vLLM built it with."""
    return {"rank": int(worker.rank), "local_rank": int(worker.local_rank), "device": str(worker.device)}


def main():
    args = worker_args()
    dist = init_distributed()
    path = checkpoints_dir() / "sokoban_text"
    _, processor = load_policy(path)
    encoder = ChatEncoder(processor)
    decoder = VLLMDecoder(path, encoder, dtype="float32", seed=0)
    built = decoder.llm.collective_rpc(engine_worker)
    ids, _, _ = encoder.user_segment(PROMPTS[dist.rank], [], first=True, system="You play Sokoban.")
    episode = Episode(env_name="sokoban", seed=dist.rank, group_id=dist.rank, system_prompt="", input_ids=list(ids))
    sampling = Sampling(do_sample=False, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16, seed=0)
    generated = decoder.generate([episode], [0], sampling)[0]
    decoder.close()
    with open(os.path.join(args.out, f"rank{dist.rank}.json"), "w") as f:
        json.dump({"env_rank": dist.rank, "env_local_rank": dist.local_rank, "engine": built,
                   "prompt": list(ids), "ids": generated.ids}, f)


if __name__ == "__main__":
    main()
