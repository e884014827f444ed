"""Choosing GPUs across hosts: read the fleet from a store that speaks Prometheus' query API
(or from the hosts), rank every host with :func:`gpu_exporter.choose.rank.rank`, and claim on
the best host's own ``/choose``.

Plain Python and the standard library's HTTP, used by the client (``gpu-exporter choose
--prometheus``, ``client.choose(prometheus=…)``) and the server's ``/cluster/choose`` alike.
"""
