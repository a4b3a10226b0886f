"""Task domains: the scorers, tools and settings behind the ``math``, ``code``, ``swe`` and
``search`` handlers in ``handlers/`` (see docs/domains.md).

Nothing here is known to the broker, the node or the client: a handler file
imports what it needs from these modules, and the node runs it like any other.
"""
