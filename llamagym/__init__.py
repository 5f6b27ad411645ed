"""llamagym: fine-tune LLM agents with online reinforcement learning in any Gymnasium environment."""

__version__ = "0.2.0"
