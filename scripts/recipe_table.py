"""The README's recipe table, from `python -m vagen.config --ranks N --gpu-gib 80` over each model recipe of
configs/recipes/ after sokoban_visual, at the GPU count its header states:

    python scripts/recipe_table.py            # prints the table
    python scripts/recipe_table.py --check    # exits 1 when README.md's table differs (tests/test_preflight.py)
    python scripts/recipe_table.py --write    # replaces README.md's table with it

"model states" is the estimate of weights, gradients and AdamW states per GPU; "with vLLM" adds vLLM's share
of an 80 GiB GPU, DeepSpeed's communication buckets and the margin (vagen/memory.py). Where vllm is not
installed its absence is the one check allowed to fail: the table is about memory. Imports no torch.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vagen.config import CONFIGS_DIR, ChecksFailed, check_config, load_configs  # noqa: E402
from vagen.preflight import missing_packages  # noqa: E402

GPU_GIB = 80
HEADER = ["| recipe | sized for | model states per GPU (estimate) | with vLLM, of 80 GiB |",
          "| --- | --- | --- | --- |"]


def stated_gpus(text: str) -> int | None:
    found = re.search(r"deepspeed --num_gpus (\d+) vagen/train.py", text)
    return int(found.group(1)) if found else None


def row(name: str) -> str | None:
    """The table's row of recipe `name`, None for a preset (no family line, no stated GPU count)."""
    text = (CONFIGS_DIR / "recipes" / f"{name}.yaml").read_text()
    ranks = stated_gpus(text)
    if ranks is None or "\nfamily: " not in "\n" + text:
        return None
    names = ["sokoban_visual", f"recipes/{name}"]
    try:
        cfg, lines = check_config(names, [], ranks, GPU_GIB)
    except ChecksFailed as err:
        cfg = load_configs(names, [], require_checkpoint=False)
        if err.failures != missing_packages(cfg):  # only a package's absence, never a failing check
            raise
        lines = err.lines
    states = next(line for line in lines if line.startswith("  total")).split()[1]
    total = next(line for line in lines if line.startswith("  GPU total")).split()[2]
    stage = re.search(r"ZeRO-(\d)", lines[0]).group(1)
    how = f"LoRA r={cfg.model.lora_rank}" if cfg.model.lora_rank > 0 else f"ZeRO-{stage}"
    method = " (GRPO)" if cfg.algo.adv_estimator == "grpo" else ""
    return f"| `recipes/{name}`{method} | {ranks} × 80 GB, {how} | {states} GiB | {total} GiB |"


def table() -> list[str]:
    names = sorted(p.stem for p in (CONFIGS_DIR / "recipes").glob("*.yaml"))
    return HEADER + [r for r in (row(name) for name in names) if r is not None]


def readme_table(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(HEADER[0]) if HEADER[0] in lines else None
    if start is None:
        return []
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[start:end]


def main(argv: list[str]) -> int:
    rows = table()
    readme = ROOT / "README.md"
    if "--write" in argv:
        text = readme.read_text()
        current = readme_table(text)
        if not current:
            print(f"no recipe table (a line {HEADER[0]!r}) in {readme}", file=sys.stderr)
            return 1
        readme.write_text(text.replace("\n".join(current) + "\n", "\n".join(rows) + "\n", 1))
        return 0
    if "--check" in argv:
        current = readme_table(readme.read_text())
        if current != rows:
            print("README.md's recipe table differs from the tool; replace it with the output of "
                  "python scripts/recipe_table.py:\n" + "\n".join(rows), file=sys.stderr)
            return 1
        return 0
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
