"""Arithmetic word problems: one problem per episode, one answer, reward 1 when it is right (Gymformer-style CoT env).

Rules: each episode shows one small word problem, e.g. "Mia has 3 apples and buys 4 more. How many apples does she
have now?". The agent answers once with a number in 0..`max_answer` (action i is the answer i); the reward is 1 for
the right number, else 0, and the episode terminates after that one step.

Problems come from the `TEMPLATES` below, filled with names, items and numbers 2..`max_answer` such that every
running total and the answer lie in 0..`max_answer` (the answer is drawn uniformly among those a template can
reach). `difficulty=1` uses the one-operation templates (add, take away, twice as many, equal groups);
`difficulty=2` draws uniformly from all of them, half of which need two operations.

Splits: the held-out test set (`test_problems`) is a fixed list of `test_size` distinct problems drawn from a fixed
seed; `split="test"` resets to one of them uniformly at random (or to `options={"index": i}`). `split="train"` draws
problems with the env's `np_random` and redraws any whose text is a test problem's. Both are deterministic per
arguments and seed.

Observation: the problem text (a `Text` space); it is the whole state. Actions: `Discrete(max_answer + 1)`.

`evaluate` computes the exact accuracy of a deterministic policy over the test set (each problem weighs
1/`test_size`), beside uniform random play (1/(max_answer + 1) exactly: every answer is one of the actions; 1/21 =
0.047619 by default), the optimal policy (1.0) and always answering the most common test answer ("majority").
`expert` solves any problem text by reading it back with the same templates, so it works on training problems too.
"""

from __future__ import annotations

import collections
import functools
import itertools
import re
import string
from collections.abc import Callable
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np

from ..agent import Agent
from .suite import Decide, Game, Transition, play_out, summary


class Template(NamedTuple):
    text: str  # fields: {name}, {other} (a second person), {pronoun} (of name), {items}, and the numbers {a} {b} {c}
    steps: int  # arithmetic operations to reach the answer
    totals: Callable[..., tuple[int, ...]]  # running totals of the numbers (a, b[, c]), the answer last


TEMPLATES = (
    Template("{name} has {a} {items} and buys {b} more. How many {items} does {pronoun} have now?", 1,
             lambda a, b: (a + b,)),
    Template("{name} has {a} {items} and gives {b} away. How many {items} does {pronoun} have left?", 1,
             lambda a, b: (a - b,)),
    Template("{name} has {a} {items}. {other} has twice as many. How many {items} does {other} have?", 1,
             lambda a: (2 * a,)),
    Template("{name} has {a} bags with {b} {items} in each. How many {items} does {pronoun} have?", 1,
             lambda a, b: (a * b,)),
    Template("{name} has {a} {items}, buys {b} more and gives {c} away. How many {items} does {pronoun} have now?", 2,
             lambda a, b, c: (a + b, a + b - c)),
    Template("{name} has {a} {items}, gives {b} away and finds {c} more. How many {items} does {pronoun} have now?", 2,
             lambda a, b, c: (a - b, a - b + c)),
    Template("{name} has {a} {items}. {other} has {b} more than {name}. How many {items} do they have together?", 2,
             lambda a, b: (a + b, 2 * a + b)),
    Template("{name} has {a} {items}. {other} has twice as many but loses {b}. How many {items} does {other} have?", 2,
             lambda a, b: (2 * a, 2 * a - b)),
)  # fmt: skip
PEOPLE = (("Mia", "she"), ("Tom", "he"), ("Ana", "she"), ("Ben", "he"), ("Lily", "she"), ("Sam", "he"),
          ("Zoe", "she"), ("Leo", "he"))  # fmt: skip
ITEMS = ("apples", "pears", "cookies", "marbles", "stickers", "pencils", "cards", "shells")
CHARSET = string.ascii_letters + string.digits + " .,?"
SPLITS = ("train", "test")
TEST_SEED = 20240  # the held-out problems are drawn from this seed
MAX_ANSWERS = (6, 50)  # every template fits 6 (2a + b with a, b >= 2); 50 keeps enumerating the numbers fast
MAX_TEST_SIZE = 1000


def check_arguments(difficulty: int, split: str, max_answer: int, test_size: int) -> None:
    """Raise ValueError naming the first argument out of range (see `ArithmeticEnv`)."""
    if not isinstance(difficulty, int) or difficulty not in (1, 2):
        raise ValueError(f"`difficulty` should be 1 or 2. Received {difficulty!r}.")
    if split not in SPLITS:
        raise ValueError(f"`split` should be one of {', '.join(SPLITS)}. Received {split!r}.")
    low, high = MAX_ANSWERS
    if not isinstance(max_answer, int) or isinstance(max_answer, bool) or not low <= max_answer <= high:
        raise ValueError(f"`max_answer` should be an integer in [{low}, {high}]. Received {max_answer!r}.")
    if not isinstance(test_size, int) or isinstance(test_size, bool) or not 1 <= test_size <= MAX_TEST_SIZE:
        raise ValueError(f"`test_size` should be an integer in [1, {MAX_TEST_SIZE}]. Received {test_size!r}.")


# ---- the dynamics: drawing, solving and grading problems --------------------------------------------------------
def _fields(template: Template) -> list[str]:
    return [field for _, field, _, _ in string.Formatter().parse(template.text) if field is not None]


@functools.lru_cache(maxsize=64)
def _numbers(template: Template, max_answer: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Every choice of a template's numbers (each 2..max_answer, every running total in 0..max_answer), grouped by
    answer: one group per reachable answer, in increasing order."""
    arity = len({field for field in _fields(template) if field in "abc"})
    groups: dict[int, list[tuple[int, ...]]] = {}
    for numbers in itertools.product(range(2, max_answer + 1), repeat=arity):
        totals = template.totals(*numbers)
        if all(0 <= total <= max_answer for total in totals):
            groups.setdefault(totals[-1], []).append(numbers)
    return tuple(tuple(groups[answer]) for answer in sorted(groups))


def draw_problem(rng: np.random.Generator, difficulty: int = 1, max_answer: int = 20) -> tuple[str, int]:
    """One problem (text, answer) drawn with `rng`.

    A template of at most `difficulty` steps, two different people and an item, uniformly; then an answer uniformly
    among those the template can reach, and numbers uniformly among those giving it (uniform numbers would make
    sums pile up near `max_answer` and differences near 0).
    """
    templates = [t for t in TEMPLATES if t.steps <= difficulty]
    template = templates[int(rng.integers(len(templates)))]
    first, second = rng.choice(len(PEOPLE), size=2, replace=False)
    (name, pronoun), other = PEOPLE[first], PEOPLE[second][0]
    items = ITEMS[int(rng.integers(len(ITEMS)))]
    groups = _numbers(template, max_answer)
    group = groups[int(rng.integers(len(groups)))]
    numbers = group[int(rng.integers(len(group)))]
    named = dict(zip("abc", numbers, strict=False))  # one- and two-number templates leave out c (and b)
    text = template.text.format(name=name, other=other, pronoun=pronoun, items=items, **named)
    return text, template.totals(*numbers)[-1]


@functools.lru_cache(maxsize=32)
def _test_set(difficulty: int, max_answer: int, test_size: int) -> tuple[tuple[str, int], ...]:
    check_arguments(difficulty, "test", max_answer, test_size)
    rng = np.random.default_rng(TEST_SEED)
    problems: dict[str, int] = {}
    while len(problems) < test_size:
        text, answer = draw_problem(rng, difficulty, max_answer)
        problems.setdefault(text, answer)
    return tuple(problems.items())


def test_problems(difficulty: int = 1, max_answer: int = 20, test_size: int = 100) -> list[tuple[str, int]]:
    """The held-out test set: `test_size` distinct (text, answer) problems drawn from `TEST_SEED`.

    The draw is cached per arguments; each call returns a fresh list, so callers may change it.

    Raises:
        ValueError: an argument is out of range (see `ArithmeticEnv`).
    """
    return list(_test_set(difficulty, max_answer, test_size))


test_problems.__test__ = False  # not a pytest test, whatever imports it


def draw_training_problem(rng: np.random.Generator, difficulty: int, max_answer: int, test_size: int) -> tuple:
    """A problem drawn with `rng`, redrawn while its text is one of the test problems'."""
    held_out = dict(_test_set(difficulty, max_answer, test_size))
    while True:
        problem = draw_problem(rng, difficulty, max_answer)
        if problem[0] not in held_out:
            return problem


def _pattern(template: Template) -> re.Pattern:
    """A regex that reads a template's text back: names, pronoun and items as alternatives, numbers as groups."""
    choices = {
        "name": "|".join(name for name, _ in PEOPLE),
        "other": "|".join(name for name, _ in PEOPLE),
        "pronoun": "she|he",
        "items": "|".join(ITEMS),
        **dict.fromkeys("abc", r"\d+"),
    }
    parts, seen = [], set()
    for literal, field, _, _ in string.Formatter().parse(template.text):
        parts.append(re.escape(literal))
        if field is not None:
            parts.append(f"(?P={field})" if field in seen else f"(?P<{field}>{choices[field]})")
            seen.add(field)
    return re.compile("".join(parts))


_PATTERNS = tuple((template, _pattern(template)) for template in TEMPLATES)


def parse_problem(text: str) -> tuple[Template, tuple[int, ...]]:
    """The template and numbers (a, b[, c]) of a problem text.

    Raises:
        ValueError: the text is not one of the `TEMPLATES`.
    """
    for template, pattern in _PATTERNS:
        match = pattern.fullmatch(text)
        if match:
            numbers = match.groupdict()
            return template, tuple(int(numbers[key]) for key in "abc" if key in numbers)
    raise ValueError(f"The text is not an arithmetic problem of this env. Received {text!r}.")


def solve(text: str) -> int:
    """The answer to a problem text, computed from the numbers it states."""
    template, numbers = parse_problem(text)
    return template.totals(*numbers)[-1]


def grade(answer: int, action: Any, max_answer: int) -> float:
    """The reward of `action` for a problem whose answer is `answer`: 1.0 when equal, else 0.0.

    Raises:
        ValueError: `action` is not an integer in [0, max_answer] (not in the action space).
    """
    if isinstance(action, bool) or not isinstance(action, (int, np.integer)) or not 0 <= action <= max_answer:
        raise ValueError(f"The action should be an integer in [0, {max_answer}]. Received {action!r}.")
    return float(action == answer)


def max_length(max_answer: int) -> int:
    """An upper bound on the length of any problem text: the longest fillers and numbers in every template."""
    longest = {
        "name": max((name for name, _ in PEOPLE), key=len),
        "pronoun": "she",
        "items": max(ITEMS, key=len),
        **dict.fromkeys("abc", max_answer),
    }
    return max(len(t.text.format(other=longest["name"], **longest)) for t in TEMPLATES)


# ---- the env --------------------------------------------------------------------------------------------------------
class ArithmeticEnv(gym.Env):
    """One arithmetic word problem per episode; answer it with one action.

    Args:
        difficulty: 1 (one operation) or 2 (one or two operations).
        split: "train" (fresh problems from `np_random`, never a test problem) or "test" (the held-out problems).
        max_answer: the largest answer and number in a problem (6..50); the actions are 0..max_answer.
        test_size: how many held-out test problems (1..1000).

    `reset(options={"index": i})` on the test split poses test problem i. `step` returns the problem text again,
    reward 1.0 or 0.0, terminated=True, and info `{"answer", "correct"}`.

    Raises:
        ValueError: an argument is out of range; `step` with an action outside the action space.
    """

    metadata = {"render_modes": []}

    def __init__(self, difficulty: int = 1, split: str = "train", max_answer: int = 20, test_size: int = 100):
        check_arguments(difficulty, split, max_answer, test_size)
        self.difficulty, self.split, self.max_answer, self.test_size = difficulty, split, max_answer, test_size
        self.observation_space = gym.spaces.Text(max_length(max_answer), charset=CHARSET)
        self.action_space = gym.spaces.Discrete(max_answer + 1)
        self.problem: tuple[str, int] | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        if self.split == "test":
            problems = _test_set(self.difficulty, self.max_answer, self.test_size)
            index = (options or {}).get("index")
            self.problem = problems[int(self.np_random.integers(len(problems))) if index is None else index]
        else:
            self.problem = draw_training_problem(self.np_random, self.difficulty, self.max_answer, self.test_size)
        return self.problem[0], {}

    def step(self, action: int) -> tuple[str, float, bool, bool, dict]:
        if self.problem is None:
            raise RuntimeError("Call reset() before step().")
        text, answer = self.problem
        reward = grade(answer, action, self.max_answer)
        return text, reward, True, False, {"answer": answer, "correct": reward == 1.0}


# ---- the exact evaluator and the expert -----------------------------------------------------------------------------
def evaluate(
    decide: Decide, difficulty: int = 1, split: str = "test", max_answer: int = 20, test_size: int = 100
) -> dict[str, Any]:
    """The exact accuracy of a deterministic policy on the held-out test problems (one batched `decide` call).

    Args:
        decide: a decider (see `llamagym.envs.suite`); each path is one problem text.
        difficulty, max_answer, test_size: the env's arguments (see `ArithmeticEnv`).
        split: accepted so the env's keyword arguments can be passed as they are; evaluation always uses the test
            problems.

    Returns:
        `score` (accuracy, each problem weighing 1/test_size), `random` (1/(max_answer + 1)), `optimal` (1.0),
        `normalised`, `expected_return`, `mean_turns` (1), `majority` (accuracy of always answering the most
        common test answer), `accuracy_one_step` and `accuracy_two_step` for difficulty 2, and `invalid_rate` when
        the decider can tell.

    Raises:
        ValueError: an argument is out of range, or the policy returned an action outside the action space.
    """
    check_arguments(difficulty, split, max_answer, test_size)
    problems = _test_set(difficulty, max_answer, test_size)

    def step(state: tuple[str, int], action: Any) -> list[Transition]:
        return [Transition(1.0, state, state[0], grade(state[1], action, max_answer), True)]

    result = play_out([(1 / len(problems), problem, problem[0]) for problem in problems], decide, step)
    correct = {leaf.state[0]: leaf.total for leaf in result.leaves}
    random = 1 / (max_answer + 1)  # uniform play names each problem's answer with probability 1/(max_answer + 1)
    figures = summary(result, random, 1.0, score=sum(correct.values()) / len(problems))
    counts = collections.Counter(answer for _, answer in problems)
    figures["majority"] = counts.most_common(1)[0][1] / len(problems)
    if difficulty == 2:
        for steps, key in ((1, "accuracy_one_step"), (2, "accuracy_two_step")):
            texts = [text for text, _ in problems if parse_problem(text)[0].steps == steps]
            figures[key] = sum(correct[text] for text in texts) / len(texts) if texts else None
    return figures


def expert(observation: str) -> int:
    """The right answer to a problem text (train or test), read from its numbers with the templates."""
    return solve(str(observation))


# ---- the agent ------------------------------------------------------------------------------------------------------
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class ArithmeticAgent(Agent):
    action_names = [str(i) for i in range(21)]  # scoring mode: reply i is answer i (the default max_answer=20)
    context_turns = 0  # one problem, one answer: the observation is the whole state

    def action_candidates(self, observation) -> list[str]:
        """The answers 0..max_answer as replies: `action_names`, or as many as the agent's `action_space` holds."""
        space = getattr(self, "action_space", None)
        return [str(i) for i in range(space.n)] if space is not None else list(self.action_names)

    def get_system_prompt(self) -> str:
        return "Solve the math word problem. Answer with the number."

    def format_observation(self, observation) -> str:
        return str(observation)

    def extract_action(self, response: str):
        """The last number in the reply ("... so the answer is 7." gives 7); None when there is none, or when it is
        negative or not a whole number. Answers above max_answer are rejected by the agent's action-space check."""
        numbers = _NUMBER.findall(response)
        if not numbers:
            return None
        value = float(numbers[-1])
        return int(value) if value >= 0 and value.is_integer() else None


GAME = Game(
    name="arithmetic",
    env_id="llamagym/Arithmetic-v0",
    entry_point="llamagym.envs.arithmetic:ArithmeticEnv",
    agent=ArithmeticAgent,
    evaluate=evaluate,
    expert=expert,
    agent_kwargs={"fallback_action": 0},  # answer 0 when a generated reply names no number
    env_kwargs={"difficulty": 1, "max_answer": 20, "test_size": 100},
    measure="accuracy on the held-out test problems",
)
