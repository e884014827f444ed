"""``python -m gpu_exporter`` runs the same CLI as the ``gpu-exporter`` script."""

from gpu_exporter.cli import main

raise SystemExit(main())
