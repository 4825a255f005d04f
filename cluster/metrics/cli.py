"""``tandem dashboards render|push``: the Grafana dashboards as JSON files, or uploaded."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cluster.metrics.dashboards import dashboards, render
from cluster.metrics.grafana_push import GrafanaPushError, push_dashboards


def cmd_dashboards_render(args: argparse.Namespace) -> int:
    for path in render(Path(args.out), Path(args.configmap) if args.configmap else None):
        print(f"wrote {path}")
    return 0


def cmd_dashboards_push(args: argparse.Namespace) -> int:
    url = args.url or os.environ.get("GRAFANA_URL")
    if not url:
        raise ValueError("--url (or GRAFANA_URL) is needed: Grafana's base URL, e.g. http://localhost:3000")
    token = args.token or os.environ.get("GRAFANA_TOKEN", "")
    try:
        pushed = push_dashboards(url, token, list(dashboards().values()), folder=args.folder)
    except GrafanaPushError as err:
        print(f"tandem: error: {err}", file=sys.stderr)
        return 1
    for dashboard in pushed:
        print(f"pushed {dashboard.title!r} (uid {dashboard.uid}, version {dashboard.version}): {dashboard.url}")
    return 0


def add_dashboards_parser(sub) -> None:
    dash = sub.add_parser("dashboards", help="Tandem's Grafana dashboards").add_subparsers(dest="dashboards",
                                                                                           required=True)
    render = dash.add_parser("render", help="write the dashboards' JSON (and the sidecar ConfigMap)")
    render.add_argument("--out", default="k8s/grafana", help="directory for the JSON files")
    render.add_argument("--configmap", help="also write the Grafana sidecar ConfigMap here "
                        "(k8s/monitoring/grafana-dashboards-configmap.yaml)")
    render.set_defaults(func=cmd_dashboards_render)
    push = dash.add_parser("push", help="create or update the dashboards in a Grafana through its HTTP API")
    push.add_argument("--url", help="Grafana's base URL (default: $GRAFANA_URL)")
    push.add_argument("--token", help="service account token or API key, Editor role (default: $GRAFANA_TOKEN)")
    push.add_argument("--folder", default="Tandem", help="folder to put them in, created if missing "
                      "(\"\" = General)")
    push.set_defaults(func=cmd_dashboards_push)
