"""prorl's built-in task handlers, imported as ``prorl_cli.handlers``.

This folder is their source. It is the package ``prorl_cli.handlers``
everywhere: ``prorl_cli/handlers`` links here in a checkout and in an
editable install, and the wheel carries these files there. The node's
registry imports each module by that name, so a handler class has one
identity in the node, in tests and in examples.

The test and benchmark handlers (``test``, ``noop``, ``dapo_sim``,
``sim_agent``, ``sandbox_demo``) live in :mod:`prorl_cli.testing.handlers`
and are served only when named with ``--handlers`` / ``node.handler_paths``.
"""

if __name__ != "prorl_cli.handlers":
    # Imported as the top-level folder "handlers": a second copy of every handler class would exist.
    raise ImportError(f"import the built-in handlers as prorl_cli.handlers, not as {__name__!r}")
