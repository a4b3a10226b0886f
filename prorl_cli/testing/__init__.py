"""Test and benchmark support that ships with prorl: real local deployments and the test handlers.

Import it from tests, ``benchmarks/`` and ``scripts/chaos`` (no ``sys.path``
edits): :class:`Deployment` is a :class:`~prorl_cli.embedded.LocalStack`
with short heartbeats and small pools whose nodes also serve the handlers in
:data:`TEST_HANDLERS` (``test``, ``noop``, ``dapo_sim``, ``sim_agent``,
``sandbox_demo``, ``sandbox_bash``), which production nodes do not serve.
"""

from prorl_cli.testing.harness import (
    DEFAULT_TEST_CONFIG,
    TEST_HANDLERS,
    Deployment,
    bare_dealer,
    fixed_port,
    merge_config,
    next_message,
)

__all__ = ["DEFAULT_TEST_CONFIG", "TEST_HANDLERS", "Deployment", "bare_dealer", "fixed_port", "merge_config", "next_message"]
