"""Kubernetes (KubeRay) manifests of a Tandem cluster: settings, rendering, offline validation.

Never imports ray. ``config`` is imported by ``cluster.config``; the rest only by
``tandem k8s ...`` and the tests.
"""
