"""Fakes and helpers that more than one test module uses, one module per role.

Tests import them from here, never from another ``test_*.py`` file:

* :mod:`tests.fakes.engines`: :class:`~tests.fakes.engines.CountingEngine`, an in-process engine that
  answers fixed ids after a delay and counts what it did;
* :mod:`tests.fakes.bridges`: :class:`~tests.fakes.bridges.ThreadBridge`, a real inference bridge on a
  thread of the test, serving such an engine;
* :mod:`tests.fakes.canned_http`: :class:`~tests.fakes.canned_http.CannedHTTPServer`, an HTTP server with
  one canned answer (malformed engine replies);
* :mod:`tests.fakes.broker_cluster`: :class:`~tests.fakes.broker_cluster.Cluster`, the broker's router
  as a plain object over real ``Node`` records;
* :mod:`tests.fakes.connections`: a raw ROUTER playing the broker's side of the wire.

Fakes a benchmark or script needs belong in :mod:`prorl_cli.testing` instead (installed with the package).
"""
