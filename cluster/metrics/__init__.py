"""What Tandem exports for Prometheus: the catalog of metrics, the collector that turns engine
statistics into samples, the registry each process keeps them in and the merge of all of them
that ``GET /metrics`` serves; Grafana dashboards over them. No Ray here; ``deployments/app_hub.py``
carries each process's text to the ingress."""
