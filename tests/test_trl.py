"""The TRL adapter (`llamagym.integrations.trl`): a real `GRPOTrainer` step through `EpisodeRollout` on the tiny model.

Needs the extra (`pip install -e .[trl]`); without it only the missing-extra message is checked.
"""

import importlib
import sys

import gymnasium as gym
import pytest
import torch

from llamagym import Agent

SKIP = "TRL is not installed: pip install -e .[trl] (bash .ci/run installs it)"


@pytest.fixture
def adapter(monkeypatch):
    pytest.importorskip("trl", reason=SKIP)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    return importlib.import_module("llamagym.integrations.trl")


class SeededEnv(gym.Env):
    """Three turns; the first observation is drawn from the reset seed; reward 1 per action 1."""

    observation_space = gym.spaces.Discrete(1000)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return int(self.np_random.integers(1000)), {}

    def step(self, action):
        self.t += 1
        return 1000 - self.t, float(action == 1), self.t >= 3, False, {}


class ParityAgent(Agent):
    """A reply's first character's code c is the action c mod 2, except when c mod 3 == 2: invalid (both occur)."""

    def get_system_prompt(self):
        return "Play."

    def format_observation(self, observation):
        return f"obs {observation}"

    def extract_action(self, response):
        code = ord(response[0]) if response else 2
        return None if code % 3 == 2 else code % 2


def test_missing_extra_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now raises ImportError
    monkeypatch.delitem(sys.modules, "llamagym.integrations.trl", raising=False)
    with pytest.raises(ImportError, match=r"pip install -e \.\[trl\]"):
        importlib.import_module("llamagym.integrations.trl")
    monkeypatch.delitem(sys.modules, "llamagym.integrations.trl", raising=False)


def test_core_never_imports_trl():
    import subprocess

    code = "import sys, llamagym, llamagym.envs; print('trl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_dataset_has_one_row_per_seed_and_prompts_name_it(adapter):
    data = adapter.episode_dataset(3, start=5)
    assert data["env_seed"] == [5, 6, 7]
    assert [adapter.seed_of(p) for p in data["prompt"]] == [5, 6, 7]
    with pytest.raises(ValueError, match="episode_dataset"):
        adapter.seed_of("What is 2 + 2?")


def test_episodes_interleave_replies_and_env_tokens_with_the_sampling_logprobs(adapter, model, tokenizer):
    rollout = adapter.EpisodeRollout(ParityAgent, SeededEnv, max_new_tokens=6)
    torch.manual_seed(0)
    episodes = rollout.play(model, tokenizer, [3, 3, 4], temperature=0.8)
    first = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Play."}, {"role": "user", "content": f"obs {SeededEnv().reset(seed=3)[0]}"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert episodes[0].prompt_ids == episodes[1].prompt_ids == list(first)  # one seed, one start
    assert episodes[2].prompt_ids != episodes[0].prompt_ids
    for e in episodes:
        assert e.turns == 3 and e.done and not e.truncated
        assert len(e.completion_ids) == len(e.env_mask) == len(e.logprobs)
        assert e.env_mask[0] == 1 and e.env_mask[-1] == 1  # starts and ends with the model's tokens
        changes = sum(a != b for a, b in zip(e.env_mask, e.env_mask[1:], strict=False))
        assert changes == 4  # reply, env, reply, env, reply
        env_text = tokenizer.decode([t for t, m in zip(e.completion_ids, e.env_mask, strict=True) if m == 0])
        assert "<|user|>obs 999<|end|><|assistant|>" in env_text and "obs 998" in env_text
        assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.env_mask, strict=True) if m == 0)
        # what TRL recomputes on the whole sequence is what the model sampled from
        ids = torch.tensor([e.prompt_ids + e.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(e.prompt_ids) - 1 : -1] / 0.8
        again = torch.log_softmax(logits, -1).gather(1, ids[0, len(e.prompt_ids) :, None]).squeeze(1)
        mask = torch.tensor(e.env_mask, dtype=torch.bool)
        torch.testing.assert_close(again[mask], torch.tensor(e.logprobs)[mask], atol=1e-4, rtol=1e-4)
        assert 0 <= e.invalid_replies <= 3 and 0 <= e.env_return <= 3


def test_token_budget_and_max_turns_truncate(adapter, model, tokenizer):
    short = adapter.EpisodeRollout(ParityAgent, SeededEnv, max_new_tokens=4, max_turns=2)
    assert all(e.turns == 2 and e.truncated for e in short.play(model, tokenizer, [0, 1]))
    tight = adapter.EpisodeRollout(ParityAgent, SeededEnv, max_new_tokens=4)
    for e in tight.play(model, tokenizer, [0], max_completion_tokens=20):
        assert e.truncated and e.turns < 3 and len(e.completion_ids) <= 20


def test_grpo_trainer_step_through_the_adapter(adapter, model, tokenizer, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    rollout = adapter.EpisodeRollout(ParityAgent, SeededEnv, max_new_tokens=6, format_penalty=0.5)
    outputs, rewards_seen = [], []

    def spy(prompts, trainer):
        out = rollout(prompts, trainer)
        outputs.append((list(prompts), out))
        return out

    def reward(completions, **kwargs):
        values = adapter.episode_return_reward(completions, **kwargs)
        rewards_seen.append((values, kwargs["invalid_replies"], kwargs["env_return"]))
        return values

    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=96,
        learning_rate=1e-2,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=adapter.episode_dataset(8),
        processing_class=tokenizer,
        rollout_func=spy,
    )
    trainer.train()

    ((prompts, out),) = outputs
    assert len(prompts) == 4 and prompts[0] == prompts[1] and prompts[2] == prompts[3]  # TRL repeats each row
    seeds = out["env_seed"]
    assert seeds[0] == seeds[1] and seeds[2] == seeds[3] and seeds[0] != seeds[2]  # a group shares its seed
    assert out["prompt_ids"][0] == out["prompt_ids"][1]
    for key in ("completion_ids", "logprobs", "env_mask"):
        assert [len(x) for x in out[key]] == [len(x) for x in out["completion_ids"]]
    assert all(0 in mask and mask[0] == 1 for mask in out["env_mask"])
    ((values, invalid, env_return),) = rewards_seen
    assert values == [r - 0.5 * n for r, n in zip(env_return, invalid, strict=True)]  # the agent's format penalty
    assert values == out["episode_return"]
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters())  # the step trained
    logged = trainer.state.log_history[0]
    assert "episode/invalid_replies" in logged and "episode/env_return" in logged


def test_greedy_decider_evaluates_the_trained_sequences_exactly(adapter, model, tokenizer):
    import llamagym.envs as suite
    from llamagym.envs.guess_number import GuessNumberAgent
    from llamagym.envs.suite import freeze

    size = {"n": 4, "k": 2}
    rollout = adapter.EpisodeRollout(
        GuessNumberAgent, "llamagym/GuessNumber-v0", fallback_action=1, max_new_tokens=4, env_kwargs=size
    )
    figures = suite.evaluate("guess_number", rollout.greedy_decider(model, tokenizer), **size)
    assert 0.0 <= figures["score"] <= 1.0 and 0.0 <= figures["invalid_rate"] <= 1.0
    # the decider's replies are those of a greedy rollout on the same tokens
    episodes = rollout.play(model, tokenizer, [0], greedy=True)
    decider = rollout.greedy_decider(model, tokenizer)
    env = gym.make("llamagym/GuessNumber-v0", **size)
    observation, _ = env.reset(seed=0)
    path, done = (observation,), False
    while not done:
        (action,) = decider([path])
        observation, _, done, _, _ = env.step(action)
        path = (*path, observation)
    decided = decider._done[freeze(path[:-1])]
    assert decided[1] + decided[2] == episodes[0].prompt_ids + episodes[0].completion_ids
