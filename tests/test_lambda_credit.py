"""`benchmarks/lambda_credit.py`: GAE's expected credit of rooms' doors, exactly, with a prompt-only or full head."""

import pytest

from tests.test_learning_suite import load_benchmark

credit = load_benchmark("lambda_credit")


def test_shortest_walks_are_worth_gamma_to_the_steps_after_the_first():
    house = credit.House(eps=0.0, gamma=0.9)
    distance = house.layout.distance
    for start, goal in [(0, 1), (2, 5), (7, 3)]:
        d0 = distance[start][goal]
        assert house.values[credit.Full(start, goal, start, 0)] == pytest.approx(0.9 ** (d0 - 1))


def test_a_detour_costs_what_the_spl_says():
    house = credit.House(eps=0.0, gamma=1.0)  # then every later move is a shortest one
    distance, doors = house.layout.distance, house.layout.doors
    room, goal = next((r, g) for r in range(8) for g in range(8) if r != g and len(doors[r]) > 1 and distance[r][g] > 1)
    d = distance[room][goal]
    detour = next(a for a in doors[room] if not house.is_shortest(room, goal, a))
    steps = 1 + distance[detour][goal]
    assert house.q[credit.Full(room, goal, room, 0), detour] == pytest.approx(d / steps)


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
def test_a_full_state_head_hands_every_door_its_whole_gap_at_any_lambda(lam):
    house = credit.House(num_rooms=6, eps=0.2)
    assert house.credit(house.expected_gae(house.full_state_head(), lam)) == pytest.approx(1.0, abs=1e-9)


def test_the_prompt_head_hands_a_detour_less_of_its_cost_the_lower_lambda():
    house = credit.House(eps=0.1)  # the suite's house
    head = house.prompt_head()
    figures = [house.credit(house.expected_gae(head, lam)) for lam in (0.0, 0.5, 0.95, 1.0)]
    assert figures == pytest.approx([0.125, 0.296, 0.861, 0.964], abs=1e-3)


def test_a_value_per_turn_index_gives_a_low_lambda_back_much_of_a_detour_s_cost():
    house = credit.House(eps=0.1)  # the suite's house
    head = house.turn_head()
    figures = [house.credit(house.expected_gae(head, lam)) for lam in (0.0, 0.5, 0.95, 1.0)]
    assert figures == pytest.approx([0.423, 0.614, 0.946, 0.994], abs=1e-3)  # the prompt head's: 0.125, 0.296, 0.861


def test_it_prints_a_row_per_eps_and_head(capsys):
    credit.main(["--eps", "0.1", "--lams", "0", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 0.1 |")]
    assert [row.split(" | ")[1] for row in rows] == ["prompt", "prompt + turn", "full state"]
