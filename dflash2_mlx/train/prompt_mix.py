"""Training prompts that match the work measured: chat, later chat turns, code and maths.

`dflash2 bench` runs GSM8K, MATH-500, HumanEval, MBPP and MT-Bench; four of the five are code or
maths, so ShareGPT first turns alone teach the drafter the wrong distribution. The mix adds:

* `turns`: later ShareGPT user turns with the conversation before them (the history's
  assistant turns are ShareGPT's own text; the target answers the last user turn);
* `code`: tasks built from the Python standard library (write a function with a given
  signature and purpose, explain, test, annotate or review a real stdlib function) and from
  task templates;
* `math`: templated arithmetic, algebra and multi-step word problems with random numbers.

Nothing comes from benchmark items, and every prompt passes the 10-gram `EvalFilter`.
"""

from __future__ import annotations

import ast
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .corpus import EvalFilter, heldout_prompts, sharegpt_conversations, training_prompts

SOURCES = ("sharegpt", "turns", "code", "math")
DEFAULT_SHARES = {"sharegpt": 0.45, "turns": 0.15, "code": 0.2, "math": 0.2}


@dataclass(frozen=True)
class PromptItem:
    """One prompt: where it came from and its chat messages (ending with a user turn)."""

    source: str
    messages: tuple[dict, ...]


def parse_shares(text: str) -> dict[str, float]:
    """`sharegpt=0.45,turns=0.15,code=0.2,math=0.2` -> shares summing to 1."""
    shares = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in SOURCES:
            raise ValueError(f"unknown prompt source {name!r}; expected some of {', '.join(SOURCES)}")
        try:
            shares[name] = float(value)
        except ValueError:
            raise ValueError(f"share of {name!r} must be a number, got {value!r}") from None
        if shares[name] < 0:
            raise ValueError(f"share of {name!r} must be >= 0, got {shares[name]}")
    total = sum(shares.values())
    if total <= 0:
        raise ValueError(f"prompt shares must sum to more than 0, got {text!r}")
    return {k: v / total for k, v in shares.items()}


def prompt_mix(n: int, shares: dict[str, float], seed: int = 0, heldout: bool = False,
               eval_filter: EvalFilter | None = None, max_chars: int = 1500) -> list[PromptItem]:
    """`n` prompts drawn from the sources in proportion to `shares`, interleaved by a seeded shuffle.

    `heldout` takes ShareGPT prompts from the end of the conversation order (training takes
    them from the front) and generates the synthetic ones from another seed stream.
    """
    flt = eval_filter or EvalFilter.from_suites()
    counts = _split(n, shares)
    convs = sharegpt_conversations(seed) if counts.get("sharegpt") or counts.get("turns") else []
    stream = seed * 2 + (1 if heldout else 0)
    items: list[PromptItem] = []
    if counts.get("sharegpt"):
        pick = heldout_prompts if heldout else training_prompts
        texts = pick(counts["sharegpt"], seed=seed, max_chars=max_chars, eval_filter=flt, convs=convs)
        items += [PromptItem("sharegpt", ({"role": "user", "content": t},)) for t in texts]
    if counts.get("turns"):
        ordered = list(reversed(convs)) if heldout else convs
        items += _take(later_turns(ordered, max_chars), counts["turns"], flt)
    if counts.get("code"):
        items += _take(code_prompts(random.Random(stream * 7 + 3)), counts["code"], flt)
    if counts.get("math"):
        items += _take(math_prompts(random.Random(stream * 7 + 5)), counts["math"], flt)
    random.Random(seed + 11).shuffle(items)
    return items


def _split(n: int, shares: dict[str, float]) -> dict[str, int]:
    counts = {k: int(n * v) for k, v in shares.items()}
    for k in sorted(shares, key=lambda k: -(n * shares[k] - counts[k]))[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def _take(pool: Iterator[PromptItem], want: int, flt: EvalFilter) -> list[PromptItem]:
    out, seen = [], set()
    for item in pool:
        text = item.messages[-1]["content"]
        if text in seen or not flt.keep(list(item.messages)):
            continue
        seen.add(text)
        out.append(item)
        if len(out) == want:
            break
    return out


# -- later ShareGPT turns --------------------------------------------------------------


def later_turns(convs: list[list[dict]], max_chars: int, max_history_turns: int = 2,
                history_chars: int = 500) -> Iterator[PromptItem]:
    """Each conversation's second and later user turns, with up to `max_history_turns` turns
    before them (from a user turn on), each cut to `history_chars` so the history fits a prompt."""
    for conv in convs:
        for i in range(2, len(conv), 2):
            if conv[i]["role"] != "user" or len(conv[i]["content"]) > max_chars:
                continue
            start = max(0, i - max_history_turns)
            start += start % 2  # keep user/assistant alternation from a user turn
            history = [m | {"content": _cut(m["content"], history_chars)} for m in conv[start:i]]
            yield PromptItem("turns", tuple(history + [conv[i]]))


def _cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars].rsplit(" ", 1)[0] + " ..."


# -- code ------------------------------------------------------------------------------


def stdlib_functions(root: Path | None = None) -> list[tuple[str, str, str, str]]:
    """(module, signature, first docstring sentence, source) of documented top-level stdlib functions."""
    root = Path(root or Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}")
    found = []
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            src = ast.get_source_segment(text, node) or ""
            if not doc or not 80 <= len(src) <= 1500:
                continue
            sentence = " ".join(doc.strip().split("\n\n")[0].split())
            if 15 <= len(sentence) <= 240:
                found.append((path.stem, f"{node.name}({ast.unparse(node.args)})", sentence, src))
    return found


_CODE_ASKS = (
    "Write a Python function `{sig}` that does the following: {doc}",
    "Implement `{sig}` in Python. Purpose: {doc} Include a short docstring.",
    "In Python, write `{sig}`. {doc} Then show one example call.",
    "Explain step by step what this Python function from the `{mod}` module does:\n```python\n{src}\n```",
    "Write pytest unit tests for the following function:\n```python\n{src}\n```",
    "Add type hints to this function and explain any edge cases it handles:\n```python\n{src}\n```",
    "Review this Python code and suggest improvements:\n```python\n{src}\n```",
    "Rewrite this function so it is easier to read, keeping its behaviour:\n```python\n{src}\n```",
)

_TASKS = (
    "returns the second largest number in a list", "counts how many words in a sentence start with a vowel",
    "merges two sorted lists into one sorted list", "checks whether a string is a valid IPv4 address",
    "groups a list of words by their first letter into a dictionary", "returns the running average of a list",
    "flattens a nested list of arbitrary depth", "removes duplicate items from a list while keeping their order",
    "converts a Roman numeral string to an integer", "finds the longest common prefix of a list of strings",
    "returns the n-th Fibonacci number using iteration", "rotates a matrix by 90 degrees clockwise",
    "parses a CSV line that may contain quoted fields", "returns the most frequent character in a string",
    "checks whether two strings are anagrams of each other", "computes the greatest common divisor of a list",
    "converts a temperature from Celsius to Fahrenheit and back", "validates that brackets in a string are balanced",
    "splits a list into chunks of a given size", "returns all prime numbers below a limit",
    "counts the lines, words and characters of a text file", "formats a number of seconds as hours:minutes:seconds",
    "finds pairs of numbers in a list that add up to a target", "capitalizes the first letter of every sentence",
    "computes the median of a list without sorting it in place", "turns a dictionary into a query string",
    "returns the binary representation of a positive integer",
    "reads a JSON file and returns the keys at the top level",
    "implements a simple stack class with push, pop and peek", "implements a queue using two stacks",
    "computes the factorial of a number recursively", "checks whether a year is a leap year",
    "finds the index of a value in a sorted list with binary search", "transposes a list of lists",
    "counts the frequency of each word in a paragraph", "returns the difference in days between two dates",
    "compresses a string with run-length encoding", "checks whether a number is a perfect square",
)
_TASK_ASKS = (
    "Write a Python function that {task}.", "Can you write Python code that {task}? Explain how it works.",
    "I need a function that {task}. Please write it in Python with comments.",
    "Write a JavaScript function that {task}.", "Write a Python function that {task}, and add a few test cases.",
    "Show me an efficient Python solution that {task}, and state its time complexity.",
)


def code_prompts(rng: random.Random) -> Iterator[PromptItem]:
    """An endless shuffled stream of code tasks (stdlib-derived and templated)."""
    funcs = stdlib_functions()
    while True:
        if funcs and rng.random() < 0.6:
            mod, sig, doc, src = rng.choice(funcs)
            text = rng.choice(_CODE_ASKS).format(sig=sig, doc=doc, mod=mod, src=src)
        else:
            text = rng.choice(_TASK_ASKS).format(task=rng.choice(_TASKS))
        yield PromptItem("code", ({"role": "user", "content": text},))


# -- maths -----------------------------------------------------------------------------

_NAMES = ("Maya", "Liam", "Aisha", "Carlos", "Yuki", "Omar", "Elena", "Tom", "Priya", "Jonas", "Fatima", "Leo")
_ITEMS = ("apples", "stickers", "marbles", "books", "cookies", "pencils", "cards", "stamps", "shells", "coins")
_SUFFIXES = ("", " Think step by step.", " Show your work.", " Explain your reasoning, then give the final answer.",
             " Work it out carefully and write the answer on the last line.")


def _word_problem(rng: random.Random) -> str:
    a, b, c, d = (rng.randint(2, 60) for _ in range(4))
    n1, n2 = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    price, hours, speed = rng.randint(2, 25), rng.randint(2, 9), rng.randint(20, 90)
    templates = (
        f"{n1} has {a} {item}. {n1} buys {b} packs with {c} {item} in each pack and then gives {d} {item} to "
        f"{n2}. How many {item} does {n1} have now?",
        f"A shop sells {item} for ${price} each. {n1} buys {a} of them and pays with a ${a * price + b} bill. "
        f"How much change does {n1} get?",
        f"{n1} drives at {speed} km per hour for {hours} hours, then at {speed - 10} km per hour for {b % 5 + 1} "
        f"more hours. How far does {n1} drive in total?",
        f"{n1} is {a} years old. {n2} is {b % 20 + 2} years older than {n1}. In {c % 15 + 1} years, what will be "
        f"the sum of their ages?",
        f"A class has {a + 10} students. {c % 50 + 10}% of them walk to school and the rest take the bus. "
        f"How many students take the bus? Round to a whole number.",
        f"{n1} saves ${price} every week. {n2} starts with ${a * 3} and saves ${max(1, price - 3)} every week. "
        f"After how many weeks will {n1} have saved more than {n2}?",
        f"A recipe needs {b % 6 + 2} cups of flour for {c % 8 + 2} servings. How many cups are needed for "
        f"{a % 30 + 5} servings?",
        f"A rectangle is {a} cm long and {b} cm wide. What is its area, and what is its perimeter?",
        f"{n1} read {a} pages on Monday and twice as many on Tuesday. The book has {a * 3 + b * 5} pages. "
        f"How many pages are left?",
        f"A tank holds {a * 10} liters. It leaks {b % 9 + 1} liters per hour and is refilled with {c % 5 + 1} "
        f"liters per hour. How many hours until it is empty?",
    )
    return rng.choice(templates)


def _exercise(rng: random.Random) -> str:
    a, b, c = rng.randint(11, 999), rng.randint(2, 99), rng.randint(1, 500)
    x = rng.randint(-12, 25)
    k = rng.randint(2, 9)
    templates = (
        f"What is {a} × {b}?", f"Compute {a} + {b * c} - {c}.", f"What is {b}% of {a * 4}?",
        f"Simplify the fraction {b * k}/{c * k}.", f"Solve for x: {k}x + {b} = {k * x + b}.",
        f"What is the remainder when {a * b + c} is divided by {b}?", f"Convert {a} minutes to hours and minutes.",
        f"Find the least common multiple of {b} and {c % 60 + 2}.", f"Expand (x + {k})(x - {b % 12 + 1}).",
        f"What is the sum of the integers from 1 to {a}?", f"Evaluate {k}^{b % 6 + 2}.",
        f"Solve the system: x + y = {x + c % 20}, x - y = {x - c % 20}.",
        f"Find the derivative of {k}x^{b % 5 + 2} + {c}x.", f"What is the mean of {a}, {b}, {c} and {x + 30}?",
        f"A triangle has sides {b % 20 + 3}, {b % 20 + 4} and {b % 20 + 5}. Is it a right triangle? Explain.",
        f"How many ways can {k} people sit in a row of {k} chairs?",
        f"Write {a / 8:.3f} as a fraction in lowest terms.",
    )
    return rng.choice(templates)


def math_prompts(rng: random.Random) -> Iterator[PromptItem]:
    """An endless stream of templated maths exercises and word problems with random numbers."""
    while True:
        text = (_word_problem if rng.random() < 0.6 else _exercise)(rng) + rng.choice(_SUFFIXES)
        yield PromptItem("math", ({"role": "user", "content": text},))


def prompt_ids(tokenizer, messages: tuple[dict, ...], max_prompt_tokens: int) -> list[int] | None:
    """Chat-template ids of `messages` with the generation prompt; the oldest turn pairs are
    dropped until it fits, and a lone user turn is cut. None if it cannot fit."""
    messages = list(messages)
    while True:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if len(ids) <= max_prompt_tokens:
            return ids
        if len(messages) >= 3:
            messages = messages[2:]
            continue
        user = tokenizer.encode(messages[-1]["content"], add_special_tokens=False)
        over = len(ids) - max_prompt_tokens
        if over >= len(user):
            return None
        messages = [messages[-1] | {"content": tokenizer.decode(user[: len(user) - over - 2])}]
