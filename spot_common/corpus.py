"""A seeded, reproducible corpus for the bundled targets: short grade-school maths word problems
with worked solutions, plus small Python functions, function traces and JSON records.

Every example is an instruction (prompt) and a short completion. Example `i` of seed `s` is a
pure function of (s, i), drawn from its own `random.Random`, so any example can be regenerated
alone. The train / held-out split is a function of the example's *problem key* (its template
and its numbers), never of its position: a held-out problem's template instance (with any
names) never appears in the training stream.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

Split = Literal["train", "heldout"]
HELDOUT_PERCENT = 3
STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")  # one worked arithmetic step

NAMES = [
    ("Ana", "she"), ("Ben", "he"), ("Carl", "he"), ("Dana", "she"), ("Eva", "she"),
    ("Finn", "he"), ("Gina", "she"), ("Hugo", "he"), ("Iris", "she"), ("Jack", "he"),
    ("Kira", "she"), ("Leo", "he"), ("Mia", "she"), ("Noah", "he"), ("Olga", "she"),
    ("Paul", "he"), ("Rosa", "she"), ("Sam", "he"), ("Tina", "she"), ("Omar", "he"),
    ("Lily", "she"), ("Max", "he"), ("Zoe", "she"), ("Ivan", "he"), ("Nora", "she"),
    ("Emma", "she"), ("Liam", "he"), ("Ella", "she"), ("Owen", "he"), ("Ruby", "she"),
]  # fmt: skip
ITEMS = [
    "apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells",
    "coins", "stamps", "eggs", "balloons", "toys", "candies", "flowers", "rocks", "beads",
    "cupcakes", "oranges", "crayons", "pens", "buttons", "grapes", "tickets",
]  # fmt: skip
CONTAINERS = [
    ("box", "boxes"), ("bag", "bags"), ("jar", "jars"), ("pack", "packs"),
    ("basket", "baskets"), ("crate", "crates"), ("tray", "trays"), ("bowl", "bowls"),
]  # fmt: skip
PLANTS = ["roses", "tulips", "trees", "carrots", "tomatoes", "bushes"]
GOODS = ["pen", "notebook", "ball", "cake", "toy car", "kite", "hat", "book", "cup", "lamp"]
VEHICLES = ["car", "bus", "train", "bike", "boat", "truck"]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Berlin", "Madrid", "Delhi", "Quito"]
PETS = ["cat", "dog", "fish", "bird", "rabbit", "horse"]


@dataclass(frozen=True)
class Example:
    """One instruction example.

    kind: "math" (word problem), "trace" (what a small function returns), "code" (write a
      function) or "record" (a JSON record).
    answer: the final answer line's value for "math"/"trace", the whole completion otherwise.
    key: the problem key the split is drawn from (template and numbers, no names).
    """

    id: str
    kind: str
    template: str
    prompt: str
    completion: str
    answer: str
    key: str
    split: Split


@dataclass(frozen=True)
class _Drawn:
    kind: str
    numbers: tuple[int, ...]
    prompt: str
    completion: str
    answer: str


def _person(rng: random.Random, avoid: str = "") -> tuple[str, str]:
    while True:
        name, pronoun = rng.choice(NAMES)
        if name != avoid:
            return name, pronoun


def _math(numbers: tuple[int, ...], prompt: str, lines: list[str], result: int) -> _Drawn:
    completion = "\n".join([*lines, f"#### {result}"])
    return _Drawn("math", numbers, prompt, completion, str(result))


# --- maths word problems: 1-3 arithmetic steps, small numbers -------------------------------


def _add(rng: random.Random) -> _Drawn:
    (n, p), item = _person(rng), rng.choice(ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 15)
    verb = rng.choice(["finds", "buys", "gets", "is given"])
    prompt = (
        f"{n} has {a} {item}. {p.capitalize()} {verb} {b} more. How many {item} does {n} have now?"
    )
    return _math((a, b), prompt, [f"{n} has {a} + {b} = {a + b} {item}."], a + b)


def _sub(rng: random.Random) -> _Drawn:
    (n, _), item = _person(rng), rng.choice(ITEMS)
    m, _ = _person(rng, avoid=n)
    a = rng.randint(5, 30)
    b = rng.randint(1, a - 1)
    prompt = f"{n} has {a} {item} and gives {b} to {m}. How many {item} does {n} have left?"
    return _math((a, b), prompt, [f"{n} has {a} - {b} = {a - b} {item} left."], a - b)


def _mul(rng: random.Random) -> _Drawn:
    item, (_, boxes) = rng.choice(ITEMS), rng.choice(CONTAINERS)
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    prompt = (
        f"There are {a} {boxes} and each one holds {b} {item}. How many {item} are there in all?"
    )
    return _math((a, b), prompt, [f"There are {a} * {b} = {a * b} {item}."], a * b)


def _div(rng: random.Random) -> _Drawn:
    (n, _), item, (box, boxes) = _person(rng), rng.choice(ITEMS), rng.choice(CONTAINERS)
    a, b = rng.randint(2, 9), rng.randint(2, 10)
    c = a * b
    prompt = f"{n} puts {c} {item} into {a} {boxes} equally. How many {item} go in each {box}?"
    return _math((a, b), prompt, [f"Each {box} gets {c} / {a} = {b} {item}."], b)


def _two_add(rng: random.Random) -> _Drawn:
    (n, _), item = _person(rng), rng.choice(ITEMS)
    m, _ = _person(rng, avoid=n)
    a, b, d = rng.randint(2, 12), rng.randint(2, 12), rng.randint(2, 15)
    prompt = (
        f"{n} picks {a} {item} in the morning and {b} in the afternoon. "
        f"{m} picks {d}. How many {item} do they pick together?"
    )
    lines = [f"{n} picks {a} + {b} = {a + b}.", f"Together: {a + b} + {d} = {a + b + d}."]
    return _math((a, b, d), prompt, lines, a + b + d)


def _mul_add(rng: random.Random) -> _Drawn:
    (n, p), item, (_, boxes) = _person(rng), rng.choice(ITEMS), rng.choice(CONTAINERS)
    a, b, d = rng.randint(2, 6), rng.randint(2, 10), rng.randint(1, 20)
    prompt = (
        f"{n} buys {a} {boxes} of {item} with {b} in each and already has {d}. "
        f"How many {item} does {n} have now?"
    )
    lines = [f"{n} buys {a} * {b} = {a * b} {item}.", f"Now {p} has {a * b} + {d} = {a * b + d}."]
    return _math((a, b, d), prompt, lines, a * b + d)


def _mul_sub(rng: random.Random) -> _Drawn:
    (n, _), item, (_, boxes) = _person(rng), rng.choice(ITEMS), rng.choice(CONTAINERS)
    a, b = rng.randint(2, 8), rng.randint(2, 10)
    d = rng.randint(1, a * b - 1)
    prompt = (
        f"{n} has {a} {boxes} with {b} {item} in each and gives away {d} {item}. "
        f"How many {item} are left?"
    )
    lines = [f"{n} has {a} * {b} = {a * b} {item}.", f"Left: {a * b} - {d} = {a * b - d}."]
    return _math((a, b, d), prompt, lines, a * b - d)


def _change(rng: random.Random) -> _Drawn:
    (n, _), good = _person(rng), rng.choice(GOODS)
    a, b = rng.randint(2, 9), rng.randint(2, 6)
    c = rng.choice([x for x in (10, 20, 50, 100) if x > a * b])
    prompt = (
        f"A {good} costs {a} dollars. {n} buys {b} of them and pays with {c} dollars. "
        f"How much change does {n} get?"
    )
    lines = [f"Cost: {b} * {a} = {a * b} dollars.", f"Change: {c} - {a * b} = {c - a * b} dollars."]
    return _math((a, b, c), prompt, lines, c - a * b)


def _add_sub(rng: random.Random) -> _Drawn:
    (n, p), item = _person(rng), rng.choice(ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 12)
    d = rng.randint(1, a + b - 1)
    prompt = (
        f"{n} had {a} {item}. {p.capitalize()} got {b} more and then lost {d}. "
        f"How many {item} does {n} have now?"
    )
    lines = [
        f"After getting more: {a} + {b} = {a + b}.",
        f"After losing: {a + b} - {d} = {a + b - d}.",
    ]
    return _math((a, b, d), prompt, lines, a + b - d)


def _more_than(rng: random.Random) -> _Drawn:
    (n, _), item = _person(rng), rng.choice(ITEMS)
    m, _ = _person(rng, avoid=n)
    a, b = rng.randint(2, 15), rng.randint(1, 10)
    prompt = (
        f"{n} has {a} {item}. {m} has {b} more {item} than {n}. "
        f"How many {item} do they have together?"
    )
    lines = [f"{m} has {a} + {b} = {a + b}.", f"Together: {a} + {a + b} = {2 * a + b}."]
    return _math((a, b), prompt, lines, 2 * a + b)


def _times_as_many(rng: random.Random) -> _Drawn:
    (n, _), item = _person(rng), rng.choice(ITEMS)
    m, _ = _person(rng, avoid=n)
    a, k = rng.randint(2, 12), rng.randint(2, 5)
    word = {2: "twice", 3: "three times", 4: "four times", 5: "five times"}[k]
    prompt = f"{n} has {a} {item}. {m} has {word} as many {item}. How many {item} does {m} have?"
    return _math((a, k), prompt, [f"{m} has {k} * {a} = {k * a} {item}."], k * a)


def _half(rng: random.Random) -> _Drawn:
    (n, _), item = _person(rng), rng.choice(ITEMS)
    m, _ = _person(rng, avoid=n)
    h = rng.randint(2, 30)
    prompt = f"{n} has {2 * h} {item} and gives half of them to {m}. How many {item} does {n} keep?"
    return _math((h,), prompt, [f"{n} keeps {2 * h} / 2 = {h} {item}."], h)


def _per_day(rng: random.Random) -> _Drawn:
    (n, p) = _person(rng)
    a, d = rng.randint(2, 12), rng.randint(2, 9)
    thing, verb = rng.choice([("pages", "reads"), ("laps", "swims"), ("words", "writes")])
    prompt = f"{n} {verb} {a} {thing} every day. How many {thing} does {p} finish in {d} days?"
    return _math((a, d), prompt, [f"In {d} days: {d} * {a} = {d * a} {thing}."], d * a)


def _three_days(rng: random.Random) -> _Drawn:
    (n, p) = _person(rng)
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    prompt = (
        f"{n} reads {a} pages on Monday and {b} pages on Tuesday. On Wednesday {p} reads "
        f"twice as many pages as on Monday. How many pages does {p} read in total?"
    )
    lines = [
        f"Wednesday: 2 * {a} = {2 * a}.",
        f"Monday and Tuesday: {a} + {b} = {a + b}.",
        f"Total: {a + b} + {2 * a} = {3 * a + b}.",
    ]
    return _math((a, b), prompt, lines, 3 * a + b)


def _speed(rng: random.Random) -> _Drawn:
    vehicle = rng.choice(VEHICLES)
    a, b = rng.randint(2, 12), rng.randint(2, 9)
    prompt = f"A {vehicle} travels {a} km every hour. How far does it travel in {b} hours?"
    return _math((a, b), prompt, [f"It travels {b} * {a} = {a * b} km."], a * b)


def _money_left(rng: random.Random) -> _Drawn:
    (n, p), item = _person(rng), rng.choice(ITEMS)
    a, b = rng.randint(2, 8), rng.randint(2, 6)
    c = rng.randint(a * b + 1, 60)
    prompt = (
        f"{n} has {c} dollars. {p.capitalize()} buys {a} {item} for {b} dollars each. "
        f"How much money does {p} have left?"
    )
    lines = [f"Spent: {a} * {b} = {a * b} dollars.", f"Left: {c} - {a * b} = {c - a * b} dollars."]
    return _math((a, b, c), prompt, lines, c - a * b)


def _groups(rng: random.Random) -> _Drawn:
    who = rng.choice(["students", "players", "children", "campers"])
    a, g = rng.randint(2, 8), rng.randint(2, 10)
    prompt = f"There are {a * g} {who}. They form groups of {a}. How many groups are there?"
    return _math((a, g), prompt, [f"There are {a * g} / {a} = {g} groups."], g)


def _garden(rng: random.Random) -> _Drawn:
    plant = rng.choice(PLANTS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    d = rng.randint(1, a * b - 1)
    prompt = (
        f"A garden has {a} rows with {b} {plant} in each row. {d} {plant} are removed. "
        f"How many {plant} are left?"
    )
    lines = [f"The garden has {a} * {b} = {a * b} {plant}.", f"Left: {a * b} - {d} = {a * b - d}."]
    return _math((a, b, d), prompt, lines, a * b - d)


def _three_games(rng: random.Random) -> _Drawn:
    (n, p) = _person(rng)
    a, b, d = rng.randint(1, 12), rng.randint(1, 12), rng.randint(1, 12)
    prompt = f"{n} scores {a}, {b} and {d} points in three games. How many points is that in total?"
    lines = [f"First two games: {a} + {b} = {a + b}.", f"Total: {a + b} + {d} = {a + b + d}."]
    return _math((a, b, d), prompt, lines, a + b + d)


def _difference(rng: random.Random) -> _Drawn:
    (n, _), item = _person(rng), rng.choice(ITEMS)
    m, _ = _person(rng, avoid=n)
    a = rng.randint(5, 30)
    b = rng.randint(1, a - 1)
    prompt = f"{n} has {a} {item} and {m} has {b}. How many more {item} does {n} have than {m}?"
    return _math((a, b), prompt, [f"{n} has {a} - {b} = {a - b} more."], a - b)


def _savings(rng: random.Random) -> _Drawn:
    (n, p) = _person(rng)
    a, w = rng.randint(2, 10), rng.randint(2, 8)
    d = rng.randint(1, a * w - 1)
    prompt = (
        f"{n} saves {a} dollars each week for {w} weeks and then spends {d} dollars. "
        f"How much money does {p} have left?"
    )
    lines = [f"Saved: {w} * {a} = {a * w} dollars.", f"Left: {a * w} - {d} = {a * w - d} dollars."]
    return _math((a, w, d), prompt, lines, a * w - d)


def _two_kinds(rng: random.Random) -> _Drawn:
    (n, p) = _person(rng)
    g1, g2 = rng.sample(GOODS, 2)
    a, b, c, d = rng.randint(2, 5), rng.randint(2, 9), rng.randint(2, 5), rng.randint(2, 9)
    prompt = (
        f"{n} buys {a} {g1}s at {b} dollars each and {c} {g2}s at {d} dollars each. "
        f"How much does {p} spend?"
    )
    lines = [
        f"{g1.capitalize()}s: {a} * {b} = {a * b} dollars.",
        f"{g2.capitalize()}s: {c} * {d} = {c * d} dollars.",
        f"Total: {a * b} + {c * d} = {a * b + c * d} dollars.",
    ]
    return _math((a, b, c, d), prompt, lines, a * b + c * d)


def _pets(rng: random.Random) -> _Drawn:
    pet = rng.choice(PETS)
    a, k = rng.randint(2, 9), rng.randint(2, 4)
    prompt = (
        f"A shop has {a} {pet}s. It gets {k} times as many {pet}s on Friday. "
        f"How many {pet}s does the shop have now?"
    )
    lines = [f"On Friday it gets {k} * {a} = {k * a}.", f"Now: {a} + {k * a} = {a + k * a}."]
    return _math((a, k), prompt, lines, a + k * a)


# --- code: traces (final answer), functions and records (exact completion) ------------------


def _trace_linear(rng: random.Random) -> _Drawn:
    v, a, b = rng.randint(1, 9), rng.randint(2, 9), rng.randint(1, 20)
    prompt = f"What does f({v}) return?\ndef f(x):\n    return x * {a} + {b}"
    lines = [f"f({v}) = {v} * {a} + {b}", f"{v} * {a} = {v * a}", f"{v * a} + {b} = {v * a + b}"]
    completion = "\n".join([*lines, f"#### {v * a + b}"])
    return _Drawn("trace", (v, a, b), prompt, completion, str(v * a + b))


def _trace_loop(rng: random.Random) -> _Drawn:
    n, k = rng.randint(2, 9), rng.randint(2, 9)
    prompt = (
        f"What does f({n}) return?\ndef f(n):\n    s = 0\n    for i in range(n):\n"
        f"        s += {k}\n    return s"
    )
    completion = f"The loop adds {k} a total of {n} times.\n{n} * {k} = {n * k}\n#### {n * k}"
    return _Drawn("trace", (n, k), prompt, completion, str(n * k))


_OPS = [("plus", "+", "add"), ("minus", "-", "sub"), ("times", "*", "mul")]


def _code_const(rng: random.Random) -> _Drawn:
    word, op, stem = rng.choice(_OPS)
    k = rng.randint(2, 20)
    var = rng.choice(["x", "n", "a", "value"])
    name = f"{stem}_{k}"
    prompt = f"Write a Python function {name}({var}) that returns {var} {word} {k}."
    completion = f"def {name}({var}):\n    return {var} {op} {k}"
    return _Drawn(
        "code", (_OPS.index((word, op, stem)), k, ord(var[0])), prompt, completion, completion
    )


_PAIR = [
    ("the sum of a and b", "a + b", "add"),
    ("the product of a and b", "a * b", "mul"),
    ("the larger of a and b", "max(a, b)", "larger"),
    ("the smaller of a and b", "min(a, b)", "smaller"),
    ("a minus b", "a - b", "diff"),
]


def _code_pair(rng: random.Random) -> _Drawn:
    index = rng.randrange(len(_PAIR))
    desc, expr, stem = _PAIR[index]
    k = rng.randint(1, 9)
    name = f"{stem}_plus_{k}"
    prompt = f"Write a Python function {name}(a, b) that returns {desc}, plus {k}."
    completion = f"def {name}(a, b):\n    return {expr} + {k}"
    return _Drawn("code", (index, k), prompt, completion, completion)


_FILTERS = [
    ("greater than {k}", "x > {k}", "above"),
    ("less than {k}", "x < {k}", "below"),
    ("equal to {k}", "x == {k}", "equal"),
]


def _code_loop(rng: random.Random) -> _Drawn:
    f_index, k = rng.randrange(len(_FILTERS)), rng.randint(0, 20)
    desc, cond, stem = (s.format(k=k) for s in _FILTERS[f_index])
    counting = rng.random() < 0.5
    what, update, head = (
        ("number", "total += 1", "count") if counting else ("sum", "total += x", "sum")
    )
    name = f"{head}_{stem}_{k}"
    prompt = f"Write a Python function {name}(xs) that returns the {what} of items in xs {desc}."
    completion = (
        f"def {name}(xs):\n    total = 0\n    for x in xs:\n        if {cond}:\n"
        f"            {update}\n    return total"
    )
    return _Drawn("code", (f_index, k, int(counting)), prompt, completion, completion)


def _record(rng: random.Random) -> _Drawn:
    name_index, city_index = rng.randrange(len(NAMES)), rng.randrange(len(CITIES))
    name, city, age = NAMES[name_index][0], CITIES[city_index], rng.randint(5, 90)
    prompt = f"Make a JSON record for {name}, who is {age} years old and lives in {city}."
    completion = json.dumps({"name": name, "age": age, "city": city})
    return _Drawn("record", (name_index, city_index, age), prompt, completion, completion)


MATH_TEMPLATES: dict[str, Callable[[random.Random], _Drawn]] = {
    "add": _add, "sub": _sub, "mul": _mul, "div": _div, "two_add": _two_add,
    "mul_add": _mul_add, "mul_sub": _mul_sub, "change": _change, "add_sub": _add_sub,
    "more_than": _more_than, "times_as_many": _times_as_many, "half": _half,
    "per_day": _per_day, "three_days": _three_days, "speed": _speed,
    "money_left": _money_left, "groups": _groups, "garden": _garden,
    "three_games": _three_games, "difference": _difference, "savings": _savings,
    "two_kinds": _two_kinds, "pets": _pets,
}  # fmt: skip
OTHER_TEMPLATES: dict[str, Callable[[random.Random], _Drawn]] = {
    "trace_linear": _trace_linear, "trace_loop": _trace_loop, "code_const": _code_const,
    "code_pair": _code_pair, "code_loop": _code_loop, "record": _record,
}  # fmt: skip
MATH_SHARE = 0.75


def split_of(key: str) -> Split:
    """Held-out iff the problem key hashes into the first HELDOUT_PERCENT of 100 buckets."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def example(seed: int, index: int) -> Example:
    """Example `index` of the stream of `seed`: a pure function of both."""
    rng = random.Random(f"spot-corpus:{seed}:{index}")
    templates = MATH_TEMPLATES if rng.random() < MATH_SHARE else OTHER_TEMPLATES
    template = rng.choice(sorted(templates))
    drawn = templates[template](rng)
    key = f"{template}:" + ",".join(map(str, drawn.numbers))
    return Example(
        id=f"{seed}-{index}",
        kind=drawn.kind,
        template=template,
        prompt=drawn.prompt,
        completion=drawn.completion,
        answer=drawn.answer,
        key=key,
        split=split_of(key),
    )


def examples(seed: int, split: Split, start: int = 0) -> Iterator[Example]:
    """The endless stream of `seed`'s examples that fall in `split`, in index order."""
    index = start
    while True:
        item = example(seed, index)
        if item.split == split:
            yield item
        index += 1


def final_answer(completion: str) -> str | None:
    """The value after the last '#### ' line, or None when there is no answer line."""
    for line in reversed(completion.strip().splitlines()):
        if line.startswith("#### "):
            return line[5:].strip()
    return None


def is_correct(item: Example | dict, completion: str) -> bool:
    """Final-answer match for maths and traces, exact completion match otherwise."""
    kind = item.kind if isinstance(item, Example) else item["kind"]
    answer = item.answer if isinstance(item, Example) else item["answer"]
    if kind in ("math", "trace"):
        return final_answer(completion) == answer
    return completion.strip() == answer


def is_well_formed(item: Example | dict, completion: str) -> bool:
    """Maths and traces: worked lines with at least one step `a op b = c` (right or wrong)
    and a final '#### n' line. Code: starts with 'def ' and has a return. Records: parse as
    JSON with name, age and city."""
    kind = item.kind if isinstance(item, Example) else item["kind"]
    text = completion.strip()
    if kind in ("math", "trace"):
        lines = text.splitlines()
        if len(lines) < 2 or not re.fullmatch(r"#### -?\d+", lines[-1]):
            return False
        return any(STEP.search(line) for line in lines[:-1])
    if kind == "code":
        return text.startswith("def ") and "\n    return " in text
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and set(record) == {"name", "age", "city"}


def write_jsonl(path: Path, items: list[Example]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for item in items:
            row = asdict(item)
            f.write(json.dumps(row) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def heldout_prompt_set(seed: int = 0, count: int = 400) -> list[Example]:
    """The bundled held-out prompt set: the first `count` held-out examples of `seed`'s
    stream with distinct problem keys (all kinds, about three quarters maths)."""
    chosen: dict[str, Example] = {}
    for item in examples(seed, "heldout"):
        chosen.setdefault(item.key, item)
        if len(chosen) == count:
            return list(chosen.values())
    raise AssertionError("unreachable: the stream is endless")


def heldout_prompts(kinds: Sequence[str], count: int) -> list[dict]:
    """The first `count` bundled held-out prompts of these kinds, in the bundled file's order."""
    from spot.builtin import resolve_builtin

    rows = read_jsonl(resolve_builtin("prompts/heldout.jsonl"))
    return [r for r in rows if r["kind"] in kinds][:count]
