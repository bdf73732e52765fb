"""Rule-based grading of what an agent says about the state: its `<observation>` (the state it
sees) and `<prediction>` (the state its actions will lead to), scored against the env's true
relations. Deterministic, local and free; pure Python (no torch).

## Relations
A `Relation` is an `(object, a, b)` triple of strings, relative to the agent:

- grid worlds (Sokoban, FrozenLake): `object` is a kind such as "box", "target", "goal" or
  "hole"; `a` is vertical, one of "above", "below", "same" (same row); `b` is horizontal, one of
  "left", "right", "same" (same column). An object under the player is ("same", "same").
- navigation (egocentric): `object` is the target's description ("red table"); `a` is "left",
  "right" or "ahead" and `b` is "near" or "far" (see `envs_visual.navigation` for the thresholds).

`parse_relations` may also return `UNKNOWN` ("?") for an axis the text does not state.

## Parse rules (`parse_relations`)
- The text is cut to `MAX_CHARS` characters, lower-cased, and split into clauses at `. ; : ! ?`,
  commas and line breaks. Object mentions come from the `Vocabulary` (phrases, plural `-s`/`-es`
  accepted; phrases mapped to None name other objects, whose clauses are ignored).
- Each mention opens a group; direction words after it (up to the next mention) belong to it, and
  direction words that open a clause before its first mention ("To my left is the box") belong to
  that mention. A clause without any mention continues the last group ("The box is above me, to
  the left"). A clause whose subject is the player ("I am below the box") has its leading
  directions inverted (grid worlds); "I am on the target" means ("same", "same").
- Synonyms: up/above/north/higher/top/upper, down/below/under/beneath/south/lower/bottom,
  left/west, right/east, compounds such as "above-left", "top right", "north-west";
  "same row"/"same level"/"level with" set the vertical axis to "same", "same column" the
  horizontal one; "directly"/"straight"/"right" before a direction set the other axis to "same"
  ("directly above" = ("above", "same")); "my position"/"same cell"/"where I stand" set both.
  Egocentric: ahead/front/forward/centre, near/close/nearby, far/distant, "N m" (near when
  N <= the vocabulary's `near_distance`) and "N degrees to my left" (ahead when N < 5).
  A direction right after "not"/"never" is dropped. "N rows/columns/cells/steps" are distances,
  not counts.
- Instances: a direction fills its axis of the group's current instance; a different value on an
  axis already filled starts a new instance ("above and below" = two claims), repeating the same
  value does not. In a clause that continues a group, a direction starts a new instance when the
  current one is complete (and differs). "one", "another", "the other" start a new instance ("holes: one
  above-left, one right"). Egocentric "ahead" yields to a later "left"/"right" in the same
  instance ("ahead on the left" = left).
- Counts: a number word or digit right before a mention ("two holes") repeats a group's single
  instance that many times; "no"/"zero" before a mention ("no holes") claims nothing; a group
  with several instances keeps them as listed.
- Unspecified axis: it stays `UNKNOWN`, and such a triple matches a true one with weight 0.5 when
  the object and its stated axis agree (a half-right claim earns half). A mention with no
  direction at all claims nothing. A partial claim in one sentence ("The box is above me.") is
  merged with a complementary partial claim of the same object in the next mention ("The box is
  to the left.") unless that mention is counted or has an article ("a", "one", "another").

## Score (`grade`)
Per object kind: F1 = 2 M / (|parsed| + |true|), M the total weight of a maximum one-to-one
matching (full match 1, partial 0.5). The kinds' weights are re-normalised over the kinds present
(with true triples or described ones); a kind with neither is left out, and when every kind is
left out (nothing to see, nothing claimed) a non-empty description scores 1.0.

Anti-hacking: an empty (or whitespace) description scores 0. A kind scores 0 when its description
claims more distinct positions than `n + n // 2` for `n` true objects (so any second, different
position of a single box is a hedge, "above and below" scores 0), or more than `n` distinct
positions that reach all combinations but one (a "kitchen-sink" list of every relation).
Descriptions longer than `MAX_CHARS` are cut before parsing. Nothing here raises on any text.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

MAX_CHARS = 600
UNKNOWN = "?"
SCHEMES = ("grid", "egocentric")
AXES = {
    "grid": (("above", "below", "same"), ("left", "right", "same")),
    "egocentric": (("left", "right", "ahead"), ("near", "far")),
}
NEAR_DISTANCE = 2.0  # metres: "near" up to this distance (egocentric scheme default)
AHEAD_DEGREES = 5.0  # |bearing| below this is "ahead", as the navigation env's text says "straight ahead"


class Relation(NamedTuple):
    """(object, a, b): an object's place relative to the agent; compares equal to plain tuples."""

    object: str
    a: str
    b: str


@dataclass(frozen=True)
class Vocabulary:
    """What the parser recognises: `names` maps a phrase ("box", "crate", "red table") to the kind
    it grades, or to None for another object whose clauses are ignored; `scheme` is "grid" or
    "egocentric"."""

    names: dict[str, str | None]
    scheme: str = "grid"
    near_distance: float = NEAR_DISTANCE
    _pattern: re.Pattern | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown vocabulary scheme {self.scheme!r}; choices: {', '.join(SCHEMES)}")
        names = {str(k).lower().strip(): v for k, v in self.names.items() if str(k).strip()}
        if not names:
            raise ValueError("a vocabulary needs at least one object phrase, e.g. {'box': 'box'}")
        object.__setattr__(self, "names", names)
        phrases = sorted(names, key=len, reverse=True)  # longest first: "blue table" before "table"
        alternatives = "|".join(r"\s+".join(map(re.escape, p.split())) + r"(?:e?s)?" for p in phrases)
        object.__setattr__(self, "_pattern", re.compile(rf"\b(?:{alternatives})\b"))

    @property
    def kinds(self) -> list[str]:
        return sorted({k for k in self.names.values() if k is not None})

    def kind_of(self, mention: str) -> str | None:
        mention = " ".join(mention.split())
        if mention in self.names:
            return self.names[mention]
        for suffix in ("es", "s"):
            if mention.endswith(suffix) and mention[: -len(suffix)] in self.names:
                return self.names[mention[: -len(suffix)]]
        return None


def grid_vocabulary(names: dict[str, str | None] | list[str]) -> Vocabulary:
    """A grid-world vocabulary; a list of kinds maps each kind to itself."""
    return Vocabulary(names if isinstance(names, dict) else {k: k for k in names}, "grid")


def egocentric_vocabulary(names: dict[str, str | None] | list[str], near_distance: float = NEAR_DISTANCE) -> Vocabulary:
    """A navigation vocabulary (left/right/ahead, near/far)."""
    return Vocabulary(names if isinstance(names, dict) else {k: k for k in names}, "egocentric", near_distance)


# -- normalisation --------------------------------------------------------------------------------
# Direction tokens are upper-case words inserted into lower-cased text, so no text can forge them.
_NUMBER_WORDS = {"zero": 0, "no": 0, "one": 1, "a": 1, "an": 1, "single": 1, "two": 2, "both": 2, "pair": 2,
                 "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
_UNITS = r"(?:rows?|columns?|cols?|cells?|steps?|squares?|tiles?|spaces?|blocks?|places?|positions?|moves?)"
_V_UP = r"(?:above|up|upward|upwards|north|higher|top|upper|over)"
_V_DOWN = r"(?:below|down|downward|downwards|south|lower|bottom|under|beneath|underneath)"
_INTENSIFIER = r"(?:directly|straight|exactly|due|right|just)"

_COMMON = [
    (r"[\u2010-\u2015\-_/]+", " "),
    (r"\bi'm\b", "i am"), (r"n't\b", " not"), (r"\bit's\b", "it is"), (r"'s\b", " is"),
    (r"\b(?:north|south)(?=(?:east|west)\b)", lambda m: m.group(0) + " "),
    (r"\bleft\s*hand\b", "left"), (r"\bright\s*hand\b", "right"),
]
_GRID = [
    (r"\b(?:my|the same|this|our)\s+(?:position|cell|square|spot|place|tile|location)\b", " VSAME HSAME "),
    (r"\bwhere i (?:am|stand|am standing)\b", " VSAME HSAME "),
    (r"\b(?:same|my|this|our)\s+(?:row|level|line|horizontal line)\b", " VSAME "),
    (r"\blevel with\b|\bhorizontally aligned\b|\bin line horizontally\b", " VSAME "),
    (r"\b(?:same|my|this|our)\s+(?:column|col|vertical line)\b", " HSAME "),
    (r"\bvertically aligned\b|\bin line vertically\b", " HSAME "),
    (rf"\b{_INTENSIFIER}\s+(?:to\s+|on\s+)?(?:the\s+|my\s+)?(?:left|west)\b", " VSAME LEFT "),
    (rf"\b{_INTENSIFIER}\s+(?:to\s+|on\s+)?(?:the\s+|my\s+)?(?:right|east)\b", " VSAME RIGHT "),
    (rf"\b{_INTENSIFIER}\s+{_V_UP}\b", " HSAME ABOVE "),
    (rf"\b{_INTENSIFIER}\s+{_V_DOWN}\b", " HSAME BELOW "),
    (r"\bright\s+(?=next|beside|by|here|there|at|on|in)\b", " "),
    (rf"\b{_V_UP}\b", " ABOVE "), (rf"\b{_V_DOWN}\b", " BELOW "),
    (r"\b(?:left|west|leftward|leftwards)\b", " LEFT "), (r"\b(?:right|east|rightward|rightwards)\b", " RIGHT "),
]
_EGOCENTRIC = [
    (r"\bright\s+(?=next|beside|by|here|there|at|on|in|ahead|front)\b", " "),
    (r"\b(?:straight|directly|dead)\s+(?:ahead|in front)\b", " AHEAD "),
    (r"\bin front\b|\bahead\b|\bforward\b|\bin the (?:middle|centre|center)\b", " AHEAD "),
    (r"\b(?:left|leftward|leftwards)\b", " LEFT "), (r"\b(?:right|rightward|rightwards)\b", " RIGHT "),
    (r"\b(?:near|nearby|close|closer|beside|next to|adjacent|within reach)\b", " NEAR "),
    (r"\b(?:far|distant|in the distance|across the room|far away)\b", " FAR "),
]
_AXIS_OF = {
    "grid": {"ABOVE": (0, "above"), "BELOW": (0, "below"), "VSAME": (0, "same"),
             "LEFT": (1, "left"), "RIGHT": (1, "right"), "HSAME": (1, "same")},
    "egocentric": {"LEFT": (0, "left"), "RIGHT": (0, "right"), "AHEAD": (0, "ahead"),
                   "NEAR": (1, "near"), "FAR": (1, "far")},
}
_INVERT = {"above": "below", "below": "above", "left": "right", "right": "left"}
_NEGATIONS = {"not", "never", "nor", "neither", "no longer"}
_MARKERS = {"one", "another", "other"}
_PLAYER_SUBJECT = re.compile(r"^(?:and\s+|now\s+|then\s+|so\s+)*(?:i am|i stand|the player is|player is|"
                             r"the agent is|agent is|the player stands|i will be|i would be)\b")
_CLAUSES = re.compile(r"[.;:!?,\n]+")
_NUMBER = r"([0-9]{1,6}(?:\.[0-9]{1,6})?)"


def _egocentric_numbers(text: str, near_distance: float) -> str:
    def degrees(m):
        return " AHEAD " if float(m.group(1)) < AHEAD_DEGREES else f" {m.group(2)} "

    def metres(m):
        return " NEAR " if float(m.group(1)) <= near_distance + 1e-9 else " FAR "

    text = re.sub(rf"{_NUMBER}\s*(?:degrees?|deg|°)\s+(?:to\s+)?(?:the\s+|my\s+|your\s+)?(left|right)\b",
                  degrees, text)
    text = re.sub(rf"{_NUMBER}\s*(?:degrees?|deg|°)", " ", text)
    return re.sub(rf"{_NUMBER}\s*(?:m|meters?|metres?)\b", metres, text)


def _normalise(text: str, vocabulary: Vocabulary) -> str:
    text = text[:MAX_CHARS].lower()
    for pattern, repl in _COMMON:
        text = re.sub(pattern, repl, text)
    if vocabulary.scheme == "egocentric":
        text = _egocentric_numbers(text, vocabulary.near_distance)
    # "two rows above": a distance, not a count of objects
    words = "|".join(_NUMBER_WORDS)
    text = re.sub(rf"\b(?:[0-9]+(?:\.[0-9]+)?|{words}|a few|several)\s+{_UNITS}\b", " ", text)
    for pattern, repl in (_GRID if vocabulary.scheme == "grid" else _EGOCENTRIC):
        text = re.sub(pattern, repl, text)
    return text


# -- parsing --------------------------------------------------------------------------------------
@dataclass
class _Group:
    kind: str | None
    count: int | None  # None: not stated
    article: bool  # counted or preceded by a/an/one/another: a distinct object
    instances: list[list[str | None]] = field(default_factory=lambda: [[None, None]])
    marked: bool = False  # an enumeration marker waits for the next direction


def _add(group: _Group, axis: int, value: str, scheme: str, continuing: bool) -> None:
    current = group.instances[-1]
    if group.marked and (current[0] is not None or current[1] is not None):
        group.instances.append([None, None])
        current = group.instances[-1]
    group.marked = False
    if continuing and current[0] is not None and current[1] is not None and current[axis] != value:
        group.instances.append([axis == 0 and value or None, axis == 1 and value or None])
        return
    old = current[axis]
    if old is None or old == value:
        current[axis] = value
    elif scheme == "egocentric" and axis == 0 and old == "ahead" and value in ("left", "right"):
        current[axis] = value
    elif scheme == "egocentric" and axis == 0 and value == "ahead" and old in ("left", "right"):
        pass
    else:
        fresh: list[str | None] = [None, None]
        fresh[axis] = value
        group.instances.append(fresh)


def parse_relations(text: str, vocabulary: Vocabulary) -> list[Relation]:
    """The relations `text` states, as `Relation`s with `UNKNOWN` for unstated axes (module
    docstring: parse rules). Never raises on any string; anything else parses to []."""
    if not isinstance(text, str) or not text.strip():
        return []
    try:
        return _parse(text, vocabulary)
    except RecursionError:  # pragma: no cover - regexes here do not recurse; kept for the contract
        return []


def _parse(text: str, vocabulary: Vocabulary) -> list[Relation]:
    scheme = vocabulary.scheme
    axis_of = _AXIS_OF[scheme]
    groups: list[_Group] = []
    for clause in _CLAUSES.split(_normalise(text, vocabulary)):
        clause = " ".join(clause.split())
        if not clause:
            continue
        player_subject = scheme == "grid" and _PLAYER_SUBJECT.match(clause) is not None
        mentions = list(vocabulary._pattern.finditer(clause))
        # (position, kind of item, payload)
        items: list[tuple[int, str, object]] = [(m.start(), "mention", m) for m in mentions]
        words = list(re.finditer(r"[A-Za-z0-9]+", clause))
        for i, w in enumerate(words):
            token = w.group(0)
            if token in axis_of:
                before = [x.group(0) for x in words[max(0, i - 2):i]]
                if any(b in _NEGATIONS for b in before):
                    continue
                items.append((w.start(), "direction", axis_of[token]))
            elif token in _MARKERS and not any(m.start() <= w.start() < m.end() for m in mentions):
                items.append((w.start(), "marker", None))
        items.sort(key=lambda x: x[0])
        if not mentions:
            if groups:
                for _, what, payload in items:
                    if what == "direction":
                        _add(groups[-1], payload[0], payload[1], scheme, continuing=True)
                    elif what == "marker":
                        groups[-1].marked = True
            continue
        first = next(i for i, it in enumerate(items) if it[1] == "mention")
        leading = [it for it in items[:first] if it[1] == "direction"]
        current: _Group | None = None
        for index, (_, what, payload) in enumerate(items[first:]):
            if what == "mention":
                current = _open_group(payload, clause, vocabulary)
                groups.append(current)
                if index == 0:
                    for _, _, (axis, value) in leading:
                        if player_subject:
                            value = _INVERT.get(value, value)
                        _add(current, axis, value, scheme, continuing=False)
                    if player_subject and not leading and re.search(r"\b(?:on|at|in|standing on)\s+(?:the\s+|a\s+)?$",
                                                                   clause[: payload.start()]):
                        current.instances = [["same", "same"]] if scheme == "grid" else current.instances
            elif what == "direction":
                _add(current, payload[0], payload[1], scheme, continuing=False)
            else:
                current.marked = True
    return _emit(groups)


def _open_group(match: re.Match, clause: str, vocabulary: Vocabulary) -> _Group:
    kind = vocabulary.kind_of(match.group(0))
    before = clause[: match.start()].split()
    while before and before[-1] in ("the", "other", "more", "of", "these", "those", "remaining"):
        before.pop()
    count, article = None, False
    if before:
        word = before[-1]
        if re.fullmatch(r"[0-9]{1,6}", word):
            count, article = min(int(word), 50), True
        elif word in _NUMBER_WORDS:
            count, article = _NUMBER_WORDS[word], True
        elif word in ("another", "several", "some", "many", "few"):
            article = True
    return _Group(kind, count, article)


def _emit(groups: list[_Group]) -> list[Relation]:
    out: list[Relation] = []
    last: dict[str, int] = {}  # kind -> index in `out` of its last claim when that claim is partial
    for group in groups:
        instances = [inst for inst in group.instances if inst[0] is not None or inst[1] is not None]
        if group.kind is None or group.count == 0 or not instances:
            continue
        if len(instances) == 1 and group.count and group.count > 1:
            instances = [list(instances[0]) for _ in range(group.count)]
        if len(instances) == 1 and not group.article and group.kind in last:
            prev, inst = out[last[group.kind]], instances[0]
            if (inst[0] is None) == (prev.a != UNKNOWN) and (inst[1] is None) == (prev.b != UNKNOWN):
                out[last.pop(group.kind)] = Relation(group.kind, inst[0] or prev.a, inst[1] or prev.b)
                continue
        for inst in instances:
            out.append(Relation(group.kind, inst[0] or UNKNOWN, inst[1] or UNKNOWN))
        tail = out[-1]
        if len(instances) == 1 and (tail.a == UNKNOWN) != (tail.b == UNKNOWN):
            last[group.kind] = len(out) - 1
        else:
            last.pop(group.kind, None)
    return out


# -- scoring --------------------------------------------------------------------------------------
def _match_weight(claim: Relation, truth: tuple) -> float:
    if claim.object != truth[0]:
        return 0.0
    known = [(c, t) for c, t in zip(claim[1:], truth[1:]) if c != UNKNOWN]
    if not known or any(c != t for c, t in known):
        return 0.0
    return 1.0 if len(known) == 2 else 0.5


def max_matching(weights: list[list[float]]) -> float:
    """Total weight of a maximum-weight one-to-one matching of rows to columns (Hungarian method on
    costs = -weights, padded square; O(n^3), fine for the tens of triples a description holds)."""
    rows, cols = len(weights), len(weights[0]) if weights else 0
    n = max(rows, cols)
    if n == 0:
        return 0.0
    cost = [[-(weights[i][j] if i < rows and j < cols else 0.0) for j in range(n)] for i in range(n)]
    u, v = [0.0] * (n + 1), [0.0] * (n + 1)
    owner, way = [0] * (n + 1), [0] * (n + 1)  # owner[j]: row matched to column j (1-based, 0 = none)
    for i in range(1, n + 1):
        owner[0], j0 = i, 0
        slack, used = [math.inf] * (n + 1), [False] * (n + 1)
        while owner[j0] != 0:
            used[j0] = True
            i0, delta, j1 = owner[j0], math.inf, 0
            for j in range(1, n + 1):
                if not used[j]:
                    reduced = cost[i0 - 1][j - 1] - u[i0] - v[j]
                    if reduced < slack[j]:
                        slack[j], way[j] = reduced, j0
                    if slack[j] < delta:
                        delta, j1 = slack[j], j
            for j in range(n + 1):
                if used[j]:
                    u[owner[j]] += delta
                    v[j] -= delta
                else:
                    slack[j] -= delta
            j0 = j1
        while j0:
            j1 = way[j0]
            owner[j0] = owner[j1]
            j0 = j1
    return float(sum(-cost[owner[j] - 1][j - 1] for j in range(1, n + 1) if owner[j]))


def kind_score(claims: list[Relation], truths: list[tuple], combinations: int) -> float:
    """F1 of one kind's claims against its true triples under one-to-one matching, 0 for a hedge or
    a kitchen-sink list (module docstring)."""
    if not claims and not truths:
        return 1.0
    if not claims or not truths:
        return 0.0
    n, distinct = len(truths), len(set(claims))
    if distinct > n + n // 2 or (distinct > n and distinct >= combinations - 1):
        return 0.0
    matched = max_matching([[_match_weight(c, t) for t in truths] for c in claims])
    return 2.0 * matched / (len(claims) + len(truths))


def grade(text: str, true_relations, weights: dict[str, float], vocabulary: Vocabulary | None = None) -> float:
    """Score in [0, 1] of the description `text` against `true_relations` ((object, a, b) triples),
    per-kind F1 combined with `weights` ({kind: weight}, re-normalised over the kinds present).
    `vocabulary` defaults to a grid vocabulary of the weights' kinds. Never raises on any `text`."""
    if not isinstance(text, str) or not text.strip():
        return 0.0
    if vocabulary is None:
        vocabulary = grid_vocabulary(list(weights))
    claims = parse_relations(text, vocabulary)
    truths = [tuple(str(x) for x in t) for t in true_relations]
    unknown = {t[0] for t in truths} - set(weights)
    if unknown:
        raise ValueError(f"true relations name kinds {sorted(unknown)} that have no weight in {weights}; "
                         "give every kind the env reports a weight (its `state_weights`)")
    a_values, b_values = AXES[vocabulary.scheme]
    combinations = len(a_values) * len(b_values)
    total = score = 0.0
    for kind, weight in weights.items():
        mine = [c for c in claims if c.object == kind]
        real = [t for t in truths if t[0] == kind]
        if weight <= 0 or (not mine and not real):
            continue
        total += weight
        score += weight * kind_score(mine, real, combinations)
    if total == 0.0:
        return 1.0
    return min(1.0, max(0.0, score / total))


def grid_relation(kind: str, player, cell) -> Relation:
    """Where grid `cell` (row, col) lies relative to `player` (row, col), rows counted from the top."""
    dr, dc = int(cell[0]) - int(player[0]), int(cell[1]) - int(player[1])
    return Relation(kind, "above" if dr < 0 else "below" if dr > 0 else "same",
                    "left" if dc < 0 else "right" if dc > 0 else "same")


def plural(noun: str) -> str:
    return noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


# -- descriptions ---------------------------------------------------------------------------------
_COUNT_WORDS = {n: word for word, n in _NUMBER_WORDS.items() if n >= 2 and word not in ("both", "pair")}
_GRID_PHRASES = {
    ("above", "left"): "above and to the left of me", ("above", "right"): "above and to the right of me",
    ("below", "left"): "below and to the left of me", ("below", "right"): "below and to the right of me",
    ("above", "same"): "directly above me, in the same column", ("below", "same"): "directly below me, in the same column",
    ("same", "left"): "on my left, in the same row", ("same", "right"): "on my right, in the same row",
    ("same", "same"): "at my position",
}


def describe_grid(relations, names: dict[str, tuple[str, str]], absent: dict[str, str] | None = None) -> str:
    """Sentences stating grid relations: `names` maps a kind to (singular subject, article form),
    e.g. {"hole": ("The hole", "A hole")}; the article form is used when a kind has several
    objects. `absent` gives a sentence for kinds with no object ("There are no holes.")."""
    relations = [tuple(r) for r in relations]
    sentences = []
    for kind, (the, a) in names.items():
        mine = [r for r in relations if r[0] == kind]
        if not mine and absent and kind in absent:
            sentences.append(absent[kind])
        subject = the if len(mine) == 1 else a
        # Objects in the same relation share one counted sentence ("Three holes are directly below me, ...").
        same = Counter((v, h) for _, v, h in mine)
        for (v, h), n in same.items():
            if n == 1:
                sentences.append(f"{subject} is {_GRID_PHRASES[(v, h)]}.")
            else:
                count = _COUNT_WORDS.get(n, str(n)).capitalize()
                sentences.append(f"{count} {plural(a.split(' ', 1)[-1])} are {_GRID_PHRASES[(v, h)]}.")
    return " ".join(sentences)


_EGOCENTRIC_PHRASES = {"left": "on my left", "right": "on my right", "ahead": "straight ahead"}


def describe_relations(relations) -> str:
    """Any env's true relations as plain sentences, without the env: grid triples as
    `describe_grid` writes them ("The box is above and to the left of me."), egocentric ones as
    "The red table is on my left, near." (for a judge that reads the true state as text)."""
    relations = [tuple(r) for r in relations]
    if not relations:
        return "Nothing to describe is in view."
    sentences = []
    for kind in dict.fromkeys(r[0] for r in relations):
        mine = [r for r in relations if r[0] == kind]
        for _, a, b in mine:
            if (a, b) in _GRID_PHRASES:
                subject = f"The {kind}" if len(mine) == 1 else f"A {kind}"
                sentences.append(f"{subject} is {_GRID_PHRASES[(a, b)]}.")
            else:
                sentences.append(f"The {kind} is {_EGOCENTRIC_PHRASES.get(a, a)}, {b}.")
    return " ".join(sentences)
