"""What a replica exports for Prometheus: the catalog of metrics and the collector that
turns engine statistics into samples. No Ray here; ``deployments/metrics.py`` binds
the catalog to ``ray.serve.metrics``."""
