"""Adapters that let existing RL trainers use prorl as their rollout engine (TRL, veRL).

Each module imports its trainer lazily, so prorl installs without them
(extras ``trl`` and ``verl``).
"""
