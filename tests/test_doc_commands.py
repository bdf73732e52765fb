"""Every GPU command in README.md and docs/*.md passes the checks `vagen/train.py` runs for the GPU count
it states on GPUs of 80 GiB (`python -m vagen.config ... --ranks N --gpu-gib 80`), so the docs cannot drift
from the code."""

import re
import shlex
from pathlib import Path

import pytest
from test_recipes import check_recipe

from vagen.train import parse_args

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def training_commands(text: str) -> list[str]:
    """The `deepspeed ... vagen/train.py ...` commands of a page's fenced code blocks, continuation lines joined
    and trailing comments dropped."""
    commands = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = " ".join(line.split("  #")[0].split())
            if line.startswith("pip install -e . && "):
                line = line.removeprefix("pip install -e . && ")
            if line.startswith("deepspeed ") and "vagen/train.py" in line:
                commands.append(line)
    return commands


def is_gpu_command(command: str) -> bool:
    """A command that trains a checkpoint (a local directory) or runs a recipe: it is meant for GPUs."""
    return bool(re.search(r"model\.path=/|recipes/|--num_nodes", command))


def ranks(command: str) -> int:
    gpus = re.search(r"--num_gpus[ =](\d+)", command)
    nodes = re.search(r"--num_nodes[ =](\d+)", command)
    assert gpus, (f"{command!r} does not state --num_gpus: the DeepSpeed launcher would take every GPU of the node; "
                  f"write deepspeed --num_gpus N")
    return int(gpus.group(1)) * (int(nodes.group(1)) if nodes else 1)


COMMANDS = [(page.relative_to(REPO).as_posix(), command) for page in PAGES
            for command in training_commands(page.read_text()) if is_gpu_command(command)]


def test_the_docs_hold_gpu_commands():
    pages = {page for page, _ in COMMANDS}
    assert {"README.md", "docs/training.md"} <= pages, pages
    assert any("recipes/" in command for _, command in COMMANDS)


@pytest.mark.parametrize("page, command", COMMANDS, ids=[f"{p}:{i}" for i, (p, _) in enumerate(COMMANDS)])
def test_gpu_command_passes_the_checks_for_its_gpu_count(page, command):
    words = shlex.split(command)
    args = parse_args(words[words.index("vagen/train.py") + 1:])
    check_recipe(args.config, args.overrides, ranks(command), gpu_gib=80)  # raises what does not fit


def test_commands_are_extracted_with_their_continuations():
    text = ("```bash\ndeepspeed --hostfile h --num_nodes 2 --num_gpus 8 vagen/train.py --config a \\\n"
            "    --config recipes/b x.y=1   # a comment\npython -m vagen.config a\n```\n"
            "deepspeed vagen/train.py --config outside_a_block\n")
    (command,) = training_commands(text)
    assert command == "deepspeed --hostfile h --num_nodes 2 --num_gpus 8 vagen/train.py --config a --config recipes/b x.y=1"
    assert is_gpu_command(command) and ranks(command) == 16
    with pytest.raises(AssertionError, match="does not state --num_gpus"):
        ranks("deepspeed vagen/train.py --config a --config recipes/b")
