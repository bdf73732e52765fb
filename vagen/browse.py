"""A static episode browser: one HTML page per evaluation, opened from disk with no server and no network.

    python -m vagen.browse runs/<run>/eval/step_N     (re)writes that evaluation's index.html
    python -m vagen.browse runs/<run>                 every evaluation under the run, and an index of them

Every evaluation (`python -m vagen.eval` and training's periodic `eval.every`) writes beside its
results.json:

    index.html        the page: the episodes with success, return, turns and env seed, filters on
                      them, and each episode turn by turn (frame, reasoning, answer, actions, reward,
                      the grades of <observation> and <prediction> where the format has them)
    episodes.jsonl    one episode per line, what the page shows (the page embeds a copy)
    frames/           the frames the agent saw, as PNG files, loaded only when an episode is opened

Keys on the page: ← → step through the turns, ↑ ↓ move through the episodes shown.
"""

from __future__ import annotations

import argparse
import html
import io
import json
import sys
from pathlib import Path

EPISODES_FILE = "episodes.jsonl"


def episode_data(episodes) -> list[dict]:
    """What the browser shows of each played episode (with its frames as PNG bytes), on the rank that
    played it; gathered to one rank and written by `write_browser`."""
    out = []
    for ep in episodes:
        turns = []
        for turn in ep.turns:
            info = turn.info
            frames = []
            for image in turn.images:
                buffer = io.BytesIO()
                image.save(buffer, format="PNG")
                frames.append(buffer.getvalue())
            grades = {}
            for key, state in (("grounding_score", "state_before"), ("worldmodel_score", "state_after")):
                if info.get(key) is not None:  # the true state the description was graded against
                    grades[key] = {"score": float(info[key]),
                                   "state": ["(" + ", ".join(map(str, r)) + ")" for r in info.get(state) or []]}
            turns.append({"observation": turn.observation, "frames": frames, "response": turn.response,
                          "reward": float(turn.reward), "actions": list(info.get("actions") or []),
                          "parsed": {k: v for k, v in (info.get("parsed") or {}).items() if v},
                          "format_ok": bool(info.get("format_ok")), "action_valid": bool(info.get("action_is_valid")),
                          "grades": grades})
        out.append({"seed": int(ep.seed), "env": ep.env_name, "success": bool(ep.success),
                    "return": float(sum(t["reward"] for t in turns)), "turns": turns,
                    "error": getattr(ep, "error", None) or getattr(ep, "model_error", None), "system_prompt": ep.system_prompt})
    return out


def write_browser(out_dir: Path, cfg, episodes: list[dict]) -> Path:
    """Write frames/, episodes.jsonl and index.html for `episodes` (from `episode_data`) into `out_dir`."""
    out_dir = Path(out_dir)
    frames_dir = out_dir / "frames"
    frames_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for ep in sorted(episodes, key=lambda e: e["seed"]):
        turns = []
        for number, turn in enumerate(ep["turns"], start=1):
            paths = []
            for k, png in enumerate(turn["frames"]):
                name = f"seed{ep['seed']}_turn{number}_{k}.png"
                (frames_dir / name).write_bytes(png)
                paths.append(f"frames/{name}")
            turns.append({**turn, "frames": paths})
        lines.append(json.dumps({**ep, "turns": turns}))
    (out_dir / EPISODES_FILE).write_text("".join(line + "\n" for line in lines))
    meta = {"env": cfg.env.name, "config": cfg.name, "prompt_format": cfg.env.prompt_format,
            "do_sample": cfg.eval.do_sample}
    (out_dir / "meta.json").write_text(json.dumps(meta))
    return write_page(out_dir)


def write_page(eval_dir: Path) -> Path:
    """index.html of one evaluation from its episodes.jsonl (and meta.json, where present)."""
    eval_dir = Path(eval_dir)
    source = eval_dir / EPISODES_FILE
    if not source.exists():
        raise FileNotFoundError(f"{source} not found: an evaluation directory holds the episodes.jsonl that "
                                f"vagen.eval writes (evaluations made before the browser existed do not; evaluate "
                                f"the checkpoint again with python -m vagen.eval)")
    episodes = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    meta_path = eval_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    where = eval_dir.resolve()
    # runs/<run>/eval/step_N -> "<run>/eval/step_N"; any other folder by its own name
    title = f"{meta.get('config', '')}: " + (f"{where.parent.parent.name}/eval/{where.name}"
                                             if where.parent.name == "eval" else where.name)
    page = eval_dir / "index.html"
    page.write_text(_render(title, meta, episodes))
    return page


def write_run_index(run_dir: Path, pages: list[Path]) -> Path:
    """index.html of a run: its evaluations, with their success and a link to each page."""
    rows = []
    for page in sorted(pages, key=lambda p: _step_key(p.parent)):
        episodes = [json.loads(line) for line in (page.parent / EPISODES_FILE).read_text().splitlines() if line]
        successes = sum(e["success"] for e in episodes)
        mean = sum(e["return"] for e in episodes) / len(episodes) if episodes else 0.0
        rows.append(f"<tr><td><a href=\"{html.escape(page.relative_to(run_dir).as_posix())}\">"
                    f"{html.escape(page.parent.relative_to(run_dir).as_posix())}</a></td><td>{len(episodes)}</td>"
                    f"<td>{successes / max(1, len(episodes)):.3f}</td><td>{mean:.2f}</td></tr>")
    index = run_dir / "index.html"
    index.write_text(f"<!doctype html><meta charset=utf-8><title>{html.escape(run_dir.name)}: evaluations</title>"
                     f"<style>{_CSS}</style><body class=runindex><h1>{html.escape(run_dir.name)}: evaluations</h1>"
                     f"<table><tr><th>evaluation</th><th>episodes</th><th>success</th><th>mean return</th></tr>"
                     f"{''.join(rows)}</table></body>")
    return index


def _step_key(path: Path):
    name = path.name
    return (0, int(name[5:])) if name.startswith("step_") and name[5:].isdigit() else (1, str(path))


def _render(title: str, meta: dict, episodes: list[dict]) -> str:
    system_prompt = episodes[0]["system_prompt"] if episodes else ""
    data = [{k: v for k, v in ep.items() if k != "system_prompt"} for ep in episodes]
    # `</` inside a script element would end it early: JSON allows the escaped slash.
    payload = json.dumps({"meta": meta, "episodes": data}).replace("</", "<\\/")
    return (_TEMPLATE.replace("__TITLE__", html.escape(title)).replace("__CSS__", _CSS)
            .replace("__SYSTEM__", html.escape(system_prompt)).replace("__DATA__", payload).replace("__JS__", _JS))


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #1d2330; background: #f5f6f8; }
header { padding: 10px 16px; background: #1d2330; color: #fff; }
header h1 { font-size: 16px; margin: 0 0 4px; }
header .summary { color: #c9d1e0; }
#layout { display: flex; height: calc(100vh - 64px); }
#list { width: 380px; min-width: 300px; border-right: 1px solid #d5d9e0; display: flex; flex-direction: column;
        background: #fff; }
#filters { padding: 8px; border-bottom: 1px solid #d5d9e0; display: grid; grid-template-columns: auto 1fr;
           gap: 4px 8px; align-items: center; }
#filters input, #filters select { width: 100%; box-sizing: border-box; }
#shown { padding: 4px 8px; color: #5a6475; }
#table-wrap { overflow-y: auto; flex: 1; }
table { border-collapse: collapse; width: 100%; }
th, td { padding: 3px 8px; text-align: right; border-bottom: 1px solid #eceef2; }
th { position: sticky; top: 0; background: #f0f2f5; cursor: pointer; user-select: none; }
th:first-child, td:first-child { text-align: left; }
tr.episode { cursor: pointer; }
tr.episode:hover { background: #eef3ff; }
tr.episode.selected { background: #d9e5ff; }
.ok { color: #17803d; font-weight: 600; } .fail { color: #b42318; font-weight: 600; }
#view { flex: 1; overflow-y: auto; padding: 12px 16px; }
#view .empty { color: #5a6475; margin-top: 40px; text-align: center; }
#episode-head { display: flex; gap: 16px; align-items: baseline; flex-wrap: wrap; }
#episode-head h2 { margin: 0; font-size: 18px; }
#stepper { display: flex; gap: 6px; align-items: center; margin: 10px 0; flex-wrap: wrap; }
#stepper button { padding: 3px 10px; }
.dot { width: 26px; height: 26px; border-radius: 13px; border: 1px solid #9aa3b2; background: #fff; cursor: pointer; }
.dot.current { background: #2f5fd0; color: #fff; border-color: #2f5fd0; }
.dot.good { border-color: #17803d; } .dot.bad { border-color: #b42318; }
#turn { display: flex; gap: 16px; align-items: flex-start; flex-wrap: wrap; }
#turn-frame img { width: 336px; image-rendering: pixelated; border: 1px solid #d5d9e0; background: #fff; }
#turn-frame pre { margin: 0; }
#turn-text { flex: 1; min-width: 320px; }
.field { background: #fff; border: 1px solid #dde1e7; border-radius: 6px; padding: 6px 10px; margin-bottom: 8px; }
.field h3 { margin: 0 0 2px; font-size: 12px; text-transform: uppercase; letter-spacing: .04em; color: #5a6475; }
.field .body { white-space: pre-wrap; word-break: break-word; }
.grade { float: right; font-size: 12px; padding: 0 6px; border-radius: 8px; background: #eef1f6;
         text-transform: none; letter-spacing: normal; color: #1d2330; }
.truth { font-size: 12px; color: #5a6475; margin-top: 4px; }
pre { white-space: pre-wrap; word-break: break-word; font: 12px/1.35 ui-monospace, monospace; }
details { margin-bottom: 8px; }
.badges span { margin-right: 8px; }
body.runindex { padding: 16px; } body.runindex table { width: auto; background: #fff; }
"""

_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title><style>__CSS__</style></head>
<body>
<header><h1>__TITLE__</h1><div class="summary" id="summary"></div></header>
<div id="layout">
  <div id="list">
    <div id="filters">
      <label for="filter-success">success</label>
      <select id="filter-success"><option value="all">all</option><option value="yes">succeeded</option>
        <option value="no">failed</option></select>
      <label for="filter-turns">turns</label><select id="filter-turns"><option value="all">all</option></select>
      <label for="filter-return">return &ge;</label><input id="filter-return" type="number" step="any">
      <label for="filter-seed">seed</label><input id="filter-seed" type="text" placeholder="contains">
    </div>
    <div id="shown"></div>
    <div id="table-wrap"><table id="episodes"><thead><tr><th data-key="seed">seed</th>
      <th data-key="success">success</th><th data-key="return">return</th><th data-key="turns">turns</th>
      <th data-key="format_ok">format ok</th></tr></thead><tbody></tbody></table></div>
  </div>
  <div id="view"><p class="empty">Choose an episode on the left (&uarr; &darr; move, &larr; &rarr; step through turns).</p>
    <details><summary>system prompt</summary><pre>__SYSTEM__</pre></details></div>
</div>
<script type="application/json" id="data">__DATA__</script>
<script>__JS__</script>
</body></html>
"""

_JS = r"""
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const EPISODES = DATA.episodes;
const state = {shown: [], selected: null, turn: 0, sortKey: "seed", sortDir: 1};
const $ = (id) => document.getElementById(id);
const el = (tag, attrs = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
};
const fmt = (x, d = 2) => (x === null || x === undefined) ? "–" : Number(x).toFixed(d);
const formatShare = (ep) => ep.turns.length ? ep.turns.filter((t) => t.format_ok).length / ep.turns.length : 0;

function summary() {
  const n = EPISODES.length, wins = EPISODES.filter((e) => e.success).length;
  const mean = n ? EPISODES.reduce((s, e) => s + e.return, 0) / n : 0;
  const m = DATA.meta || {};
  $("summary").textContent = `${m.env || ""} · ${m.prompt_format || ""} · ${m.do_sample ? "sampled" : "greedy"} · ` +
    `${n} episodes · success ${fmt(n ? wins / n : 0, 3)} · mean return ${fmt(mean)}`;
  const turns = [...new Set(EPISODES.map((e) => e.turns.length))].sort((a, b) => a - b);
  for (const t of turns) $("filter-turns").append(el("option", {value: String(t), text: String(t)}));
}

function rows() {
  // One row per episode, built once; filtering only hides and shows them.
  const body = document.querySelector("#episodes tbody");
  EPISODES.forEach((ep, index) => {
    const row = el("tr", {class: "episode", "data-index": String(index), "data-seed": String(ep.seed)},
      el("td", {text: String(ep.seed)}),
      el("td", {class: ep.success ? "ok" : "fail", text: ep.success ? "yes" : "no"}),
      el("td", {text: fmt(ep.return)}), el("td", {text: String(ep.turns.length)}),
      el("td", {text: fmt(formatShare(ep))}));
    row.addEventListener("click", () => select(index));
    ep.row = row;
    body.append(row);
  });
}

function applyFilters() {
  const success = $("filter-success").value, turns = $("filter-turns").value;
  const minReturn = $("filter-return").value === "" ? null : Number($("filter-return").value);
  const seed = $("filter-seed").value.trim();
  const key = state.sortKey, dir = state.sortDir;
  const value = (ep) => key === "turns" ? ep.turns.length : key === "format_ok" ? formatShare(ep) : Number(ep[key]);
  state.shown = EPISODES.map((ep, i) => i).filter((i) => {
    const ep = EPISODES[i];
    return (success === "all" || ep.success === (success === "yes")) &&
      (turns === "all" || ep.turns.length === Number(turns)) &&
      (minReturn === null || ep.return >= minReturn) && (!seed || String(ep.seed).includes(seed));
  }).sort((a, b) => dir * (value(EPISODES[a]) - value(EPISODES[b])) || EPISODES[a].seed - EPISODES[b].seed);
  const body = document.querySelector("#episodes tbody");
  const visible = new Set(state.shown);
  EPISODES.forEach((ep, i) => { ep.row.hidden = !visible.has(i); });
  for (const i of state.shown) body.append(EPISODES[i].row);
  $("shown").textContent = `showing ${state.shown.length} of ${EPISODES.length} episodes`;
}

function select(index, turn = 0) {
  if (state.selected !== null) EPISODES[state.selected].row.classList.remove("selected");
  state.selected = index;
  state.turn = turn;
  const ep = EPISODES[index];
  ep.row.classList.add("selected");
  ep.row.scrollIntoView({block: "nearest"});
  location.hash = `seed=${ep.seed}&turn=${turn + 1}`;
  renderEpisode();
}

function field(title, text, grade) {
  const box = el("div", {class: "field"}, el("h3", {text: title}));
  if (grade) {
    box.firstChild.append(el("span", {class: "grade", text: `grade ${fmt(grade.score)}`}));
  }
  box.append(el("div", {class: "body", text: text}));
  if (grade && grade.state.length) box.append(el("div", {class: "truth", text: "true state: " + grade.state.join(" ")}));
  return box;
}

function renderEpisode() {
  const ep = EPISODES[state.selected];
  const turn = ep.turns[state.turn];
  const view = $("view");
  view.replaceChildren();
  view.append(el("div", {id: "episode-head"}, el("h2", {text: `${ep.env} seed ${ep.seed}`}),
    el("span", {class: ep.success ? "ok" : "fail", text: ep.success ? "succeeded" : "failed"}),
    el("span", {text: `return ${fmt(ep.return)}`}), el("span", {text: `${ep.turns.length} turns`})));
  if (ep.error) view.append(field("environment error", ep.error));
  const stepper = el("div", {id: "stepper"});
  const prev = el("button", {id: "turn-prev", text: "◀ previous turn"});
  const next = el("button", {id: "turn-next", text: "next turn ▶"});
  prev.disabled = state.turn === 0;
  next.disabled = state.turn >= ep.turns.length - 1;
  prev.addEventListener("click", () => step(-1));
  next.addEventListener("click", () => step(1));
  stepper.append(prev);
  ep.turns.forEach((t, k) => {
    const dot = el("button", {class: "dot" + (k === state.turn ? " current" : "") + (t.format_ok ? " good" : " bad"),
      text: String(k + 1), title: `turn ${k + 1}: reward ${fmt(t.reward)}`});
    dot.addEventListener("click", () => { state.turn = k; select(state.selected, k); });
    stepper.append(dot);
  });
  stepper.append(next, el("span", {id: "turn-label", text: `turn ${state.turn + 1} of ${ep.turns.length}`}));
  view.append(stepper);
  if (!turn) return;
  const frame = el("div", {id: "turn-frame"});
  for (const src of turn.frames) frame.append(el("img", {src: src, loading: "lazy", alt: `turn ${state.turn + 1}`}));
  if (!turn.frames.length) frame.append(el("pre", {class: "field", text: turn.observation}));
  const text = el("div", {id: "turn-text"});
  const parsed = turn.parsed || {};
  const grades = turn.grades || {};
  const badges = el("div", {class: "badges field"},
    el("span", {id: "turn-reward", text: `reward ${fmt(turn.reward)}`}),
    el("span", {class: turn.format_ok ? "ok" : "fail", text: turn.format_ok ? "format ok" : "format not ok"}),
    el("span", {class: turn.action_valid ? "ok" : "fail", text: turn.action_valid ? "actions valid" : "actions invalid"}));
  text.append(badges);
  if (parsed.observation) text.append(field("observation (agent)", parsed.observation, grades.grounding_score));
  for (const name of ["think", "reasoning"]) if (parsed[name]) text.append(field(name, parsed[name]));
  if (parsed.prediction) text.append(field("prediction", parsed.prediction, grades.worldmodel_score));
  text.append(field("answer", parsed.answer || "(no answer parsed)"));
  text.append(field("actions taken", turn.actions.length ? turn.actions.join(", ") : "(none)"));
  const raw = el("details", {}, el("summary", {text: "full response"}));
  raw.append(el("pre", {id: "turn-response", text: turn.response}));
  raw.open = !parsed.answer;
  const obs = el("details", {}, el("summary", {text: "observation text"}), el("pre", {text: turn.observation}));
  text.append(raw, obs);
  view.append(el("div", {id: "turn"}, frame, text));
}

function step(delta) {
  if (state.selected === null) return;
  const n = EPISODES[state.selected].turns.length;
  const turn = Math.min(n - 1, Math.max(0, state.turn + delta));
  if (turn !== state.turn) select(state.selected, turn);
}

function move(delta) {
  if (!state.shown.length) return;
  const at = state.shown.indexOf(state.selected);
  const to = at < 0 ? 0 : Math.min(state.shown.length - 1, Math.max(0, at + delta));
  select(state.shown[to]);
}

document.addEventListener("keydown", (event) => {
  if (["INPUT", "SELECT"].includes(event.target.tagName)) return;
  const keys = {ArrowLeft: () => step(-1), ArrowRight: () => step(1), ArrowUp: () => move(-1), ArrowDown: () => move(1)};
  if (keys[event.key]) { keys[event.key](); event.preventDefault(); }
});
for (const id of ["filter-success", "filter-turns", "filter-return", "filter-seed"]) {
  for (const kind of ["input", "change"]) $(id).addEventListener(kind, applyFilters);
}
document.querySelectorAll("#episodes th").forEach((th) => th.addEventListener("click", () => {
  state.sortDir = state.sortKey === th.dataset.key ? -state.sortDir : 1;
  state.sortKey = th.dataset.key;
  applyFilters();
}));
summary();
rows();
applyFilters();
const wanted = new URLSearchParams(location.hash.slice(1));
const start = EPISODES.findIndex((ep) => String(ep.seed) === wanted.get("seed"));
if (start >= 0) select(start, Math.max(0, Number(wanted.get("turn") || 1) - 1));
"""


def find_chromium() -> str:
    """The path of a Chromium (or Chrome) binary, or an error that says how to install one."""
    import shutil

    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError("no Chromium found on PATH (looked for chromium, chromium-browser, google-chrome); "
                            "install it, e.g. apt-get install -y chromium on Debian or Ubuntu")


def screenshot(page: Path, png: Path, fragment: str = "", size: tuple[int, int] = (1280, 760)) -> Path:
    """A PNG of `page` as headless Chromium shows it, `fragment` (e.g. "seed=1000000003&turn=2") choosing
    the episode and turn open on it: for the figures of the docs."""
    import subprocess

    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    url = Path(page).resolve().as_uri() + (f"#{fragment}" if fragment else "")
    cmd = [find_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--window-size={size[0]},{size[1]}", "--virtual-time-budget=3000", f"--screenshot={png}", url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or not png.exists():
        raise RuntimeError(f"chromium could not take the screenshot of {url} (exit {done.returncode}): "
                           f"{done.stderr[-2000:]}")
    return png


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vagen.browse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="an evaluation directory (with episodes.jsonl) or a run directory")
    args = parser.parse_args(argv)
    path = Path(args.path)
    if not path.is_dir():
        print(f"error: {path} is not a directory; pass an evaluation directory (runs/<run>/eval/step_N, or the "
              f"--out of python -m vagen.eval) or a run directory (runs/<run>)", file=sys.stderr)
        return 2
    if (path / EPISODES_FILE).exists():
        print(write_page(path))
        return 0
    pages = [write_page(source.parent) for source in sorted(path.rglob(EPISODES_FILE))]
    if not pages:
        print(f"error: no evaluation under {path}: no {EPISODES_FILE} there or below; evaluations write it "
              f"(python -m vagen.eval, or eval.every during training); older ones need evaluating again",
              file=sys.stderr)
        return 2
    for page in pages:
        print(page)
    print(write_run_index(path, pages))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
