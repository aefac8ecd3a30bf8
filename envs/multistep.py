"""Fresh multi-step word problems: 2 to 8 chained arithmetic operations with exact answers, the
"Fresh multi-step" set of the ProcessGRPO reference (the model card of
zaydsyed/TactLM-Math-ProcessGRPO-Qwen2.5-0.5B: 700 newly generated problems, 100 per operation
count).

A problem is a start value and a chain of steps [op, operand]: value_k = value_(k-1) op operand,
op in add | sub | mul | div, the operand a number (as the text writes it) or "v<j>", an earlier
value ("as many as Ana and Ben together"). Every step is one sentence, so the operation count is
the number of sentences after the first (in the rates stories the last step is in the question).
Values stay exact: counts are whole and money is whole cents at every step (a division is drawn
only where it divides evenly), so every answer is an integer or a terminating decimal.

Splits, the stated rule: a problem text belongs to exactly one split by its SHA-256 (`route`):
10% test, 10% validation, 80% train. So no two splits share a text whatever seeds drew them.
Each (split, operation count, seed) also draws from its own seeded stream, so a set is a pure
function of its arguments:
    test_set()                         the 700 fresh multi-step problems (seed 0): the benchmark
    generate("validation", 50)         350 problems for checkpoint choice during training
    generate("train", 300, seed=1)     2,100 training problems
"""
import hashlib
import random
from fractions import Fraction

OP_COUNTS = tuple(range(2, 9))
SPLITS = ("train", "validation", "test")
MAX_COUNT, MAX_CENTS = 5000, 500_000   # redraw a step past these: answers a person can still check

NAMES = ["Ana", "Ben", "Cara", "Dev", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena",
         "Mateo", "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Uma", "Victor", "Wen", "Yusuf",
         "Zoe", "Aiden", "Bea", "Chen", "Dalia", "Emil", "Farah", "Hugo", "Ines", "Jonas", "Keiko", "Luis",
         "Mira"]
ITEMS = ["marbles", "stickers", "stamps", "trading cards", "seashells", "pencils", "comic books", "coins",
         "beads", "apples", "cookies", "eggs", "toy cars", "postcards", "buttons", "crayons"]
GOODS = ["notebook", "pen", "backpack", "lamp", "mug", "puzzle", "kite", "board game", "water bottle", "hat",
         "calculator", "candle", "pillow", "wallet", "clock", "basket", "teapot", "map", "blanket", "toaster"]
THINGS = ["a book", "lunch", "a movie ticket", "a plant", "a gift", "bus fares", "art supplies",
          "a board game"]
RATES = [  # agent, verb, its base form, what it makes, per what
    ("machine", "fills", "fill", "bottles", "minute"), ("printer", "prints", "print", "pages", "minute"),
    ("oven", "bakes", "bake", "loaves", "hour"), ("worker", "packs", "pack", "boxes", "hour"),
    ("loom", "weaves", "weave", "scarves", "day")]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth"]
TIMES = {2: "twice", 3: "three times", 4: "four times", 5: "five times"}
PARTS = {2: "half", 3: "a third", 4: "a quarter", 5: "a fifth", 6: "a sixth", 8: "an eighth", 10: "a tenth"}

# Sentence templates per story. "relative" stories introduce a new person, item or agent each
# step ({cur}, defined from {prev}; {prev2} the one before); "story" ones follow one {name}.
DOMAINS = {
    "people": dict(
        kind="count", chain="relative",
        start=["{cur} has {a} {item}."],
        add=["{cur} has {a} more {item} than {prev}.", "{cur} has {a} more than {prev}."],
        sub=["{cur} has {a} fewer {item} than {prev}.", "{cur} has {a} fewer than {prev}."],
        mul=["{cur} has {times} as many {item} as {prev}.", "{cur} has {times} as many as {prev}."],
        div=["{cur} has {part} as many {item} as {prev}."],
        ref=["{cur} has as many {item} as {prev} and {prev2} together.",
             "{cur} has as many as {prev} and {prev2} combined."],
        question=["How many {item} does {last} have?"]),
    "prices": dict(
        kind="money", chain="relative",
        start=["A {cur} costs {a}.", "At a market, a {cur} costs {a}."],
        add=["A {cur} costs {a} more than the {prev}.", "A {cur} is {a} more expensive than the {prev}."],
        sub=["A {cur} costs {a} less than the {prev}.", "A {cur} is {a} cheaper than the {prev}."],
        mul=["A {cur} costs {times} as much as the {prev}."],
        div=["A {cur} costs {part} as much as the {prev}.",
             "A box of {d} {cur}s costs the same as one {prev}."],
        ref=["A {cur} costs as much as the {prev} and the {prev2} together."],
        question=["How much does a {last} cost, in dollars?", "How many dollars does one {last} cost?"]),
    "items": dict(
        kind="count", chain="story",
        start=["{name} has {a} {item}.", "{name} starts the week with {a} {item}."],
        add=["{name} buys {a} more.", "{friend} gives {name} {a} more {item}.",
             "{name} finds {a} more {item}."],
        sub=["{name} gives {a} {item} to {friend}.", "{name} loses {a} of them.",
             "{name} trades away {a} {item}."],
        mul=["Then {name}'s collection grows to {times} its size.",
             "{name} gets enough new {item} to have {times} as many as before."],
        div=["{name} splits them into {d} equal piles and keeps one pile.",
             "{name} keeps only {part} of them and gives the rest away."],
        question=["How many {item} does {name} have now?", "How many {item} does {name} end up with?"]),
    "sharing": dict(
        kind="money", chain="story",
        start=["{name} has {a} in savings.", "{name} earns {a} mowing lawns."],
        add=["{name} earns {a} more.", "{friend} pays {name} back {a}.", "{name} receives {a} as a gift."],
        sub=["{name} spends {a} on {thing}.", "{name} pays {a} for {thing}."],
        mul=["{name} invests the money and ends up with {times} as much.",
             "A year later, {name}'s money has grown to {times} that amount."],
        div=["{name} splits the money equally among {d} people, {name} included, and keeps one share.",
             "{name} divides the money into {d} equal envelopes and keeps one envelope."],
        question=["How many dollars does {name} have now?",
                  "How much money, in dollars, does {name} have left?"]),
    "rates": dict(  # the last step (x time) is asked in the question
        kind="count", chain="rates",
        start=["The {cur} {verb} {a} {item} per {time}."],
        add=["The {cur} {verb} {a} more {item} per {time} than the {prev}."],
        sub=["The {cur} {verb} {a} fewer {item} per {time} than the {prev}."],
        mul=["The {cur} works {times} as fast as the {prev}."],
        div=["The {cur} works {part} as fast as the {prev}."],
        ref=["The {cur} {verb} as many {item} per {time} as the {prev} and the {prev2} together."],
        question=["How many {item} does the {last} {verb_base} in {a} {time}s?"]),
}

# ----------------------------------------------------------------------------- exact values


def chain_values(start: str, steps: list) -> list[Fraction]:
    """[value_0, ..., value_n] of a chain, exactly."""
    values = [Fraction(start)]
    for op, x in steps:
        y = values[int(x[1:])] if x.startswith("v") else Fraction(x)
        v = values[-1]
        values.append(v + y if op == "add" else v - y if op == "sub" else v * y if op == "mul" else v / y)
    return values


def exact_decimal(x: Fraction) -> str:
    """A terminating fraction as its shortest decimal: 37/4 -> '9.25', 12 -> '12'."""
    digits = 0
    while (x * 10**digits).denominator != 1:
        digits += 1
        assert digits <= 12, f"{x} is not a terminating decimal"
    if digits == 0:
        return str(x.numerator)
    n = x * 10**digits
    sign, n = ("-" if n < 0 else ""), abs(n.numerator)
    return f"{sign}{n // 10**digits}.{n % 10**digits:0{digits}d}"


def _money(cents: int) -> str:
    return f"${cents // 100}" if cents % 100 == 0 else f"${cents // 100}.{cents % 100:02d}"


def _decimal(units: int, kind: str) -> str:  # an operand as the chain stores it: '4.75', '12'
    return exact_decimal(Fraction(units, 100)) if kind == "money" else str(units)

# ----------------------------------------------------------------------------- drawing a chain


def _step(rng: random.Random, kind: str, v: int, earlier: int | None, can_ref: bool) -> tuple[str, int, int]:
    """One feasible step from value v (whole counts or cents): (op, operand, new value). The
    operand of a ref step is the earlier value; every choice keeps the value whole and in range."""
    money = kind == "money"
    top = MAX_CENTS if money else MAX_COUNT
    options = []
    add = rng.randrange(25, 1501, 25) if money else rng.randint(2, 40)
    if v + add <= top:
        options.append(("add", add, v + add))
    low = 25 if money else 1
    if v - low >= low:
        sub = rng.randrange(low, min(v - low, 2000 if money else 40) + 1, low)
        options.append(("sub", sub, v - sub))
    mul = rng.randint(2, 4 if money else 5)
    if v * mul <= top:
        options.append(("mul", mul, v * mul))
    divisors = [d for d in ((2, 3, 4, 5, 10) if money else (2, 3, 4, 5, 6, 8, 10))
                if v % d == 0 and v // d >= low]
    if divisors:
        d = rng.choice(divisors)
        options.append(("div", d, v // d))
    if can_ref and earlier is not None and v + earlier <= top and rng.random() < 0.5:
        options.append(("ref", earlier, v + earlier))  # half as often as an op with its own number
    return rng.choice(options)


def make_problem(rng: random.Random, num_ops: int, domain: str | None = None) -> dict:
    """One problem of `num_ops` operations: {question, answer, num_ops, domain, start, steps}."""
    domain = domain or rng.choice(sorted(DOMAINS))
    t = DOMAINS[domain]
    kind, chain = t["kind"], t["chain"]
    # the story's cast: new entities per step (relative), one person (story), ordinals (rates)
    agent, verb, verb_base, item, time = rng.choice(RATES)
    item = item if chain == "rates" else rng.choice(ITEMS)
    name, friend = rng.sample(NAMES, 2)
    cast = (rng.sample(NAMES, num_ops + 1) if domain == "people" else rng.sample(GOODS, num_ops + 1)
            if domain == "prices" else [f"{o} {agent}" for o in ORDINALS])
    fill = dict(item=item, name=name, friend=friend, thing=rng.choice(THINGS), verb=verb, verb_base=verb_base,
                time=time)
    fmt = _money if kind == "money" else str

    if kind == "money":
        v = rng.randrange(200, 6001, 25) if domain == "prices" else rng.randrange(2000, 30001, 50)
    else:
        v = rng.randint(4, 40) if chain == "rates" else rng.randint(6, 90)
    units, steps = [v], []
    sentences = [rng.choice(t["start"]).format(a=fmt(v), cur=cast[0], **fill)]
    relative_ops = num_ops - 1 if chain == "rates" else num_ops
    for k in range(relative_ops):
        earlier = units[k - 1] if k >= 1 else None
        op, x, v = _step(rng, kind, units[-1], earlier, can_ref="ref" in t)
        words = dict(a=fmt(x), d=x, times=TIMES.get(x, f"{x} times"), part=PARTS.get(x, ""),
                     cur=cast[k + 1], prev=cast[k], prev2=cast[k - 1] if k else "", **fill)
        sentences.append(rng.choice(t[op]).format(**words))
        # a ref step adds value k-1; add/sub operands are amounts (cents as dollars), mul/div plain factors
        operand = f"v{k - 1}" if op == "ref" else _decimal(x, kind) if op in ("add", "sub") else str(x)
        steps.append(["add" if op == "ref" else op, operand])
        units.append(v)
    if chain == "rates":  # the last operation: how much the last agent makes in some time
        x = rng.randint(2, 12)
        question = rng.choice(t["question"]).format(a=x, last=cast[relative_ops], **fill)
        steps.append(["mul", str(x)])
        units.append(units[-1] * x)
    else:
        question = rng.choice(t["question"]).format(last=cast[relative_ops], **fill)
    start = _decimal(units[0], kind)
    value = chain_values(start, steps)[-1]
    assert value == Fraction(units[-1], 100 if kind == "money" else 1), (steps, units)
    return {"question": " ".join(sentences + [question]), "answer": exact_decimal(value), "num_ops": num_ops,
            "domain": domain, "start": start, "steps": steps}

# ----------------------------------------------------------------------------- splits


def route(text: str) -> str:
    """The split a problem text belongs to, by its hash: 10% test, 10% validation, 80% train."""
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % 10
    return "test" if h == 0 else "validation" if h == 1 else "train"


def generate(split: str, per_ops: int, seed: int = 0, ops: tuple = OP_COUNTS) -> list[dict]:
    """per_ops distinct problems of each operation count in `ops`, all of `split`. Round-robin
    over the counts ([2, 3, ..., 8, 2, 3, ...]), so any prefix (an eval_limit) mixes them all."""
    assert split in SPLITS, f"{split=}: one of {SPLITS}"
    columns = []
    for n in ops:
        rng = random.Random(f"multistep-{split}-{seed}-{n}")   # str seeds hash the same in every process
        got, seen = [], set()
        for _ in range(200 * per_ops + 1000):   # ~1 in 10 lands in a small split: ample
            if len(got) == per_ops:
                break
            p = make_problem(rng, n)
            if p["question"] not in seen and route(p["question"]) == split:
                seen.add(p["question"])
                got.append({**p, "split": split})
        assert len(got) == per_ops, f"only {len(got)} distinct {n}-operation problems for {split}"
        columns.append(got)
    return [p for row in zip(*columns) for p in row]


def test_set(seed: int = 0) -> list[dict]:
    """The reference's "fresh multi-step" benchmark: 700 problems, 100 per operation count 2..8."""
    return generate("test", 100, seed)


def by_ops(examples: list[dict]) -> dict[int, list[int]]:
    """Operation count -> indices of its examples (rows without `num_ops` are left out)."""
    out = {}
    for i, ex in enumerate(examples):
        if ex.get("num_ops") is not None:
            out.setdefault(int(ex["num_ops"]), []).append(i)
    return dict(sorted(out.items()))
