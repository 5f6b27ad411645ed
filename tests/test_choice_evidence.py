"""Evidence across updates that a (state, choice) pair pays (`algos/choice_evidence.py`), and the inverse-choice
weights it gates (`PPOConfig.inverse_choice_evidence`): one lucky draw is never weighed, draws that paid again are."""

import math

import pytest
import torch

from llamagym.algos.choice_evidence import FORGET, ChoiceEvidence, evidence_scores
from llamagym.config import PPOConfig
from tests.test_entropy_floor import trainer
from tests.test_trust_region import distributions, scored_episodes

SETTLE = ([1.0, -1.0] * 3, [0, 1] * 3)  # every input: its first candidate pays, its second costs
# input 1 (the 2nd, 5th and 8th turn) draws its third candidate once and it pays; the other turns as SETTLE's
RARE = ([1.0, 1.0, -1.0, 1.0, 0.5, -1.0, 1.0, 0.5, -1.0], [0, 2, 1, 0, 0, 1, 0, 0, 1])


def test_evidence_scores_golden_values():
    sums, squares = torch.tensor([3.0, 3.0, 1.0, -2.0]), torch.tensor([9.0, 3.0, 11.0, 2.0])
    expected = torch.tensor([3 / math.sqrt(10), 1.5, 1 / math.sqrt(12), -2 / math.sqrt(3)])
    torch.testing.assert_close(evidence_scores(sums, squares), expected)


def test_one_draw_never_reaches_one_and_agreeing_draws_add_up():
    table = ChoiceEvidence(decay=1.0)
    assert float(table.update(["a"], torch.tensor([1000.0]))[0]) < 1.0
    scores = table.update(["b", "b", "b"], torch.tensor([1.0, 1.0, 1.0]))
    torch.testing.assert_close(scores, torch.full((3,), 1.5))  # 3 / sqrt(1 + 3)
    mixed = table.update(["c", "c", "c"], torch.tensor([3.0, -1.0, -1.0]))
    torch.testing.assert_close(mixed, torch.full((3,), 1 / math.sqrt(12)))


def test_each_update_decays_the_sums_before_adding_its_draws():
    table = ChoiceEvidence(decay=0.5)
    first = table.update([("s", 0), ("s", 0), ("s", 1)], torch.tensor([1.0, 1.0, 3.0]))
    torch.testing.assert_close(first, torch.tensor([2 / math.sqrt(3), 2 / math.sqrt(3), 3 / math.sqrt(10)]))
    second = table.update([("s", 0)], torch.tensor([2.0]))  # (0.5 x 2 + 2) / sqrt(1 + 0.5 x 2 + 4)
    torch.testing.assert_close(second, torch.tensor([3 / math.sqrt(6)]))
    assert table.table[("s", 1)] == [0.5, 1.5, 4.5]


def test_a_pair_not_drawn_for_long_is_forgotten():
    table = ChoiceEvidence(decay=0.5)
    table.update(["old"], torch.tensor([1.0]))
    updates = math.ceil(math.log(FORGET) / math.log(0.5))  # 0.5 ** 10 < 1e-3
    for _ in range(updates - 1):
        table.update(["new"], torch.tensor([0.0]))
    assert "old" in table.table
    table.update(["new"], torch.tensor([0.0]))
    assert "old" not in table.table and "new" in table.table


def test_the_table_round_trips_through_its_state_dict():
    table = ChoiceEvidence(decay=0.9)
    table.update([(1, 2), (1, 3)], torch.tensor([0.5, -0.25]))
    copy = ChoiceEvidence()
    copy.load_state_dict(table.state_dict())
    assert copy.decay == 0.9 and copy.table == table.table
    torch.testing.assert_close(copy.update([(1, 2)], torch.tensor([1.0])), table.update([(1, 2)], torch.tensor([1.0])))


def test_pairs_and_advantages_of_different_lengths_say_so():
    with pytest.raises(ValueError, match="2 pairs and 1 advantages"):
        ChoiceEvidence().update(["a", "b"], torch.tensor([1.0]))


def settled(lora_config, tokenizer, **overrides):
    torch.manual_seed(0)
    agent = trainer(lora_config, tokenizer, entropy_floor=None, **overrides)
    for _ in range(9):
        agent.step(scored_episodes(*SETTLE))
    return agent


def test_a_rare_choice_is_weighed_only_once_it_has_paid_across_updates(lora_config, tokenizer):
    """Input 1's third candidate (p under 0.2 once settled) is drawn and pays in two updates running: gated at 0.8, the
    first update steps as without the weights (one draw paying 0.79: z 0.62), the second weighs it (z 0.94), and it
    rises further than without them."""
    after, weighed = {}, {}
    for name in ("none", "gated"):
        agent = settled(lora_config, tokenizer)
        assert float(distributions(agent.policy)[1].exp()[2]) < 0.2
        if name == "gated":  # switched on once settled, its table empty: the two runs differ from here on only
            agent.config.inverse_choice_cap, agent.config.inverse_choice_evidence = 100.0, 0.8
            agent.choice_evidence = ChoiceEvidence()
        after[name], weighed[name] = [], []
        for _ in range(2):
            stats = agent.step(scored_episodes(*RARE))
            after[name].append(distributions(agent.policy))
            weighed[name].append(stats.get("adv/choice_weighed"))
    torch.testing.assert_close(after["gated"][0], after["none"][0])  # one draw: no weight
    assert weighed["gated"][0] == 0.0 and weighed["gated"][1] > 0.0
    assert float(after["gated"][1][1].exp()[2]) > float(after["none"][1][1].exp()[2]) + 0.01  # 0.357 against 0.314


def test_the_trainer_checkpoints_its_table(lora_config, tokenizer):
    agent = settled(lora_config, tokenizer, inverse_choice_cap=10.0, inverse_choice_evidence=1.2)
    state = agent.state_dict()["choice_evidence"]
    assert len(state["table"]) == 6  # 3 inputs x the 2 candidates drawn
    fresh = trainer(lora_config, tokenizer, entropy_floor=None, inverse_choice_cap=10.0, inverse_choice_evidence=1.2)
    fresh.load_state_dict(agent.state_dict())
    assert fresh.choice_evidence.table == agent.choice_evidence.table


def test_evidence_without_the_weights_says_what_to_set():
    with pytest.raises(ValueError, match=r"inverse_choice_cap` is None .* Set inverse_choice_cap"):
        PPOConfig(inverse_choice_evidence=1.2)


@pytest.mark.parametrize("threshold", [0, -1.0, float("nan"), "1.2", True])
def test_a_threshold_not_above_zero_says_what_to_pass(threshold):
    with pytest.raises(ValueError, match="inverse_choice_evidence"):
        PPOConfig(inverse_choice_cap=10.0, inverse_choice_evidence=threshold)


def test_data_parallel_says_the_table_is_one_process(lora_config, tokenizer, monkeypatch):
    monkeypatch.setattr("llamagym.algos.trainer.distributed.is_distributed", lambda: True)
    with pytest.raises(ValueError, match=r"one process's table\. Run it in one process"):
        trainer(lora_config, tokenizer, inverse_choice_cap=10.0, inverse_choice_evidence=1.2)
