"""`python -m testbed.kubernetes.cluster up|down|status`: a cluster for humans.

`up` leaves a detached cluster running until `down`; `down` works from the
clusters' folders alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from testbed.kubernetes.cluster.lifecycle import Cluster, running_clusters
from testbed.kubernetes.cluster.state import (
    ClusterError,
)

DESCRIPTION = (
    "A real Kubernetes cluster of one or two nodes on this host, on loopback and private "
    "state only."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.kubernetes.cluster", description=DESCRIPTION
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a cluster and leave it running")
    up.add_argument("--nodes", type=int, default=2, choices=(1, 2), help="how many nodes")
    up.add_argument(
        "--image", action="append", default=[], help="a Docker image to load (repeatable)"
    )
    down = sub.add_parser("down", help="stop clusters (all of this checkout's, or one)")
    down.add_argument("directory", nargs="?", type=Path)
    down.add_argument("--keep", action="store_true", help="keep the cluster's folder (logs)")
    sub.add_parser("status", help="list this checkout's clusters")
    args = parser.parse_args(argv)
    if args.command == "up":
        cluster = Cluster.start(images=tuple(args.image), nodes=args.nodes, detached=True)
        print(f"export KUBECONFIG={cluster.kubeconfig}")
        return 0
    if args.command == "down":
        failed = 0
        for directory in [args.directory] if args.directory else running_clusters():
            try:
                Cluster.attach(directory).stop(keep=args.keep)
                print(f"stopped {directory}")
            except ClusterError as e:
                print(e, file=sys.stderr)
                failed = 1
        return failed
    for directory in running_clusters():
        print(json.dumps(Cluster.attach(directory).status(), indent=1))
    return 0
