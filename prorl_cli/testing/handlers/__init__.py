"""Handlers for tests, benchmarks and the quickstart's no-model modes; not served unless asked for.

A production node serves only the built-in domains (:mod:`prorl_cli.handlers`)
and the handlers it is given. Serve these with
``prorl serve node --handlers $(python -c 'import prorl_cli.testing as t; print(t.TEST_HANDLERS)')``,
``node.handler_paths`` or ``PRORL_HANDLER_PATHS``; :class:`prorl_cli.testing.Deployment`
and ``prorl quickstart --engine none|sim`` do it for you.

- ``noop``, ``test`` (:mod:`.testing`): the pipeline without a model;
- ``sim_agent``, ``dapo_sim``: simulated agents on the simulated engine;
- ``sandbox_demo``: one sandbox tool round;
- ``sandbox_bash``: given tool calls in a sandbox, beside a benign peer job (hostile-code tests).
"""
