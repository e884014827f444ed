"""The HTTP side: the Flask app built from one :class:`~gpu_exporter.web.services.Services`, its
middleware (limits, auth, headers) set in one place, the status page and the server."""
