"""Run under the DeepSpeed launcher by tests/test_families.py: two iterations of `vagen.train` on two ranks under
ZeRO-3 (every parameter partitioned, the critic on), from the Qwen3-VL and the Qwen3.5 built-ins."""

from child_env import worker_args

import vagen.train

COMMON = ["train.iterations=2", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
          "rollout.max_turns=2", "train.mini_batch_size=2", "train.micro_batch_size=2", "log.progress=false",
          "log.tensorboard=false", "train.deepspeed_config=deepspeed/zero3_fp32.json"]


def main():
    args = worker_args()
    for name in ("builtin:tiny-qwen3-vl", "builtin:tiny-qwen3.5"):
        code = vagen.train.main(["--config", "sokoban_visual", *COMMON, f"model.path={name}",
                                 f"model.builtin_cache={args.cache}", f"train.run_dir={args.out}",
                                 f"train.run_name={name.split(':')[1]}"])
        assert code == 0, f"{name}: vagen.train returned {code}"


if __name__ == "__main__":
    main()
