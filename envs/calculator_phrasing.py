"""How a calculator question is worded: two disjoint phrasebooks, one for training, one held out.

A model trained on one generator's templates can learn the templates instead of the task:
measured on questions people wrote (other verbs, word orders and sentence forms), the CPU
recipe's GRPO gain over its warm-start vanished. So the words come in books that share no
template: TRAIN words the warm-start's questions, HELDOUT only eval questions, and an eval on
HELDOUT measures the calculator skill on phrasings the model never saw. RL, a third, words
questions that only GRPO sees.

Each book has families, the shape of the sentence:
- noun     a question about a noun phrase: "What is the product of 12 and the sum of 3 and 4?"
- verb     (TRAIN) an imperative: "Multiply 12 by the sum of 3 and 4."
- gerund   (HELDOUT) a gerund: "What would multiplying 12 by the result of adding 3 and 4 give?"
- steps    a chain of steps on a running value (trees whose left spine holds the nesting)
- symbols  the infix expression itself: "12 * (3 + 4)" in TRAIN, "12 × (3 + 4)" in HELDOUT

Nesting is delimited the same way in every template: a noun phrase opens with its own words
("the sum of", "the result of adding"), a comma closes a nested first operand, and the short
infix forms ("12 times 7") only join two plain numbers in a slot that a comma or the end of the
sentence closes, so no precedence has to be guessed.
"""
import random

TRAIN = {
    "prefix": {
        "add": ["the sum of {a} and {b}", "the total of {a} and {b}"],
        "subtract": ["the difference between {a} and {b}"],
        "multiply": ["the product of {a} and {b}"],
        "divide": ["the quotient of {a} and {b}", "the ratio of {a} to {b}"],
    },
    "infix": {
        "add": ["{a} plus {b}"],
        "subtract": ["{a} minus {b}", "{b} subtracted from {a}"],
        "multiply": ["{a} times {b}", "{a} multiplied by {b}"],
        "divide": ["{a} divided by {b}"],
    },
    "verb": {  # imperative forms of the top operation
        "add": ["add {a} to {b}", "add {a} and {b}"],
        "subtract": ["subtract {b} from {a}", "take {b} away from {a}"],
        "multiply": ["multiply {a} by {b}", "multiply {a} and {b}"],
        "divide": ["divide {a} by {b}", "divide {a} into {b} equal parts"],
    },
    "step": {"add": "add {b}", "subtract": "subtract {b}", "multiply": "multiply by {b}", "divide": "divide by {b}"},
    "then": ", then ",
    "ask_noun": ["What is {p}?", "What's {p}?", "Calculate {p}.", "Compute {p}.", "Find {p}.",
                 "How much is {p}?", "Can you work out {p}?", "Please evaluate {p}.", "I need {p}.",
                 "Tell me {p}.", "Determine {p}.", "What number is {p}?", "Work out {p}.",
                 "Quick question: what is {p}?", "What is the value of {p}?"],
    "ask_verb": ["What do you get when you {v}?", "If you {v}, what do you get?",
                 "What is the result if you {v}?", "Please {v}.", "{V}. What's the answer?",
                 "{V} and tell me the answer.", "Suppose you {v}. What number do you get?"],
    "ask_steps": ["Start with {base}. {Steps}. What is the result?",
                  "Take {base}, {steps}. What do you end up with?",
                  "Begin with {base}, {steps}, and tell me the result."],
    "ask_symbols": ["Evaluate {e}.", "What is {e}?", "Calculate {e} for me.", "{e} = ?",
                    "Work out the value of {e}."],
    "symbols": {"*": "*", "/": "/"},
}

HELDOUT = {
    "prefix": {
        "add": ["the result of adding {a} and {b}", "the combined total of {a} and {b}"],
        "subtract": ["the result of subtracting {b} from {a}", "the amount by which {a} exceeds {b}"],
        "multiply": ["the result of multiplying {a} by {b}", "the product obtained from {a} and {b}"],
        "divide": ["the result of dividing {a} by {b}", "the equal share of {a} among {b}"],
    },
    "infix": {
        "add": ["{a} added to {b}", "{a} more than {b}"],
        "subtract": ["{a} less {b}", "{b} taken away from {a}"],
        "multiply": ["{a} multiplied with {b}", "{a} lots of {b}"],
        "divide": ["{a} over {b}", "{a} split by {b}"],
    },
    "gerund": {  # "What do you get by ...": the top operation as a gerund
        "add": ["adding {a} and {b}", "adding {b} to {a}"],
        "subtract": ["subtracting {b} from {a}", "taking {b} away from {a}"],
        "multiply": ["multiplying {a} by {b}"],
        "divide": ["dividing {a} by {b}", "splitting {a} into {b} equal parts"],
    },
    "step": {"add": "increase it by {b}", "subtract": "reduce it by {b}",
             "multiply": "scale it up by a factor of {b}", "divide": "divide it evenly by {b}"},
    "then": "; after that, ",
    "ask_noun": ["I'd like to know {p}.", "Could you figure out {p}?", "Give me {p}, please.",
                 "What does {p} come to?", "Any idea what {p} is?", "So what's {p}?",
                 "Help me get {p}."],
    "ask_gerund": ["What would {g} give?", "What comes out of {g}?", "How much results from {g}?",
                   "Try {g}. What's the outcome?"],
    "ask_steps": ["Begin at {base}; {steps}. Where do you end up?",
                  "The starting value is {base}. {Steps}. What's the final value?"],
    "ask_symbols": ["Solve {e}.", "{e} equals what?", "Quick one: {e}", "Result of {e}?"],
    "symbols": {"*": "×", "/": "÷"},
}

# A third book, for the GRPO phase only: the warm-start never reads it and the eval never uses it,
# so GRPO meets wordings the warm-start did not drill, as it would meet people's questions. It
# shares no template and no distinctive wording with either book (tests/test_calculator.py).
RL = {
    "prefix": {
        "add": ["the addition of {a} and {b}", "the amount from combining {a} with {b}"],
        "subtract": ["the subtraction of {b} from {a}", "what is left when {b} is removed from {a}"],
        "multiply": ["the multiplication of {a} by {b}", "the number of items in {a} groups of {b}"],
        "divide": ["the division of {a} by {b}", "the size of each piece when {a} is cut into {b} pieces"],
    },
    "infix": {
        "add": ["{a} together with {b}"],
        "subtract": ["{a} take away {b}", "{a} with {b} removed"],
        "multiply": ["{a} groups of {b}"],
        "divide": ["{a} per {b}", "{a} cut into {b} pieces"],
    },
    "verb": {
        "add": ["sum {a} and {b}", "combine {a} with {b}"],
        "subtract": ["deduct {b} from {a}", "remove {b} from {a}"],
        "multiply": ["multiply together {a} and {b}"],
        "divide": ["share {a} among {b}", "cut {a} into {b} pieces"],
    },
    "step": {"add": "add on {b}", "subtract": "take off {b}", "multiply": "times it by {b}",
             "divide": "share it among {b}"},
    "then": " and next, ",
    "ask_noun": ["Find the value of {p}.", "Show me {p}.", "How large is {p}?", "Report {p}.",
                 "I'm looking for {p}.", "Do you know {p}?"],
    "ask_verb": ["I want you to {v}.", "Would you {v} for me?", "Go ahead and {v}.",
                 "What happens when you {v}?"],
    "ask_steps": ["Your starting number is {base}. {Steps}. What number do you have now?",
                  "Open with {base}, {steps}. Report the final number."],
    "ask_symbols": ["Compute: {e}", "Give the value of {e}.", "{e} is how much?"],
    "symbols": {"*": "x", "/": "/"},
}

BOOKS = {"train": TRAIN, "heldout": HELDOUT, "rl": RL}


def templates(book: dict) -> set[str]:
    """Every template string of a book (the tests check that the books share none)."""
    out = set()
    for value in book.values():
        items = value.values() if isinstance(value, dict) else [value] if isinstance(value, str) else value
        for item in items:
            out.update([item] if isinstance(item, str) else item)
    return out - {"*", "/"}


def _leaf(tree) -> bool:
    return isinstance(tree, str)


def _count(tree) -> int:
    return 0 if _leaf(tree) else 1 + _count(tree[1]) + _count(tree[2])


def _fill(rng: random.Random, book: dict, template: str, left, right) -> str:
    """A two-operand template with its operands worded; the one written first gets a closing
    comma when nested (the one written last is closed by what follows the template)."""
    a_first = template.index("{a}") < template.index("{b}")
    first, last = (left, right) if a_first else (right, left)
    p_first = _phrase(rng, book, first, infix_ok=True) + ("" if _leaf(first) else ",")
    p_last = _phrase(rng, book, last, infix_ok=False)
    a, b = (p_first, p_last) if a_first else (p_last, p_first)
    return template.format(a=a, b=b)


def _phrase(rng: random.Random, book: dict, tree, infix_ok: bool) -> str:
    if _leaf(tree):
        return tree
    op, left, right = tree
    if infix_ok and _leaf(left) and _leaf(right) and rng.random() < 0.5:
        return rng.choice(book["infix"][op]).format(a=left, b=right)
    return _fill(rng, book, rng.choice(book["prefix"][op]), left, right)


def _chainable(tree) -> bool:
    """A left spine of 2+ operations whose right operands have at most one operation each:
    then no operand phrase holds a comma, and commas can separate the steps."""
    if _leaf(tree[1]):
        return False
    while not _leaf(tree):
        if _count(tree[2]) > 1:
            return False
        tree = tree[1]
    return True


def _steps(rng: random.Random, book: dict, tree) -> str:
    """'Start with A times B. Subtract C, then divide by D.' for a left-leaning tree."""
    spine = []
    while not _leaf(tree[1]):
        spine.append(tree)
        tree = tree[1]
    steps = [book["step"][op].format(b=_phrase(rng, book, right, infix_ok=False)) for op, _, right in reversed(spine)]
    steps = ", ".join(steps[:-1]) + (book["then"] if len(steps) > 1 else "") + steps[-1]
    base = _phrase(rng, book, tree, infix_ok=True)
    return rng.choice(book["ask_steps"]).format(base=base, Base=base[0].upper() + base[1:], steps=steps,
                                                Steps=steps[0].upper() + steps[1:])


def question_text(rng: random.Random, tree, infix: str, book_name: str = "train") -> tuple[str, str]:
    """(question, family) for an expression tree, worded from one book. `infix` is the tree's
    plain infix text (with * and /), which the symbols family shows."""
    book = BOOKS[book_name]
    if _leaf(tree):
        return f"What is {tree}?", "noun"
    style = rng.random()
    if style < 0.15:
        e = infix.replace("*", book["symbols"]["*"]).replace("/", book["symbols"]["/"])
        return rng.choice(book["ask_symbols"]).format(e=e), "symbols"
    if style < 0.45 and _chainable(tree):
        return _steps(rng, book, tree), "steps"
    if style < 0.65:
        kind = "verb" if "verb" in book else "gerund"
        v = _fill(rng, book, rng.choice(book[kind][tree[0]]), tree[1], tree[2])
        frame = rng.choice(book[f"ask_{kind}"])
        q = frame.format(v=v, V=v[0].upper() + v[1:]) if kind == "verb" else frame.format(g=v)
        return q[0].upper() + q[1:], kind
    q = rng.choice(book["ask_noun"]).format(p=_phrase(rng, book, tree, infix_ok=True))
    return q[0].upper() + q[1:], "noun"
