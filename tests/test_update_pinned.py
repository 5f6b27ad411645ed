"""Today's update, pinned: a fixed-seed GAE update on the tiny model must give the same parameters after a refactor.

Three paths: generate-mode turns with the default natural-gradient steps (no trust region there) and with AdamW
steps on 8-turn minibatches (`natural_gradient=False`), and scored turns (natural-gradient steps in a KL trust region,
then the value refit). Each runs two updates from fixed seeds, in float32. The golden
figures are the trainable parameters' move projected on fixed random directions; they were computed before the
package moved into `agent/`, `algos/` and `models/`, where the parameters also matched bit for bit. They are compared
to a relative 1e-4, so that another CPU's float32 kernels pass, while any change to what an update does fails.
"""

import pytest
import torch

from llamagym.algos.rollout import Episode, Turn
from llamagym.algos.trainer import PPOTrainer
from llamagym.config import PPOConfig
from llamagym.models.policy import Policy
from llamagym.models.tiny_random import build_tiny_model


def episodes(scored: bool, seed: int) -> list[Episode]:
    """12 episodes of 1-3 turns over 5 distinct prompts, rewards that differ by prompt and choice."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 250, (4 + p,), generator=g).tolist() for p in range(5)]
    candidates = [[40, 41], [42], [43, 44, 45]]
    result = []
    for e in range(12):
        turns = []
        for k in range(1 + e % 3):
            p = int(torch.randint(0, 5, (1,), generator=g))
            if scored:
                choice = int(torch.randint(0, 3, (1,), generator=g))
                turns.append(Turn(prompts[p], candidates[choice], 0.0, candidates=candidates, choice=choice))
            else:
                reply = torch.randint(3, 250, (2 + k,), generator=g).tolist()
                turns.append(Turn(prompts[p], reply, 0.0))
        turns[-1].reward = float(p % 2) - 0.5 * (turns[-1].choice == 1 if scored else k)
        result.append(Episode(turns))
    return result


def moves(scored: bool, natural: bool | None, lora_config, tokenizer) -> list[float]:
    torch.manual_seed(0)  # the LoRA and value-head initialisation
    policy = Policy(build_tiny_model(tokenizer, seed=0), lora_config, precision="fp32")
    # gamma 1.0: the default when the figures were computed (0.99 since the forty-third session; its discounting is
    # pinned by the GAE golden tests)
    config = PPOConfig(seed=0, natural_gradient=natural, gamma=1.0)
    trainer = PPOTrainer(policy, config, tokenizer.pad_token_id)
    before = torch.cat([p.detach().flatten() for p in policy.trainable_parameters()])
    for update in range(2):
        trainer.step(episodes(scored, seed=update))
    move = torch.cat([p.detach().flatten() for p in policy.trainable_parameters()]) - before
    directions = torch.randn(3, move.numel(), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return [float(move.double().norm()), *(directions @ move.double()).tolist()]


GOLDEN = {
    # natural steps became generate mode's default (fortieth session); until then the default AdamW steps, on a value
    # head fed detached features as now, gave 0.19350203305339012, -0.16816408018230267, -0.12256689114175584,
    # 0.021356186385946652. With natural_gradient=False the value loss also trains the adapter, as without LoRA.
    ("generate", None): [0.454965056818996, 0.6263452442010953, 0.13689635141097542, 0.5723755549073783],
    ("generate", False): [0.19349139889836214, -0.16889868672453273, -0.12404203450568876, 0.022609626435506167],
    # since scoring weighs the turns of an input met n times by 1/sqrt(n) by default (repeated_input_power None = 0.5);
    # with repeated_input_power=0.0 it gives the earlier figures 0.28109023144248885, -0.19330173783414706,
    # 0.06673698516241588, 0.42981762824241376 (checked when the default changed). Before those, a natural update
    # became one epoch by default; with ppo_epochs=2 it gives the earlier figures
    # 0.29079326793751104, -0.21910295490113704, 0.11694747098192358, 0.47996236703480044 (checked when the default
    # changed). Before those, the trust region bounded KL in nats instead of per bit of choice (these turns have 2-3
    # candidates): 0.2752272412077611, -0.25538523744039543, 0.13429003562099895, 0.43659634641264344
    ("score", None): [0.27380386164384424, -0.2922827942332563, 0.09863683621311825, 0.4397036180406646],
}


@pytest.mark.parametrize(
    "mode, natural",
    [("generate", None), ("generate", False), ("score", None)],
    ids=["generate", "generate-adamw", "score"],
)
def test_a_fixed_seed_update_moves_the_parameters_as_before(mode, natural, lora_config, tokenizer):
    expected = GOLDEN[(mode, natural)]
    assert moves(mode == "score", natural, lora_config, tokenizer) == pytest.approx(expected, rel=1e-4)
