"""Blackjack, the suite's first game: Gymnasium's own env, exact evaluation of its policies, and a ready agent.

The env is `gymnasium/envs/toy_text/blackjack.py` (1.x) with `natural=False, sab=False`. Rules: an infinite deck
(ace = 1, 2..9, and four ten-valued ranks, so P(10) = 4/13); two cards each; the observation is (player sum,
dealer's face-up card, usable ace), with a usable ace counted as 11. Hit (1) draws a card and busting loses -1 at
once; the player may hit on any total, 21 included. Stick (0) lets the dealer draw while his total is below 17 (a
soft 17 stands), then pays cmp(player, dealer) with a bust scoring 0. With `natural=False, sab=False` a natural is
an ordinary 21: it draws against any dealer 21. Note that `gym.make("Blackjack-v1")` alone defaults to `sab=True`,
a different game.

The observation is Markov: a hard total of 12 or more can never use an ace again, so whether it holds one does not
matter, and a hard total of 11 or less holds none. Each hit raises the card sum, so memoised recursion is exact:
`exact_return` gives any policy's expected return (and win/draw/loss rates) over the 280 decision `STATES`, and
`evaluate` reports it for a deterministic policy beside uniform random play (-0.395896) and the optimal policy
(-0.046556).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from ..agent import Agent
from .suite import Decide, Game, ask_table, freeze, normalised

State = tuple[int, int, int]  # (player_sum, dealer_card, usable_ace), exactly the env's observation
PolicyLike = Callable[[int, int, int], float] | Mapping[State, float]
Outcome = tuple[float, float, float]  # (P(win), P(draw), P(loss))

CARD_PROBS: dict[int, float] = {card: (4 if card == 10 else 1) / 13 for card in range(1, 11)}
DEALER_CARDS = tuple(range(1, 11))
HARD_SUMS = tuple(range(4, 22))  # 2+2 up to a hard 21 reached by hitting
SOFT_SUMS = tuple(range(12, 22))  # A+A up to A+10
STATES: tuple[State, ...] = tuple(
    (total, dealer, usable)
    for usable, sums in ((0, HARD_SUMS), (1, SOFT_SUMS))
    for total in sums
    for dealer in DEALER_CARDS
)  # the 280 observations at which the player decides: (18 hard + 10 soft sums) x 10 dealer cards

HIT, STICK = 1, 0


def _add_card(total: int, usable: int, card: int) -> tuple[int, int]:
    """(total, usable ace) after drawing `card`; the empty hand is (0, 0). A total above 21 is a bust."""
    raw, has_ace = (total - 10, True) if usable else (total, False)
    raw, has_ace = raw + card, has_ace or card == 1
    return (raw + 10, 1) if has_ace and raw + 10 <= 21 else (raw, 0)


def dealer_distribution(dealer_card: int) -> dict[int, float]:
    """Distribution of the dealer's final score given his face-up card (0 = bust, else 17..21).

    The hole card is just the first of his draws: it is independent of everything the player sees.
    """
    memo: dict[tuple[int, int], dict[int, float]] = {}

    def final(total: int, usable: int) -> dict[int, float]:
        if total > 21:
            return {0: 1.0}
        if total >= 17:
            return {total: 1.0}
        if (total, usable) not in memo:
            dist: dict[int, float] = {}
            for card, p in CARD_PROBS.items():
                for score, q in final(*_add_card(total, usable, card)).items():
                    dist[score] = dist.get(score, 0.0) + p * q
            memo[total, usable] = dist
        return memo[total, usable]

    return final(*_add_card(0, 0, dealer_card))


_DEALER = {card: dealer_distribution(card) for card in DEALER_CARDS}


def _stick_outcome(total: int, dealer_card: int) -> Outcome:
    dist = _DEALER[dealer_card]
    win = sum(p for score, p in dist.items() if score < total)  # a dealer bust scores 0 and loses
    draw = dist.get(total, 0.0)
    return win, draw, 1.0 - win - draw


def _hit_outcome(state: State, value: Callable[[State], Outcome]) -> Outcome:
    """Outcome probabilities of hitting once at `state`, then following `value` (a bust loses)."""
    total, dealer, usable = state
    hit = [0.0, 0.0, 0.0]
    for card, p in CARD_PROBS.items():
        new_total, new_usable = _add_card(total, usable, card)
        out = (0.0, 0.0, 1.0) if new_total > 21 else value((new_total, dealer, new_usable))
        hit = [h + p * o for h, o in zip(hit, out, strict=True)]
    return tuple(hit)


def _solve(choose: Callable[[State, Outcome, Outcome], Outcome]) -> dict[State, Outcome]:
    """Outcome probabilities of every state, where `choose(state, stick, hit)` mixes the two actions' outcomes."""
    memo: dict[State, Outcome] = {}

    def value(state: State) -> Outcome:
        if state not in memo:
            total, dealer, _ = state
            memo[state] = choose(state, _stick_outcome(total, dealer), _hit_outcome(state, value))
        return memo[state]

    for state in STATES:
        value(state)
    return memo


def _deals() -> dict[State, float]:
    """The probability of each first decision state: the initial deal (two player cards, the dealer's face-up card)."""
    first = dict.fromkeys(STATES, 0.0)
    for dealer, p_dealer in CARD_PROBS.items():
        for card, p_card in CARD_PROBS.items():
            for second, p_second in CARD_PROBS.items():
                total, usable = _add_card(*_add_card(0, 0, card), second)
                first[total, dealer, usable] += p_dealer * p_card * p_second
    return first


def _initial_outcome(values: Mapping[State, Outcome]) -> Outcome:
    """Average the state outcomes over the initial deal."""
    total_out = [0.0, 0.0, 0.0]
    for state, weight in _deals().items():
        total_out = [t + weight * o for t, o in zip(total_out, values[state], strict=True)]
    return tuple(total_out)


def hit_probabilities(policy: PolicyLike) -> dict[State, float]:
    """Resolve a policy to P(hit) at every state in `STATES`.

    Args:
        policy: a callable `(player_sum, dealer_card, usable_ace) -> action or P(hit)`, or a mapping from states to
            the same. Actions follow the env (1 = hit, 0 = stick), so an action is also its hit probability, and a
            stochastic policy returns any probability in [0, 1].

    Raises:
        KeyError: a mapping lacks one of the states.
        ValueError: a returned value is not in [0, 1].
    """
    probs = {}
    for state in STATES:
        if isinstance(policy, Mapping):
            if state not in policy:
                raise KeyError(f"The policy mapping has no action for state {state} (player_sum, dealer, usable_ace).")
            p = float(policy[state])
        else:
            p = float(policy(*state))
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"The hit probability at state {state} should be in the interval [0, 1]. Received {p}.")
        probs[state] = p
    return probs


def _policy_outcomes(policy: PolicyLike) -> dict[State, Outcome]:
    """Outcome probabilities of every state when `policy` (see `hit_probabilities`) plays from there."""
    probs = hit_probabilities(policy)

    def mix(state: State, stick: Outcome, hit: Outcome) -> Outcome:
        p = probs[state]
        return tuple((1.0 - p) * s + p * h for s, h in zip(stick, hit, strict=True))

    return _solve(mix)


def exact_return(policy: PolicyLike) -> dict[str, float]:
    """Exact expected return per hand of `policy`, from the initial deal, with no sampling noise.

    Args:
        policy: see `hit_probabilities`; deterministic or stochastic.

    Returns:
        `{"expected_return", "win", "draw", "loss"}`; `expected_return == win - loss` since rewards are in {-1, 0, 1}.
    """
    win, draw, loss = _initial_outcome(_policy_outcomes(policy))
    return {"expected_return": win - loss, "win": win, "draw": draw, "loss": loss}


def optimal_policy() -> dict[State, int]:
    """The policy that maximises the expected return at every state (backward induction; ties go to stick)."""
    actions: dict[State, int] = {}

    def best(state: State, stick: Outcome, hit: Outcome) -> Outcome:
        take_hit = hit[0] - hit[2] > stick[0] - stick[2] + 1e-12
        actions[state] = HIT if take_hit else STICK
        return hit if take_hit else stick

    _solve(best)
    return {state: actions[state] for state in STATES}


def hit_gains(policy: PolicyLike) -> dict[State, float]:
    """Q(s, hit) - Q(s, stick) at every state under `policy`: the expected-return gain of hitting once at s, then
    playing `policy` (see `hit_probabilities`), over sticking there. What a learner's advantages estimate."""
    values = _policy_outcomes(policy)
    gains = {}
    for state in STATES:
        (win, _, loss), stick = _hit_outcome(state, values.__getitem__), _stick_outcome(state[0], state[1])
        gains[state] = (win - loss) - (stick[0] - stick[2])
    return gains


def optimal_advantages() -> dict[State, float]:
    """Q*(s, hit) - Q*(s, stick) at every state: the expected-return gain of hitting once, then playing optimally.

    Positive exactly where `optimal_policy` hits. Used to measure how fast a policy can fit the optimal table when
    the advantages are known exactly (`benchmarks/natural_gradient.py`).
    """
    return hit_gains(optimal_policy())


def visits(policy: PolicyLike) -> dict[State, float]:
    """The probability that a hand played by `policy` (see `hit_probabilities`) decides at each state: no state comes
    twice in a hand, since each card raises the sum that counts an ace as 1."""
    probs = hit_probabilities(policy)
    reach = _deals()
    for state in sorted(STATES, key=lambda s: s[0] - 10 * s[2]):  # every way into a state comes before it
        total, dealer, usable = state
        for card, p in CARD_PROBS.items():
            new_total, new_usable = _add_card(total, usable, card)
            if new_total <= 21:
                reach[new_total, dealer, new_usable] += reach[state] * probs[state] * p
    return reach


def uniform_random(player_sum: int, dealer_card: int, usable_ace: int) -> float:
    """Hit with probability 1/2 everywhere."""
    return 0.5


def always_stick(player_sum: int, dealer_card: int, usable_ace: int) -> int:
    """Never draw a card."""
    return STICK


def stick_on_17(player_sum: int, dealer_card: int, usable_ace: int) -> int:
    """Hit below 17, stick on 17 or more (soft or hard): the dealer's own rule."""
    return HIT if player_sum < 17 else STICK


def reference_policies() -> dict[str, PolicyLike]:
    """The four reference policies of docs/design.md §8, keyed by the labels used in tables and plots."""
    return {
        "uniform random": uniform_random,
        "always stick": always_stick,
        "stick on >= 17": stick_on_17,
        "optimal": optimal_policy(),
    }


def reference_returns() -> dict[str, dict[str, float]]:
    """`exact_return` of each reference policy, keyed as in `reference_policies`.

    Expected returns per hand: uniform random -0.395896, always stick -0.186368, stick on >= 17 -0.079295,
    optimal -0.046556 (win rates 28.1%, 38.1%, 40.8%, 42.9%).
    """
    return {name: exact_return(policy) for name, policy in reference_policies().items()}


def policy_table(policy: PolicyLike) -> dict[str, dict[int, list[float]]]:
    """P(hit) laid out for plotting: hard totals 4..21 and soft totals 12..21 against dealer cards 1..10.

    Returns:
        `{"hard": {player_sum: [P(hit) vs dealer 1, ..., 10]}, "soft": {...}}`; 1.0 is hit, 0.0 is stick.
    """
    probs = hit_probabilities(policy)
    return {
        name: {total: [probs[total, dealer, usable] for dealer in DEALER_CARDS] for total in sums}
        for name, usable, sums in (("hard", 0, HARD_SUMS), ("soft", 1, SOFT_SUMS))
    }


# ---- the suite game: exact evaluation of a decider, the expert, the agent ------------------------------------------
@functools.lru_cache(maxsize=1)
def _references() -> tuple[float, float, dict[State, int]]:
    """Uniform random's and the optimal policy's exact returns, and the optimal table (computed once)."""
    best = optimal_policy()
    return exact_return(uniform_random)["expected_return"], exact_return(best)["expected_return"], best


def evaluate(decide: Decide, natural: bool = False, sab: bool = False) -> dict[str, Any]:
    """The exact figures of a deterministic Markov policy, from one batched call of `decide` over the 280 `STATES`.

    Args:
        decide: a decider (see `llamagym.envs.suite`) whose `markov` attribute is true: it is asked once, for the
            paths `(state,)` of every state. If it has a `valid(paths)` method, the share of invalid replies over
            the 280 states is reported as `invalid_rate`.
        natural, sab: the env's rules; only the default `natural=False, sab=False` is evaluated exactly.

    Returns:
        `score` (the expected return per hand), `random` (uniform random play's, -0.395896), `optimal` (-0.046556),
        `normalised` (0 = random, 1 = optimal), `expected_return`, `win`, `draw`, `loss`, and `invalid_rate` when
        the decider can tell.

    Raises:
        ValueError: `decide` is not Markov, or the rules are not the default ones.
        RuntimeError: `decide` returned the wrong number of actions.
    """
    if natural or sab:
        raise ValueError(
            f"Blackjack's exact evaluation covers `natural=False, sab=False` only. Received natural={natural!r}, "
            f"sab={sab!r}."
        )
    actions, invalid = ask_table(decide, STATES, "Blackjack's exact evaluation")
    figures = exact_return(dict(zip(STATES, actions, strict=True)))
    random, optimal, _ = _references()
    score = figures["expected_return"]
    result = {"score": score, "random": random, "optimal": optimal, "normalised": normalised(score, random, optimal)}
    result.update(figures)
    if invalid is not None:
        result["invalid_rate"] = invalid
    return result


def expert(observation) -> int:
    """The optimal action (`optimal_policy`) at an observation (player_sum, dealer_card, usable_ace)."""
    return _references()[2][freeze(observation)]


class BlackjackAgent(Agent):
    action_names = ["stick", "hit"]  # scoring mode: action i is the reply action_names[i]
    context_turns = 0  # the observation is the whole state: a Markov policy, evaluable exactly

    def get_system_prompt(self) -> str:
        # Short prompts are cheap, and this wording gives "hit" about 25% prior probability (the model's prior
        # under "Reply with one word: hit or stick" is 4%, too little for PPO to ever see a hit pay off).
        return "Blackjack. Answer hit or stick."

    def format_observation(self, observation) -> str:
        player_sum, dealer_card, usable_ace = observation
        ace = " (usable ace)" if usable_ace else ""
        return f"Total {player_sum}{ace}, dealer {dealer_card}. Hit or stick?"

    def extract_action(self, response: str):
        words = response.lower().replace(".", " ").split()
        for word in words:
            if word in ("hit", "1"):
                return 1
            if word in ("stick", "stand", "stay", "0"):
                return 0
        return None  # no action named: the agent plays `fallback_action` and counts it as invalid


GAME = Game(
    name="blackjack",
    env_id="llamagym/Blackjack-v0",
    entry_point="gymnasium.envs.toy_text.blackjack:BlackjackEnv",
    agent=BlackjackAgent,
    evaluate=evaluate,
    expert=expert,
    agent_kwargs={"fallback_action": 0},  # stick when a generated reply names no action
    env_kwargs={"natural": False, "sab": False},
    measure="expected return",
)
