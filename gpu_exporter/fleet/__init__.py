"""Choosing GPUs across hosts: read the fleet from a store that speaks Prometheus' query API
(or from the hosts), rank every host with :func:`gpu_exporter.choose.rank.rank`, and claim on
the best host's own ``/choose``.

Plain Python and the standard library's HTTP, used by the client (``gpu-exporter choose
--prometheus``, ``client.choose(prometheus=…)``) and the server's ``/cluster/choose`` alike:

* :mod:`~gpu_exporter.fleet.inventory`: the fleet model (hosts, their GPUs and problems);
* :mod:`~gpu_exporter.fleet.queries`: the PromQL of the full read and the reasons counted;
* :mod:`~gpu_exporter.fleet.packing`: the packed series' layout, the one fast read;
* :mod:`~gpu_exporter.fleet.reading`: asking the store (or the hosts) and parsing the answers;
* :mod:`~gpu_exporter.fleet.ranking`: hosts ordered by what they can serve;
* :mod:`~gpu_exporter.fleet.placing`: the claim loop across hosts, with ``wait``.
"""
