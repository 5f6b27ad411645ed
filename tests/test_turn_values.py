import pytest
import torch

from llamagym.algos import ppo, turn_values


def test_turn_indices_count_within_each_episode_and_cap_at_the_last():
    assert turn_values.turn_indices(torch.tensor([2, 3]), 2).tolist() == [0, 1, 0, 1, 1]
    assert turn_values.turn_indices(torch.tensor([1, 4]), 8).tolist() == [0, 0, 1, 2, 3]


def test_refit_golden_values_worked_by_hand():
    # features [1, -1, 1, -1] (root mean square 1, so the one-hot columns are unscaled), turns [0, 0, 1, 1], targets
    # [2, 0, 3, 1], everything 0 before, damping 1: X = (x, 1, e0, e1), trace(X^T X) = 4 + 4 + 2 + 2 = 12 over 4
    # columns, lambda 3. x is orthogonal to the rest: weight = x.y / (x.x + 3) = 4 / 7. The rest solves
    # [[7, 2, 2], [2, 5, 0], [2, 0, 5]] (bias, v0, v1) = (6, 2, 4): v0 = (2 - 2 bias) / 5, v1 = (4 - 2 bias) / 5,
    # 27 bias = 18: bias 2/3, v0 2/15, v1 8/15
    features, turns = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]]), torch.tensor([0, 0, 1, 1])
    targets = torch.tensor([2.0, 0.0, 3.0, 1.0])
    weight, bias, values = turn_values.refit(
        features, turns, targets, torch.zeros(1, 1), torch.zeros(1), torch.zeros(2), 1.0
    )
    torch.testing.assert_close(weight, torch.tensor([[4 / 7]]))
    torch.testing.assert_close(bias, torch.tensor([2 / 3]))
    torch.testing.assert_close(values, torch.tensor([2 / 15, 8 / 15]))


def test_refit_fits_what_the_features_cannot_see_and_keeps_the_fit_of_least_change():
    # damping -> 0: the exact fit (weight 1, bias + v0 = 1, bias + v1 = 2) with bias^2 + v0^2 + v1^2 least
    features, turns = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]]), torch.tensor([0, 0, 1, 1])
    targets = torch.tensor([2.0, 0.0, 3.0, 1.0])
    weight, bias, values = turn_values.refit(
        features, turns, targets, torch.zeros(1, 1), torch.zeros(1), torch.zeros(2), 1e-9
    )
    torch.testing.assert_close(weight, torch.tensor([[1.0]]))
    torch.testing.assert_close(bias, torch.tensor([1.0]))
    torch.testing.assert_close(values, torch.tensor([0.0, 1.0]), atol=1e-6, rtol=0)


def test_refit_without_turn_values_to_learn_is_the_plain_ridge_refit():
    # every turn at index 0 and a heavy pull: v0 joins the bias; the fitted values match ridge_refit's closely
    g = torch.Generator().manual_seed(1)
    features, targets = torch.randn(16, 4, generator=g), torch.randn(16, generator=g)
    weight, bias, values = turn_values.refit(
        features, torch.zeros(16, dtype=torch.long), targets, torch.zeros(1, 4), torch.zeros(1), torch.zeros(1), 1.0
    )
    plain_weight, plain_bias = ppo.ridge_refit(features, targets, torch.zeros(1, 4), torch.zeros(1), 1.0)
    fitted = features @ weight.T + bias + values[0]
    plain = features @ plain_weight.T + plain_bias
    assert torch.corrcoef(torch.stack([fitted.squeeze(-1), plain.squeeze(-1)]))[0, 1] > 0.99


@pytest.mark.parametrize("count", [1, 3])
def test_refit_keeps_shapes_and_dtypes(count):
    weight, bias, values = turn_values.refit(
        torch.randn(5, 2),
        torch.zeros(5, dtype=torch.long),
        torch.randn(5),
        torch.zeros(1, 2),
        torch.zeros(1),
        torch.zeros(count),
        1.0,
    )
    assert weight.shape == (1, 2) and bias.shape == (1,) and values.shape == (count,)
    assert weight.dtype == bias.dtype == values.dtype == torch.float32
