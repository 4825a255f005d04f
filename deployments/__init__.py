"""Ray Serve deployments (the only package that imports ray).

``app.build_app`` makes one ``replica.TandemReplica`` deployment per replica group
(each with ``router.TandemRequestRouter``) behind the OpenAI ``ingress.OpenAIIngress``;
``streams`` turns replica deltas into OpenAI responses; ``local.start_local`` is
``tandem serve``; ``bench_router`` compares routing policies on a local cluster.
"""
