import torch
import torch.nn.functional as F

from llamagym.algos.rollout import Episode, Turn, collate
from llamagym.algos.sft_replay import SFTReplayBuffer, sft_loss
from llamagym.config import ReplayConfig
from llamagym.models.policy import Policy


def episode(ret, tag=0):
    return Episode([Turn([1, tag], [2], reward=ret)])


def test_top_fraction_of_a_batch_enters():
    buffer = SFTReplayBuffer(ReplayConfig(top_fraction=0.5))
    assert buffer.add_batch([episode(r) for r in (0.0, 3.0, 1.0, 2.0)]) == 2
    assert sorted(e.env_return for e in buffer.episodes) == [2.0, 3.0]


def test_min_return_filters_and_fifo_evicts_oldest_at_capacity():
    buffer = SFTReplayBuffer(ReplayConfig(capacity=2, top_fraction=1.0, min_return=1.0))
    buffer.add_batch([episode(0.0)])
    assert len(buffer) == 0
    for tag in (1, 2, 3):
        buffer.add_batch([episode(1.0, tag)])
    assert [e.turns[0].prompt_ids[1] for e in buffer.episodes] == [2, 3]


def test_demonstrations_are_never_evicted_and_mix_in():
    buffer = SFTReplayBuffer(ReplayConfig(capacity=1, top_fraction=1.0, demo_fraction=0.5))
    buffer.add_demo(episode(0.0, tag=9))
    for tag in (1, 2):
        buffer.add_batch([episode(1.0, tag)])
    turns = buffer.sample_turns(4, torch.Generator().manual_seed(0))
    assert sorted(t.prompt_ids[1] for t in turns) == [2, 2, 9, 9]


def test_seeded_sampling_is_reproducible():
    buffer = SFTReplayBuffer(ReplayConfig(top_fraction=1.0))
    buffer.add_batch([episode(float(i), i) for i in range(6)])
    draw = [[t.prompt_ids[1] for t in buffer.sample_turns(5, torch.Generator().manual_seed(3))] for _ in range(2)]
    assert draw[0] == draw[1]


def test_invalid_and_cut_replies_of_good_episodes_are_never_imitated():
    buffer = SFTReplayBuffer(ReplayConfig(top_fraction=1.0))
    good = Episode(
        [
            Turn([1, 1], [2], reward=0.0, valid=False),  # its fallback paid
            Turn([1, 2], [3], reward=1.0),
            Turn([1, 3], [4], reward=0.0, finished=False),  # cut at max_new_tokens: imitating it teaches rambling
        ]
    )
    buffer.add_batch([good])
    turns = buffer.sample_turns(50, torch.Generator().manual_seed(0))
    assert {t.prompt_ids[1] for t in turns} == {2}
    kept = buffer.sample_turns(50, torch.Generator().manual_seed(0), skip_cut=False)  # replies meant to be cut
    assert {t.prompt_ids[1] for t in kept} == {2, 3}
    buffer.episodes[0].turns[1].valid = False  # nothing valid and finished left: nothing to imitate
    assert buffer.sample_turns(5, torch.Generator().manual_seed(0)) == []


def test_sft_loss_is_cross_entropy_on_assistant_tokens_only(model, lora_config):
    policy = Policy(model, lora_config)
    turns = [Turn([257, 40, 41, 256, 259], [50, 51, 256]), Turn([257, 42, 256, 258, 43, 256, 259], [52, 256])]
    batch = collate(turns, pad_token_id=256)
    out = policy(batch.input_ids, batch.attention_mask, batch.response_mask)
    logits = policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    labels = batch.input_ids.masked_fill(batch.response_mask == 0, -100)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(sft_loss(out.logprobs, batch.response_mask), expected)
