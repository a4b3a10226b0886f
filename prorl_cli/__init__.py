"""prorl: multi-turn LLM-agent rollouts as a service for RL training on Slurm clusters."""

__version__ = "0.1.0"
