"""The agent side: what a user subclasses, and how it turns observations into prompts and replies into actions.

- `agent.py`            the abstract `Agent`: three hooks and the loop API (`act`, `assign_reward`, `terminate_episode`)
- `chat.py`             conversations rendered with the tokenizer's chat template, within a token budget
- `choosing.py`         a batch of observations -> prompts and candidates (token ids) -> the agent's action mode
                        chooses (`algos/modes/`) -> replies parsed; the `Actor` is what the modes act with
- `parsing.py`          a model reply -> an env action (JSON, the user's `extract_action`, else a fallback)
- `running_episodes.py` each env's running episode, and its form inside a checkpoint
- `demos.py`            demonstrations (chat transcripts) for the SFT warm-start
- `checkpoint.py`       crash-safe checkpoints of everything a resumed run needs (`Agent.state_dict()` and the weights)
"""

from .agent import Agent

__all__ = ["Agent"]
