"""Ray Serve deployments (the only package that imports ray).

Empty until the Ray Serve cluster lands (issue 6): app.py, ingress.py, replica.py,
router.py and autoscaling.py will build on ``cluster.engine.async_engine.AsyncEngine``.
"""
