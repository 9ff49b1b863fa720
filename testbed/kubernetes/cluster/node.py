"""A node: its containerd (CRI, private image store) and its kubelet, on loopback.

Every node's containerd uses the same CNI config (one pod bridge in the private
network namespace, one IPAM store), so Pods of both nodes reach each other; each
kubelet accepts only the cluster CA's certificates.
"""

from __future__ import annotations

import json
from pathlib import Path

from testbed.kubernetes.cluster.base import ClusterBase
from testbed.kubernetes.cluster.state import (
    PAUSE_IMAGE,
    Daemon,
    ExtraNode,
    node_ready,
)


class Nodes(ClusterBase):
    def _start_containerd(self, bin_root: Path, node: ExtraNode | None = None) -> Daemon:
        """A node's containerd; every node's uses the same CNI config: one pod bridge and
        one IPAM store (host-local locks it), so Pods get distinct addresses on one link."""
        s, d = self.state, self.state.directory
        cni_bin = d / "cni" / "bin"
        cni_conf = d / "cni" / "conf"
        if node is None:
            self._write_cni(bin_root, cni_bin, cni_conf)
        cd = (d if node is None else node.folder) / "containerd"
        cd.mkdir(parents=True, exist_ok=True)
        socket = s.containerd_socket if node is None else node.containerd_socket
        runc = s.bin_dir / "runc"
        config = f"""
version = 2
root = "{cd / "root"}"
state = "{cd / "state"}"
disabled_plugins = [
  "io.containerd.internal.v1.opt",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp",
]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{cd / "runc"}"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
"""
        (cd / "config.toml").write_text(config)
        env_path = f"{s.bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        return self._spawn(
            "containerd" if node is None else f"containerd-{node.name}",
            [
                "env",
                f"PATH={env_path}",
                str(s.bin_dir / "containerd"),
                "--config",
                str(cd / "config.toml"),
            ],
            in_namespace=True,
            node="" if node is None else node.name,
        )

    def _write_cni(self, bin_root: Path, cni_bin: Path, cni_conf: Path) -> None:
        s, d = self.state, self.state.directory
        cni_bin.mkdir(parents=True)
        cni_conf.mkdir()
        for plugin in ("host-local", "loopback"):
            (cni_bin / plugin).symlink_to(bin_root / "cni" / plugin)
        # The bridge plugin runs in the private network namespace: the bridge and the
        # host ends of the veths exist there and nowhere on the host.
        wrapper = cni_bin / "bridge"
        wrapper.write_text(
            "#!/bin/sh\n"
            f'exec nsenter --net={d / "switch-netns"} -- {bin_root / "cni" / "bridge"} "$@"\n'
        )
        wrapper.chmod(0o755)
        (cni_conf / "10-sandbox.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "0.4.0",
                    "name": f"sandbox-k8s-{s.id}",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": s.bridge,
                            "isGateway": False,
                            "ipMasq": False,
                            "hairpinMode": False,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": s.pod_subnet}]],
                                "dataDir": str(d / "cni" / "ipam"),
                            },
                        }
                    ],
                },
                indent=1,
            )
        )

    def _start_kubelet(
        self, crt: Path, key: Path, ca: Path, pod_pids_limit: int, node: ExtraNode | None = None
    ) -> Daemon:
        s, d = self.state, self.state.directory
        kd = d / "kubelet" if node is None else node.folder / "kubelet"
        kd.mkdir(parents=True)
        resolv = d / "resolv.conf"
        resolv.write_text("")  # pods get no nameserver: nothing outside to resolve with
        name = s.node_name if node is None else node.name
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": name,
            "port": s.ports.kubelet if node is None else node.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": name,
            "healthzPort": s.ports.kubelet_healthz if node is None else node.healthz_port,
            "tlsCertFile": str(crt),
            "tlsPrivateKeyFile": str(key),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(ca)},
            },
            # Only holders of a certificate from the cluster's CA (the apiserver) get in.
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": s.cgroup_root if node is None else node.cgroup_root,
            "cgroupsPerQOS": True,
            "makeIPTablesUtilChains": False,
            "failSwapOn": False,
            "resolvConf": str(resolv),
            "podPidsLimit": pod_pids_limit,
            "hairpinMode": "none",
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "50Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
            },
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
        }
        (kd / "config.json").write_text(json.dumps(config, indent=1))
        kubeconfig = d / ("kubelet.kubeconfig" if node is None else f"kubelet-{name}.kubeconfig")
        socket = s.containerd_socket if node is None else node.containerd_socket
        return self._spawn(
            "kubelet" if node is None else f"kubelet-{name}",
            [
                str(s.bin_dir / "kubelet"),
                f"--config={kd / 'config.json'}",
                f"--kubeconfig={kubeconfig}",
                "--container-runtime=remote",
                f"--container-runtime-endpoint=unix://{socket}",
                f"--root-dir={kd / 'root'}",
                f"--cert-dir={kd / 'pki'}",
                f"--seccomp-profile-root={s.seccomp_root}",
                f"--volume-plugin-dir={kd / 'volume-plugins'}",
                f"--hostname-override={name}",
                f"--pod-infra-container-image={PAUSE_IMAGE}",
            ],
            in_namespace=True,
            node="" if node is None else node.name,
        )

    def _wait_node_ready(self, kubelet: Daemon, deadline_s: float, name: str) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        with self.api_client() as api:
            core = client.CoreV1Api(api)

            def ready() -> bool:
                try:
                    return node_ready(core.read_node(name))
                except ApiException as exc:
                    if exc.status == 404:  # not registered yet
                        return False
                    raise

            self._wait_up(kubelet, f"the node {name}", ready, deadline_s)
