"""The types every layer above shares: requests, sampling parameters, outputs, the scheduled
batch and the choice of device. Nothing here imports another package of ``cluster`` but
``cluster.structured`` (a request's grammar)."""
