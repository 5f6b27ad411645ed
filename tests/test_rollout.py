import torch

from llamagym.algos.rollout import Turn, collate, left_pad, minibatch_indices, select


def test_response_mask_covers_exactly_the_response_tokens():
    turns = [Turn([1, 2, 3], [4, 5]), Turn([6], [7, 8, 9, 10])]
    batch = collate(turns, pad_token_id=0)
    for i, turn in enumerate(turns):
        mask = batch.response_mask[i].bool()
        assert batch.input_ids[i][mask].tolist() == turn.response_ids
        assert batch.value_index[i] == len(turn.prompt_ids) - 1
        assert batch.attention_mask[i].sum() == len(turn.prompt_ids) + len(turn.response_ids)


def test_slicing_is_by_token_count_even_when_ids_repeat():
    # the reply repeats prompt tokens: a string/marker search would find the wrong place
    batch = collate([Turn([5, 6, 5, 6], [5, 6])], pad_token_id=0)
    assert batch.response_mask[0].tolist() == [0, 0, 0, 0, 1, 1]


def test_minibatches_partition_the_batch():
    parts = minibatch_indices(10, 3, torch.Generator().manual_seed(0))
    assert sorted(torch.cat(parts).tolist()) == list(range(10))
    assert [len(p) for p in parts] == [3, 3, 3, 1]


def test_select_trims_padding_to_the_longest_row():
    batch = collate([Turn([1], [2]), Turn([1, 2, 3, 4, 5], [6])], pad_token_id=0)
    short = select(batch, torch.tensor([0]))
    assert short.input_ids.shape == (1, 2)


def test_left_pad_puts_padding_first():
    ids, mask = left_pad([[1, 2], [3]], pad_token_id=0)
    assert ids.tolist() == [[1, 2], [0, 3]] and mask.tolist() == [[1, 1], [0, 1]]
