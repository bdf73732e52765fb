"""The documentation: README.md is the front door and docs/ the reference. Every relative link and
image resolves, every page is reachable from the README, the configuration reference is the one
scripts/config_reference.py writes, and the code of "Adding an environment" runs as written."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
MD_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"<(?:img|a|source)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"", re.IGNORECASE)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans removed."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append(INLINE_CODE.sub("", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Anchors of the headings (outside code blocks), with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            out.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
    return out


def link_targets(text: str) -> list[str]:
    targets = []
    for line in prose_lines(text):
        targets += MD_LINK.findall(line) + HTML_LINK.findall(line)
    return targets


def broken_links(page: Path) -> list[str]:
    """Relative links and images of `page` whose file, or heading anchor, does not exist."""
    broken = []
    for target in link_targets(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        path_part, _, fragment = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path.read_text()):
            broken.append(f"{target} (no heading with that anchor)")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_and_image_resolves(page):
    assert broken_links(page) == []


def test_the_link_check_reports_missing_files_images_and_anchors(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n\n```\n## not a heading\n```\n")
    (tmp_path / "figure.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[fine](other.md#a-section) [fine](#page) ![fine](figure.png) [web](https://example.org/x)\n"
        "[gone](missing.md) ![gone](missing.png) [bad anchor](other.md#not-a-heading) [bad](#nowhere)\n"
        '<img src="absent.png"> `[in code](ignored.md)`\n\n```\n[in a block](ignored.md)\n```\n'
    )
    assert broken_links(page) == [
        "missing.md (no such file)",
        "missing.png (no such file)",
        "other.md#not-a-heading (no heading with that anchor)",
        "#nowhere (no heading with that anchor)",
        "absent.png (no such file)",
    ]


def test_every_docs_page_is_reachable_from_the_readme():
    reached, todo = set(), [README.resolve()]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        for target in link_targets(page.read_text()):
            path_part = target.partition("#")[0]
            if path_part.endswith(".md") and "://" not in path_part:
                path = (page.parent / path_part).resolve()
                if path.exists():
                    todo.append(path)
    unreached = [str(p.relative_to(ROOT)) for p in PAGES if p.resolve() not in reached]
    assert unreached == []


def test_the_readme_is_the_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    lines = [line.strip() for line in text.splitlines()]
    # the quick start, and the test command that CI (.ci/run) runs verbatim
    assert "pip install -e . && deepspeed vagen/train.py --config sokoban_visual" in lines
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    vllm_prefix = 'bash scripts/vllm_env.sh && .venv-vllm/bin/python -m pytest -m "vllm and not slow" '
    vllm_line = next((line for line in lines if line.startswith(vllm_prefix)), None)
    assert vllm_line is not None, f"README has no line starting {vllm_prefix!r}"
    for command in ("apt-get update && apt-get install -y chromium chromium-driver",
                    'pip install -e ".[test]" && ruff check . && pytest', vllm_line):
        assert command in lines, command
        assert any(line.startswith(command) for line in ci), command
    # every test file with tests marked vllm runs in the vLLM environment's line, so none is left out of CI
    marked = sorted(f"tests/{path.name}" for path in (ROOT / "tests").glob("test_*.py")
                    if re.search(r"^(pytestmark = .*|@)pytest\.mark\.vllm", path.read_text(), re.MULTILINE))
    listed = vllm_line.removeprefix(vllm_prefix).split()
    assert sorted(listed) == marked, f"the vLLM test line lists {sorted(listed)}; files with vLLM tests: {marked}"


def _config_reference():
    spec = importlib.util.spec_from_file_location("config_reference_script", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_current():
    written = (DOCS / "configuration.md").read_text()
    assert written == _config_reference().render(), (
        "docs/configuration.md is stale: run `python scripts/config_reference.py` and commit the result"
    )


def test_the_configuration_reference_has_every_key_with_type_default_and_help():
    import dataclasses

    from vagen import config

    text = _config_reference().render()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    for section in config.SECTIONS:
        for field in dataclasses.fields(getattr(config.Config(), section)):
            row = rows.get(f"`{section}.{field.name}`")
            assert row is not None, f"{section}.{field.name} is missing"
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
            assert len(cells) == 4 and all(cells), row
            assert field.metadata["help"].split(";")[0].replace("|", "\\|") in cells[3], row


def test_every_public_name_of_vagen_core_is_in_the_algorithms_page():
    import vagen.core

    text = (DOCS / "algorithms.md").read_text()
    assert [name for name in vagen.core.__all__ if f"`{name}" not in text and f"{name}(" not in text] == []


def test_every_run_of_the_results_pages_is_in_the_index():
    index = (DOCS / "results" / "README.md").read_text()
    linked = set(link_targets(index))
    for page in sorted((DOCS / "results").glob("*.md")):
        if page.name == "README.md":
            continue
        runs = [slug(line[3:]) for line in prose_lines(page.read_text()) if line.startswith("## ")]
        assert runs, page
        missing = [anchor for anchor in runs if f"{page.name}#{anchor}" not in linked]
        assert missing == [], page.name


def section_code_blocks(text: str, heading: str) -> list[tuple[str, str]]:
    """(language, code) of the fenced blocks between `heading` and the next heading of its level."""
    level = heading.split(" ")[0]
    blocks, in_section, fence, lang, code = [], False, None, "", []
    for line in text.splitlines():
        if fence is None and line.strip() == heading:
            in_section = True
            continue
        if fence is None and in_section and HEADING.match(line) and HEADING.match(line).group(1) == level:
            break
        if not in_section:
            continue
        if fence is None and FENCE.match(line):
            fence, lang, code = FENCE.match(line).group(1), line.strip()[3:].strip(), []
        elif fence is not None and line.strip() == fence:
            blocks.append((lang, "\n".join(code) + "\n"))
            fence = None
        elif fence is not None:
            code.append(line)
    return blocks


def test_adding_an_environment_runs_as_written(tmp_path, monkeypatch, model_cache, distributed):
    """Saves the `# file:` blocks and runs the Python blocks of docs/environments.md's "Adding an
    environment" in an empty directory: the example env is registered, checked and trained."""
    import envs_visual
    from vagen.models import tokenizer_corpus

    blocks = section_code_blocks((DOCS / "environments.md").read_text(), "## Adding an environment")
    files = {code.splitlines()[0].removeprefix("# file: "): code for _, code in blocks
             if code.startswith("# file: ")}
    programs = [code for lang, code in blocks if lang == "python" and not code.startswith("# file: ")]
    assert set(files) == {"corridor.py", "corridor_visual.yaml"} and len(programs) == 4

    # The built-in tokenizer's text is read once per process from the registered environments: read it
    # now, so that the session's built-in models stay the ones every other test builds.
    tokenizer_corpus()
    monkeypatch.setattr(envs_visual, "ENVS", dict(envs_visual.ENVS))  # the registration is undone afterwards
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "vagen").symlink_to(model_cache)  # model.builtin_cache's default, ~/.cache/vagen
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    for name, code in files.items():
        (work / name).write_text(code)
    namespace: dict = {"__name__": "docs_environments"}
    try:
        for i, code in enumerate(programs):
            exec(compile(code, f"docs/environments.md, Adding an environment, block {i + 1}", "exec"), namespace)
        assert envs_visual.env_class("corridor").__module__ == "corridor"
    finally:
        sys.modules.pop("corridor", None)
    assert (work / "runs" / "corridor" / "config.yaml").exists()
