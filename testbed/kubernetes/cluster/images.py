"""Images on the nodes: the pause image made from the static binary, Docker's images copied in.

Every node's containerd gets the same images (saved once, imported by each), from
the host's Docker engine only: no registry is reached.
"""

from __future__ import annotations

import io
import json
import secrets
import subprocess
import tarfile
from pathlib import Path

from testbed.kubernetes.cluster.base import ClusterBase
from testbed.kubernetes.cluster.state import (
    ClusterError,
)


def pause_image_archive(pause_binary: Path, reference: str) -> bytes:
    """A one-layer `docker save`-format archive of the static pause binary (no builder needed)."""
    import hashlib

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("pause")
        data = pause_binary.read_bytes()
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        tar.addfile(info, io.BytesIO(data))
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        }
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps(
        [{"Config": config_name, "RepoTags": [reference], "Layers": ["layer/layer.tar"]}]
    ).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, blob in (
            ("layer/layer.tar", layer_bytes),
            (config_name, config),
            ("manifest.json", manifest),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(blob), 0
            tar.addfile(info, io.BytesIO(blob))
    return out.getvalue()


class Images(ClusterBase):
    def pin_by_digest(self, *references: str) -> dict[str, str]:
        """Each loaded image (`name:tag`) also named by its manifest's digest on every
        node, as a registry pull names it (`ctr import` names it by tag only, and the
        CRI finds an image only by a name it holds): {reference: name@sha256:<digest>}."""
        sockets = [
            self.state.containerd_socket,
            *(n.containerd_socket for n in self.state.extra_nodes),
        ]
        pinned: dict[str, str] = {}
        for reference in references:
            full = reference if "/" in reference else f"docker.io/library/{reference}"
            name = full.rpartition(":")[0]
            digests = set()
            for sock in sockets:
                listed = self.ctr("images", "ls", f"name=={full}", socket=sock).stdout.decode()
                rows = [line.split() for line in listed.splitlines()[1:] if line.strip()]
                if len(rows) != 1:
                    raise ClusterError(f"{full} is not loaded on {sock}: {listed!r}")
                digest = rows[0][2]
                self.ctr("images", "tag", "--force", full, f"{name}@{digest}", socket=sock)
                digests.add(digest)
            if len(digests) != 1:
                raise ClusterError(f"{full} has different digests on the nodes: {digests}")
            pinned[reference] = f"{name}@{digests.pop()}"
        return pinned

    def load_docker_images(self, *references: str) -> None:
        """Copy images from the host's Docker engine into every node (`docker save | ctr
        import`)."""
        if not self.state.extra_nodes:
            save = subprocess.Popen(["docker", "save", *references], stdout=subprocess.PIPE)
            try:
                result = self.ctr("images", "import", "-", stdin=save.stdout, check=False)
            finally:
                assert save.stdout is not None
                save.stdout.close()
                save.wait()
            if save.returncode != 0 or result.returncode != 0:
                raise ClusterError(
                    f"loading {references} failed: docker save exit {save.returncode}, "
                    f"ctr: {result.stderr.decode(errors='replace')[-500:]}"
                )
            return
        # Saved once, imported by each node's containerd.
        archive = self.state.directory / f"images-{secrets.token_hex(4)}.tar"
        try:
            subprocess.run(
                ["docker", "save", "-o", str(archive), *references], check=True, capture_output=True
            )
            sockets = [
                self.state.containerd_socket,
                *(n.containerd_socket for n in self.state.extra_nodes),
            ]
            for sock in sockets:
                result = self.ctr("images", "import", str(archive), check=False, socket=sock)
                if result.returncode != 0:
                    raise ClusterError(
                        f"loading {references} into {sock} failed: "
                        f"{result.stderr.decode(errors='replace')[-500:]}"
                    )
        except subprocess.CalledProcessError as exc:
            raise ClusterError(f"docker save {references} failed: {exc.stderr[-500:]!r}") from None
        finally:
            archive.unlink(missing_ok=True)
