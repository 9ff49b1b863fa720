"""The control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler.

Each listens on 127.0.0.1 only, on a port picked free at start, and accepts only the
cluster's own certificates (etcd) or bearer tokens (the apiserver, Node+RBAC).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from functools import partial

import httpx

from testbed.kubernetes.cluster import credentials
from testbed.kubernetes.cluster.base import ClusterBase
from testbed.kubernetes.cluster.state import Daemon, answers_ok


class ControlPlane(ClusterBase):
    def _start_control_plane(
        self, c: credentials.Credentials, log: Callable[[str], None], t0: float
    ) -> tuple[Daemon, Daemon]:
        """etcd and the apiserver, each waited for; the controller manager and the
        scheduler started (their health is waited for once the nodes are up)."""
        s, d, bin_dir = self.state, self.state.directory, self.state.bin_dir
        p = s.ports
        etcd = self._spawn(
            "etcd",
            [
                str(bin_dir / "etcd"),
                f"--name=etcd-{s.id}",
                f"--data-dir={d / 'etcd'}",
                f"--listen-client-urls=https://127.0.0.1:{p.etcd_client}",
                f"--advertise-client-urls=https://127.0.0.1:{p.etcd_client}",
                f"--listen-peer-urls=https://127.0.0.1:{p.etcd_peer}",
                f"--initial-advertise-peer-urls=https://127.0.0.1:{p.etcd_peer}",
                f"--initial-cluster=etcd-{s.id}=https://127.0.0.1:{p.etcd_peer}",
                f"--initial-cluster-token={s.id}",
                "--initial-cluster-state=new",
                f"--cert-file={c.etcd[0]}",
                f"--key-file={c.etcd[1]}",
                f"--trusted-ca-file={c.ca}",
                "--client-cert-auth",
                f"--peer-cert-file={c.etcd[0]}",
                f"--peer-key-file={c.etcd[1]}",
                f"--peer-trusted-ca-file={c.ca}",
                "--peer-client-cert-auth",
                "--logger=zap",
            ],
        )
        tls = ssl.create_default_context(cafile=str(c.ca))
        tls.load_cert_chain(*c.etcd_client)
        tls_client = httpx.Client(verify=tls, timeout=2)
        self._wait_up(
            etcd,
            "etcd",
            lambda: (
                tls_client.get(f"https://127.0.0.1:{p.etcd_client}/health").json()["health"]
                == "true"
            ),
            30,
        )
        log(f"cluster: etcd up at {time.monotonic() - t0:.1f} s")

        apiserver = self._spawn(
            "kube-apiserver",
            [
                str(bin_dir / "kube-apiserver"),
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={p.apiserver}",
                f"--cert-dir={d / 'apiserver'}",
                f"--tls-cert-file={c.apiserver[0]}",
                f"--tls-private-key-file={c.apiserver[1]}",
                f"--etcd-servers=https://127.0.0.1:{p.etcd_client}",
                f"--etcd-cafile={c.ca}",
                f"--etcd-certfile={c.etcd_client[0]}",
                f"--etcd-keyfile={c.etcd_client[1]}",
                f"--token-auth-file={c.token_file}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                # The fleet's runner Pod is privileged (its mounts and loop devices);
                # no run's Pod is (tests check the step and guard hold nothing).
                "--allow-privileged=true",
                f"--service-account-key-file={c.service_account_pub}",
                f"--service-account-signing-key-file={c.service_account_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range=10.0.0.0/24",
                # Loopback cannot be a Service endpoint; without a reconciler nothing tries.
                "--endpoint-reconciler-type=none",
                f"--kubelet-client-certificate={c.apiserver_kubelet_client[0]}",
                f"--kubelet-client-key={c.apiserver_kubelet_client[1]}",
                f"--kubelet-certificate-authority={c.ca}",
                "--kubelet-preferred-address-types=InternalIP",
                "--profiling=false",
            ],
        )
        trust_ca = ssl.create_default_context(cafile=str(c.ca))
        api_http = httpx.Client(
            verify=trust_ca, headers={"Authorization": f"Bearer {s.admin_token}"}, timeout=2
        )
        self._wait_up(
            apiserver, "kube-apiserver", lambda: api_http.get(f"{c.server}/readyz").text == "ok", 90
        )
        log(f"cluster: kube-apiserver up at {time.monotonic() - t0:.1f} s")

        cm = self._spawn(
            "kube-controller-manager",
            [
                str(bin_dir / "kube-controller-manager"),
                f"--kubeconfig={d / 'controller-manager.kubeconfig'}",
                f"--authentication-kubeconfig={d / 'controller-manager.kubeconfig'}",
                f"--authorization-kubeconfig={d / 'controller-manager.kubeconfig'}",
                "--bind-address=127.0.0.1",
                f"--secure-port={p.controller_manager}",
                "--port=0",
                f"--tls-cert-file={c.controller_manager[0]}",
                f"--tls-private-key-file={c.controller_manager[1]}",
                f"--service-account-private-key-file={c.service_account_key}",
                f"--root-ca-file={c.ca}",
                "--use-service-account-credentials=true",
                "--leader-elect=false",
                "--profiling=false",
            ],
        )
        scheduler = self._spawn(
            "kube-scheduler",
            [
                str(bin_dir / "kube-scheduler"),
                f"--kubeconfig={d / 'scheduler.kubeconfig'}",
                f"--authentication-kubeconfig={d / 'scheduler.kubeconfig'}",
                f"--authorization-kubeconfig={d / 'scheduler.kubeconfig'}",
                "--bind-address=127.0.0.1",
                f"--secure-port={p.scheduler}",
                "--port=0",
                f"--tls-cert-file={c.scheduler[0]}",
                f"--tls-private-key-file={c.scheduler[1]}",
                "--leader-elect=false",
                "--profiling=false",
            ],
        )
        return cm, scheduler

    def _wait_control_plane(
        self, c: credentials.Credentials, cm: Daemon, scheduler: Daemon
    ) -> None:
        """The controller manager's and the scheduler's health, then the default service account."""
        p = self.state.ports
        health = httpx.Client(verify=ssl.create_default_context(cafile=str(c.ca)), timeout=2)
        for daemon, port in ((cm, p.controller_manager), (scheduler, p.scheduler)):
            url = f"https://127.0.0.1:{port}/healthz"
            self._wait_up(daemon, daemon.name, partial(answers_ok, health, url), 60)
        self._wait_default_service_account(60)

    def _wait_default_service_account(self, deadline_s: float) -> None:
        from kubernetes import client

        cm = next(x for x in self.state.daemons if x.name == "kube-controller-manager")
        with self.api_client() as api:
            core = client.CoreV1Api(api)
            self._wait_up(
                cm,
                "the default service account",
                lambda: core.read_namespaced_service_account("default", "default") is not None,
                deadline_s,
            )
