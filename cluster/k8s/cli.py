"""``tandem k8s render|validate``: KubeRay manifests from a settings file, checked offline."""

from __future__ import annotations

import argparse

from cluster.k8s.render import render_to
from cluster.k8s.validate import ManifestValidator


def cmd_k8s_render(args: argparse.Namespace) -> int:
    stale = render_to(args.config, args.out, kustomize=args.kustomize)
    apply = f"kubectl apply -k {args.out}/overlays/site" if args.kustomize else f"kubectl apply -f {args.out}/"
    print(f"rendered {args.config} into {args.out}/ ({apply})")
    for path in stale:
        print(f"note: {path} was not rendered from this config; delete it if it is stale")
    return 0


def cmd_k8s_validate(args: argparse.Namespace) -> int:
    validator = ManifestValidator.from_repo()
    num_documents = validator.validate_paths(args.paths)
    print(f"{num_documents} manifests valid (Kubernetes {validator.kubernetes_version}, "
          "KubeRay and prometheus-operator CRDs)")
    return 0


def add_k8s_parser(sub) -> None:
    k8s = sub.add_parser("k8s", help="KubeRay manifests").add_subparsers(dest="k8s", required=True)
    k8s_render = k8s.add_parser("render", help="write the RayService, monitoring and profiling Jobs of a config")
    k8s_render.add_argument("config", help="YAML settings file, e.g. configs/gpu-single.yaml")
    k8s_render.add_argument("--out", required=True, help="directory for the manifests, e.g. k8s/single-gpu")
    k8s_render.add_argument("--kustomize", action="store_true",
                            help="write a kustomize base/ and an overlays/site/ with a patch of every Ray pod")
    k8s_render.set_defaults(func=cmd_k8s_render)
    k8s_validate = k8s.add_parser("validate", help="check manifests offline against Kubernetes' and KubeRay's schemas")
    k8s_validate.add_argument("paths", nargs="*", default=["k8s"], help="YAML files or directories (default: k8s)")
    k8s_validate.set_defaults(func=cmd_k8s_validate)
