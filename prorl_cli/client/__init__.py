"""The trainer side: :class:`RolloutClient` (blocking) and :class:`AsyncRolloutClient`."""

from prorl_cli.client.aio import AsyncRolloutClient, WeightsUpdated
from prorl_cli.client.results import ResultStream, Submitted
from prorl_cli.client.sync import RolloutClient, SyncResultStream
from prorl_cli.protocol import ForgetOutcome

__all__ = ["AsyncRolloutClient", "ForgetOutcome", "ResultStream", "RolloutClient", "Submitted", "SyncResultStream", "WeightsUpdated"]
