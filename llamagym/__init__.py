"""llamagym: fine-tune LLM agents with online reinforcement learning in any Gymnasium environment."""

__version__ = "0.2.0"

from .agent import Agent
from .config import PPOConfig, ReplayConfig
from .policy import Policy
from .trainer import PPOTrainer

__all__ = ["Agent", "PPOConfig", "PPOTrainer", "Policy", "ReplayConfig", "__version__"]
