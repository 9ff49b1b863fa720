"""The cluster's CA, certificates, bearer tokens and kubeconfigs.

Every listener accepts only what this cluster issued: certificates from its own CA
(etcd, the kubelets) and its own bearer tokens (the apiserver); keys stay 0600 in
the cluster's folder.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from testbed.kubernetes import pki
from testbed.kubernetes.cluster.state import ClusterState


def _kubeconfig(server: str, ca: Path, token: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}
            ],
            "users": [{"name": "user", "user": {"token": token}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "user"}}],
            "current-context": "local",
        },
        indent=1,
    )


@dataclass(frozen=True)
class Credentials:
    """What the control plane and the kubelets are started with (paths in `pki/`)."""

    ca: Path
    server: str  # the apiserver's URL
    token_file: Path
    etcd: tuple[Path, Path]
    etcd_client: tuple[Path, Path]
    apiserver: tuple[Path, Path]
    apiserver_kubelet_client: tuple[Path, Path]
    kubelet: tuple[Path, Path]
    extra_kubelets: list[tuple[Path, Path]]
    controller_manager: tuple[Path, Path]
    scheduler: tuple[Path, Path]
    service_account_key: Path
    service_account_pub: Path


def issue(s: ClusterState) -> Credentials:
    """Make the CA, every certificate and token, and one kubeconfig per client."""
    d = s.directory
    pki_dir = d / "pki"
    pki_dir.mkdir(mode=0o700)
    ca = pki.CertificateAuthority(pki_dir, f"sandbox-test-cluster-{s.id}")
    etcd = ca.issue("etcd", "etcd", server=True, client=True)
    etcd_client = ca.issue("apiserver-etcd", "kube-apiserver", client=True)
    apiserver = ca.issue("apiserver", "kube-apiserver", server=True)
    kubelet_client = ca.issue("apiserver-kubelet", "kube-apiserver-kubelet-client", client=True)
    kubelet = ca.issue("kubelet", s.node_name, server=True)
    extra_certs = [
        ca.issue(f"kubelet-{n.name}", n.name, server=True, ip=n.name) for n in s.extra_nodes
    ]
    controller_manager = ca.issue("controller-manager", "kube-controller-manager", server=True)
    scheduler = ca.issue("scheduler", "kube-scheduler", server=True)
    sa_key, sa_pub = pki.service_account_keys(pki_dir)
    tokens = {
        "admin": (s.admin_token, "admin", "system:masters"),
        "controller-manager": (secrets.token_urlsafe(24), "system:kube-controller-manager", ""),
        "scheduler": (secrets.token_urlsafe(24), "system:kube-scheduler", ""),
        "kubelet": (secrets.token_urlsafe(24), f"system:node:{s.node_name}", "system:nodes"),
        **{
            f"kubelet-{n.name}": (
                secrets.token_urlsafe(24),
                f"system:node:{n.name}",
                "system:nodes",
            )
            for n in s.extra_nodes
        },
    }
    token_file = pki_dir / "tokens.csv"
    token_file.write_text(
        "".join(f'{tok},{user},{user},"{groups}"\n' for tok, user, groups in tokens.values())
    )
    token_file.chmod(0o600)
    server = f"https://127.0.0.1:{s.ports.apiserver}"
    for name, (tok, _u, _g) in tokens.items():
        path = d / f"{name}.kubeconfig"
        path.write_text(_kubeconfig(server, ca.cert_path, tok))
        path.chmod(0o600)
    return Credentials(
        ca=ca.cert_path,
        server=server,
        token_file=token_file,
        etcd=etcd,
        etcd_client=etcd_client,
        apiserver=apiserver,
        apiserver_kubelet_client=kubelet_client,
        kubelet=kubelet,
        extra_kubelets=extra_certs,
        controller_manager=controller_manager,
        scheduler=scheduler,
        service_account_key=sa_key,
        service_account_pub=sa_pub,
    )
