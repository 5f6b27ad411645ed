"""`benchmarks/blackjack_states.py`: where a Blackjack policy's return falls short of optimal, state by state."""

import pytest

from llamagym.envs import blackjack as bj
from llamagym.envs import suite
from tests.test_learning_suite import load_benchmark, quick_probe_run

states = load_benchmark("blackjack_states")


def test_the_optimal_table_has_no_gap():
    table = bj.hit_probabilities(bj.optimal_policy())
    found = states.figures(table)
    assert found == {
        "sampled": pytest.approx(1.0), "entropy": 0.0, "gap": 0.0, "held": 0.0, "costly": [], "hit": [*table.values()]
    }  # fmt: skip


def test_always_sticking_lists_the_low_totals_it_should_hit_and_their_gains():
    found = states.figures(bj.hit_probabilities(bj.always_stick))
    refs = bj.reference_returns()
    assert found["gap"] == pytest.approx(refs["optimal"]["expected_return"] - refs["always stick"]["expected_return"])
    normalised = (refs["always stick"]["expected_return"] - refs["uniform random"]["expected_return"]) / (
        refs["optimal"]["expected_return"] - refs["uniform random"]["expected_return"]
    )
    assert found["entropy"] == 0.0 and found["sampled"] == pytest.approx(normalised)
    shares = [c["share"] for c in found["costly"]]
    # the gap is spread thin: the ten costliest states carry 0.29 of it, hard 11 against a dealer's ten the most
    assert len(shares) == states.MOST and shares == sorted(shares, reverse=True) and 0.28 < sum(shares) < states.COSTLY
    assert found["costly"][0]["state"] == [11, 10, 0]
    # held: hitting a hard 4 or 5 and sticking on what follows wins only when the dealer busts, as sticking does; and
    # a soft 18 against an ace loses more often by a hit and a stick
    held = [s for s in bj.STATES if s[:2] == (18, 1) and s[2] or s[0] in (4, 5) and not s[2]]
    reach, gains = bj.visits(bj.always_stick), bj.optimal_advantages()
    assert found["held"] == pytest.approx(sum(reach[s] * gains[s] for s in held) / found["gap"]) and found["held"] > 0
    for c in found["costly"]:  # every hit it misses among the costliest pays even when the hand sticks right after
        assert c["optimal"] == "hit" and c["p_hit"] == 0.0 and c["gain"] > 0 and c["cost"] > 0
        assert c["share"] == pytest.approx(c["reach"] * c["cost"] / found["gap"])


def test_hitting_from_twelve_on_holds_the_low_totals_by_its_later_play():
    found = states.figures(bj.hit_probabilities(lambda total, dealer, usable: float(total >= 12)))
    costliest = found["costly"][0]
    assert costliest["state"] == [20, 10, 0] and costliest["gain"] < 0 and costliest["optimal"] == "stick"
    # a hard 11 hit lands on 12-21 and busts from there: the gain says stick where optimal play hits
    gains, best = bj.hit_gains(lambda total, dealer, usable: float(total >= 12)), bj.optimal_policy()
    assert all(gains[11, dealer, 0] < 0 < best[11, dealer, 0] for dealer in bj.DEALER_CARDS)
    assert 0.05 < found["held"] < 0.5


def test_a_coin_everywhere_has_full_entropy_and_a_gap_spread_over_many_states():
    found = states.figures(dict.fromkeys(bj.STATES, 0.5))
    assert found["entropy"] == pytest.approx(1.0) and found["sampled"] == pytest.approx(0.0, abs=1e-12)
    assert len(found["costly"]) == states.MOST and sum(c["share"] for c in found["costly"]) < states.COSTLY


@pytest.mark.slow
def test_a_quick_run_records_the_sampled_policy_and_its_greedy_table_is_the_suites(tmp_path):
    # in fp32: the probe reads the policy in the training precision and the suite's greedy evaluation runs in fp32
    # (`Policy.float32`), so on a bf16 CPU a state near P(hit) 0.5 could round one way in one and the other in the other
    run, printed = quick_probe_run("blackjack_states.py", tmp_path, "--agent", "precision=fp32")
    for point in run["curve"]:
        probed = point["probe"]
        assert -1 < probed["sampled"] < 1 and 0 < probed["entropy"] <= 1 and probed["gap"] > 0
        assert all(0 < c["p_hit"] < 1 and 0 < c["share"] <= 1 for c in probed["costly"])
    # the latest weights' greedy table, as the suite evaluates it, is the probe's table with each P(hit) rounded
    hit = run["curve"][-1]["probe"]["hit"]
    greedy = bj.evaluate(suite.markov(lambda obs: int(hit[bj.STATES.index(tuple(obs))] > 0.5)))
    assert greedy["normalised"] == pytest.approx(run["curve"][-1]["latest_normalised"])
    assert "seed 0: final" in printed and "of the gap): hard" in printed
