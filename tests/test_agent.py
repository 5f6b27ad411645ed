"""The Agent through its public loop: a scripted env, three hooks, fallbacks, misuse, demonstrations, save/load."""

import json

import pytest
import torch
from peft import LoraConfig

from llamagym import Agent, PPOConfig, ReplayConfig
from llamagym.algos.modes import MODES
from tests.envs import CountingEnv, YesNoAgent


class ScriptedAgent(Agent):
    def get_system_prompt(self):
        return "Answer 0 or 1."

    def format_observation(self, observation):
        return f"step {observation}"

    def extract_action(self, response):
        return 1 if response[:1].isalpha() else (0 if response else None)


def make_agent(model, tokenizer, lora_config, cls=ScriptedAgent, batch_size=2, **kwargs):
    config = PPOConfig(batch_size=batch_size, min_batch_turns=0, mini_batch_size=4, ppo_epochs=1)
    kwargs = {"generation_config": {"max_new_tokens": 3}, **kwargs}
    return cls(model, tokenizer, "cpu", ppo_config=config, lora_config=lora_config, **kwargs)


def play(agent, env, episodes=1):
    stats = []
    for _ in range(episodes):
        observation, _ = env.reset()
        done = False
        while not done:
            action = agent.act(observation)
            observation, reward, terminated, truncated, _ = env.step(action)
            agent.assign_reward(reward)
            done = terminated or truncated
        stats.append(agent.terminate_episode())
    return stats


def test_turns_and_rewards_align_and_training_waits_for_a_full_batch(model, tokenizer, lora_config):
    agent = make_agent(model, tokenizer, lora_config)
    first, second = play(agent, CountingEnv(length=3), episodes=2)
    assert "ppo/policy_loss" not in first and first["env/length"] == 3.0
    assert "ppo/policy_loss" in second and second["ppo/num_turns"] == 6.0
    assert agent.batch == []


def test_training_also_waits_for_min_batch_turns(model, tokenizer, lora_config):
    agent = make_agent(model, tokenizer, lora_config)
    agent.ppo_config.min_batch_turns = 7  # two 3-turn episodes fill batch_size=2 but not 7 turns
    stats = play(agent, CountingEnv(length=3), episodes=3)
    assert ["ppo/policy_loss" in s for s in stats] == [False, False, True]
    assert stats[-1]["ppo/num_turns"] == 9.0


def test_recorded_turns_hold_the_prompt_the_model_saw_and_its_reply(model, tokenizer, lora_config):
    agent = make_agent(model, tokenizer, lora_config, batch_size=10)
    env = CountingEnv(length=2)
    observation, _ = env.reset()
    action = agent.act(observation)
    turn = agent.episode.turns[0]
    assert tokenizer.decode(turn.prompt_ids).endswith("<|user|>step 0<|end|><|assistant|>")
    assert agent.last_reply == tokenizer.decode(turn.response_ids, skip_special_tokens=True)
    _, reward, *_ = env.step(action)
    agent.assign_reward(reward)
    agent.assign_reward(0.5)
    assert turn.reward == reward + 0.5


def test_a_reply_cut_at_max_new_tokens_is_recorded_as_unfinished(model, tokenizer, lora_config):
    agent = make_agent(model, tokenizer, lora_config, batch_size=16)
    agent.act_batch(list(range(16)))
    turns = [slot.episode.turns[0] for slot in agent.slots]
    ended = [t.response_ids[-1] in agent.eos_ids for t in turns]
    assert [t.finished for t in turns] == ended
    assert all(len(t.response_ids) == 3 for t, end in zip(turns, ended, strict=True) if not end)
    assert not all(ended)  # the tiny random model seldom ends a reply within 3 tokens


class BadReplyAgent(ScriptedAgent):
    def extract_action(self, response):
        raise ValueError("no action in this reply")


def test_unparsable_replies_fall_back_are_counted_penalised_and_training_proceeds(model, tokenizer, lora_config):
    agent = make_agent(model, tokenizer, lora_config, cls=BadReplyAgent, fallback_action=1, format_penalty=0.25)
    env = CountingEnv(length=2)
    stats = play(agent, env, episodes=2)
    assert stats[-1]["agent/invalid_action_rate"] == 1.0 and stats[-1]["agent/batch_invalid_action_rate"] == 1.0
    assert stats[-1]["env/return"] == 2 * (1.0 - 0.25)  # the fallback (1) was played and penalised
    assert "ppo/policy_loss" in stats[-1]


class FailingObservationAgent(ScriptedAgent):
    def format_observation(self, observation):
        if observation == 1:
            raise KeyError("unknown observation")
        return super().format_observation(observation)


def test_a_raising_hook_names_episode_and_turn_and_leaves_the_episode_consistent(model, tokenizer, lora_config):
    agent = make_agent(model, tokenizer, lora_config, cls=FailingObservationAgent)
    agent.act(0)
    agent.assign_reward(1.0)
    with pytest.raises(RuntimeError, match="episode 0, turn 1"):
        agent.act(1)
    assert len(agent.episode.turns) == 1 and len(agent.history) == 2


def test_misuse_and_bad_rewards_raise_clear_errors(model, tokenizer, lora_config):
    agent = make_agent(model, tokenizer, lora_config)
    with pytest.raises(RuntimeError, match="before act"):
        agent.assign_reward(1.0)
    agent.act(0)
    with pytest.raises(ValueError, match="finite.*episode 0, turn 0"):
        agent.assign_reward(float("nan"))
    with pytest.raises(ValueError, match="number"):
        agent.assign_reward("a lot")


def test_top_k_or_top_p_sampling_is_refused(model, tokenizer, lora_config):
    with pytest.raises(ValueError, match="top_p"):
        make_agent(model, tokenizer, lora_config, generation_config={"top_p": 0.9})


def test_truncated_episode_records_the_bootstrap_prompt(model, tokenizer, lora_config):
    agent = make_agent(model, tokenizer, lora_config, batch_size=10)
    agent.act(0)
    agent.assign_reward(0.0)
    agent.terminate_episode(truncated=True, final_observation=7)
    episode = agent.batch[0]
    assert episode.truncated and tokenizer.decode(episode.bootstrap_prompt_ids).endswith("step 7<|end|><|assistant|>")


def test_evaluation_episodes_are_greedy_and_not_trained_on(model, tokenizer, lora_config):
    agent = make_agent(model, tokenizer, lora_config)
    with agent.evaluating():
        replies = []
        for _ in range(2):
            agent.act(0)
            replies.append(agent.last_reply)
            agent.assign_reward(1.0)
            agent.terminate_episode()
    assert replies[0] == replies[1] and agent.batch == []


def test_demonstrations_from_jsonl_and_from_a_scripted_expert_fill_the_replay(model, tokenizer, lora_config, tmp_path):
    agent = make_agent(model, tokenizer, lora_config, sft_warm_start=True, replay_config=ReplayConfig(sft_steps=1))
    path = tmp_path / "demos.jsonl"
    transcript = [{"role": "user", "content": "step 0"}, {"role": "assistant", "content": "a"}]
    path.write_text(json.dumps({"messages": transcript}) + "\n")
    assert agent.load_demonstrations(path) == 1
    demo = agent.trainer.replay.demos[0].turns[0]
    assert tokenizer.decode(demo.response_ids) == "a<|end|>"
    assert agent.seed_from_expert(CountingEnv(length=2), lambda observation: '{"action": 1}', episodes=2) == 2.0
    assert len(agent.trainer.replay.demos) == 3
    stats = play(agent, CountingEnv(length=2), episodes=2)[-1]
    assert stats["sft/loss"] > 0


def test_the_sft_warm_start_follows_updates_on_generated_replies_by_default_and_not_scored_ones(
    model, tokenizer, lora_config
):
    generated = play(make_agent(model, tokenizer, lora_config), CountingEnv(length=2), episodes=2)[-1]
    assert generated["sft/buffer_size"] >= 1  # free text: the warm-start teaches the reply format
    scored = play(make_agent(model, tokenizer, lora_config, cls=YesNoAgent), CountingEnv(length=2), episodes=2)[-1]
    assert "ppo/num_updates" in scored and not any(key.startswith("sft/") for key in scored)
    always = make_agent(model, tokenizer, lora_config, cls=YesNoAgent, sft_warm_start=True)
    assert "sft/buffer_size" in play(always, CountingEnv(length=2), episodes=2)[-1]
    never = make_agent(model, tokenizer, lora_config, sft_warm_start=False)
    assert never.trainer.replay is None and "sft/buffer_size" not in play(never, CountingEnv(length=2), episodes=2)[-1]
    with pytest.raises(RuntimeError, match="without sft_warm_start=False"):
        never.seed_from_expert(CountingEnv(length=2), lambda observation: "1", episodes=1)
    demonstrated = make_agent(model, tokenizer, lora_config, cls=YesNoAgent)  # demonstrations turn it on
    assert demonstrated.seed_from_expert(CountingEnv(length=2), lambda observation: "yes", episodes=1) == 2.0
    assert "sft/buffer_size" in play(demonstrated, CountingEnv(length=2), episodes=2)[-1]
    with pytest.raises(ValueError, match="sft_warm_start"):
        make_agent(model, tokenizer, lora_config, sft_warm_start="yes")


@pytest.mark.parametrize(
    "content, where",
    [('{"messages": []}\n', "bad.jsonl:1: a demonstration needs"), ('{"messages": []}\nnot json\n', "bad.jsonl:2")],
)
def test_jsonl_errors_name_the_line(model, tokenizer, lora_config, tmp_path, content, where):
    agent = make_agent(model, tokenizer, lora_config, sft_warm_start=True)
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=where):
        agent.load_demonstrations(path)


def test_save_and_load_restore_the_policy_and_the_trainer(model, tokenizer, lora_config, tmp_path):
    from llamagym.models.tiny_random import build_tiny_model

    agent = make_agent(model, tokenizer, lora_config)
    play(agent, CountingEnv(length=2), episodes=2)
    agent.save(tmp_path)
    other = make_agent(
        build_tiny_model(tokenizer),
        tokenizer,
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], bias="none", lora_dropout=0.0),
    )
    other.load(tmp_path)
    assert other.trainer.num_updates == 1 and other.episode_count == agent.episode_count
    for (name, a), b in zip(agent.policy.state_dict().items(), other.policy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_state_dict_round_trips_the_trainer_and_episodes_and_can_drop_the_running_ones(model, tokenizer, lora_config):
    from llamagym.models.tiny_random import build_tiny_model

    agent = make_agent(model, tokenizer, lora_config, batch_size=3)
    play(agent, CountingEnv(length=2), episodes=4)  # one update, one finished episode waiting
    agent.act(0)  # a running episode
    state = agent.state_dict()
    assert set(state) == {"trainer", "episode_count", "episodes", "acting_memory"}
    other = make_agent(build_tiny_model(tokenizer), tokenizer, lora_config, batch_size=3)
    other.load_state_dict(state)
    assert other.trainer.num_updates == 1 and other.episode_count == agent.episode_count
    assert len(other.batch) == 1 and other.episode.turns == agent.episode.turns
    fresh = make_agent(build_tiny_model(tokenizer), tokenizer, lora_config, batch_size=3)
    fresh.load_state_dict(state, restore_episodes=False)
    assert len(fresh.batch) == 1 and not fresh.episode.turns and fresh.episode_count == agent.episode_count + 1


class NamedAgent(ScriptedAgent):
    action_names = ["yes", "no"]


def test_predict_scores_in_float32_and_never_reuses_scores_cached_under_bf16(model, tokenizer, lora_config):
    agent = make_agent(model, tokenizer, lora_config, cls=NamedAgent, precision="bf16")
    agent.act(0)  # scores observation 0 under bf16, and caches that
    scores = agent.actor.memory(MODES["score"])  # the score mode's memory (one dict, emptied when the stamp changes)
    ((key, acted),) = scores.items()
    agent.predict([0])
    assert agent.policy.precision == "bf16"
    predicted = scores[key].logprobs
    agent.policy.precision = "fp32"  # the same weights, run in fp32 throughout
    agent.act(0)
    torch.testing.assert_close(predicted, scores[key].logprobs, atol=0, rtol=0)
    assert not torch.equal(acted.logprobs, predicted)


def test_predict_acts_greedily_from_a_fresh_context_and_records_nothing(model, tokenizer, lora_config):
    # fp32: in bf16 a batch of two (padded) and a single row may round a near-tie apart, as some random adapters do
    agent = make_agent(model, tokenizer, lora_config, precision="fp32")
    predicted = agent.predict([0, 1])
    assert agent.episode.turns == [] and agent.history == []
    with agent.evaluating():
        acted = [agent.act(0)]
        agent.assign_reward(0.0)
        agent.terminate_episode()
        acted.append(agent.act(1))
    assert predicted == acted


@pytest.mark.parametrize("lora_layers, adapted", [("auto", {1}), (None, {0, 1}), (2, {0, 1})])
def test_lora_layers_default_comes_from_the_models_registry_entry(model, tokenizer, lora_layers, adapted):
    import dataclasses

    from llamagym.models.registry import get_model_spec

    model.llamagym_spec = dataclasses.replace(get_model_spec("tiny-random"), lora_layers=1)
    agent = ScriptedAgent(model, tokenizer, lora_layers=lora_layers)
    names = [name for name, _ in agent.policy.named_parameters() if "lora_" in name]
    assert {int(name.split("layers.")[1].split(".")[0]) for name in names} == adapted
