"""The trainer side: :class:`RolloutClient` (blocking) and :class:`AsyncRolloutClient`."""

from prorl_cli.client.aio import AsyncRolloutClient
from prorl_cli.client.sync import RolloutClient

__all__ = ["AsyncRolloutClient", "RolloutClient"]
