"""Building the step, guard and MCP images on this host, with no registry.

Layers, each tagged by a hash of its inputs so an unchanged layer is never
rebuilt: a base made by `mmdebstrap` from the host's apt sources (or any
registry image given as BASE_IMAGE), the step image, and on top of it the
guard image (the sandbox package, Python wheels built on the host; no
third-party server code) and the MCP image (the stdio MCP servers of
`images/mcp/mcp-servers.txt`, fetched on the host, and their relay). The
`:current` tags are what runs use;
`SANDBOX_IMAGE_TAG` names another tag instead, so several checkouts on one
engine (parallel CI jobs, a developer beside CI) never run each other's images.
Building works from a source checkout and from an installed wheel alike: the
inputs are the package's data (`sandbox.resources`), and the guard's copy of the
package is a wheel built from the checkout or repacked from the installed files.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import email.parser
import hashlib
import importlib.metadata
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

import docker.errors
from docker import DockerClient
from pydantic import BaseModel, ConfigDict

from sandbox.contracts.errors import EngineError, ImageMissingError
from sandbox.contracts.names import GUARD_IMAGE, MCP_IMAGE, STEP_IMAGE
from sandbox.resources import PACKAGED_DATA, images_dir, source_checkout

# The package's own files, found through its import path (a checkout's `sandbox/`, or
# an installed wheel's): the step side and the guard's code.
PACKAGE_DIR = Path(str(resources.files("sandbox")))
REPO_ROOT = PACKAGE_DIR.parent
CHECKOUT = source_checkout()
# Host-side build caches (the base's tarball, wheels, the MCP servers): the checkout's
# build/, or the user's cache for an installed wheel (never inside site-packages).
BUILD_DIR = (
    CHECKOUT / "build"
    if CHECKOUT is not None
    else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sandbox"
)
LABEL = "sandbox.image-inputs"
# Pins of what the guard image installs besides the package (images/constraints.txt).
CONSTRAINTS = "constraints.txt"
# Stdlib-only code run inside the images (the step's clients, the executor, the MCP
# relay): the step image installs this folder's contents, each under its own name.
STEP_SIDE = PACKAGE_DIR / "stepside"


def step_side_files() -> list[Path]:
    """The files the step image installs from `STEP_SIDE` (no caches, not its __init__)."""
    return sorted(
        p
        for p in STEP_SIDE.rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and p.suffix == ".py"
        and p != STEP_SIDE / "__init__.py"
    )


def stage_step_side(into: Path) -> None:
    """Copy what the step image installs into `into`, laid out as it is installed."""
    for path in step_side_files():
        target = into / path.relative_to(STEP_SIDE)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


class BuiltImages(BaseModel):
    # Built at its first use (`sandbox images build`), not by every run that imports this.
    model_config = ConfigDict(defer_build=True)

    base: str
    step: str
    guard: str
    mcp: str
    rebuilt: list[str]


def _hash_files(paths: Iterable[Path], extra: str = "") -> str:
    """A hash of the files' names and bytes; a name is taken where the file lives in both
    layouts (`images/...`, `sandbox/...`), so a checkout and a wheel of the same source
    hash alike and share the images."""
    data_root = images_dir().parent
    digest = hashlib.sha256(extra.encode())
    for path in sorted(paths):
        name: Path = path
        for root in (data_root, REPO_ROOT):
            if path.is_relative_to(root):
                name = path.relative_to(root)
                break
        digest.update(str(name).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _image_exists(client: DockerClient, ref: str) -> bool:
    try:
        client.images.get(ref)
    except docker.errors.ImageNotFound:
        return False
    return True


def _log(message: str) -> None:
    print(f"[images] {message}", file=sys.stderr, flush=True)


def _host_apt_sources() -> list[Path]:
    """The host's enabled Debian apt source files: mmdebstrap pastes them in."""
    found: list[Path] = []
    main = Path("/etc/apt/sources.list")
    if main.is_file() and main.read_text().strip():
        found.append(main)
    folder = Path("/etc/apt/sources.list.d")
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            if path.suffix in {".list", ".sources"} and "debian" in path.read_text():
                found.append(path)
    return found


def _host_suite() -> str:
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            return line.split("=", 1)[1].strip().strip('"')
    return "bookworm"


def _packages() -> list[str]:
    text = (images_dir() / "base" / "packages.txt").read_text()
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def build_base(client: DockerClient, rebuilt: list[str]) -> str:
    """`sandbox-base:<hash>` from mmdebstrap with the host's apt sources."""
    sources = _host_apt_sources()
    suite = _host_suite()
    tag = "sandbox-base:" + _hash_files(
        [images_dir() / "base" / "packages.txt", *sources], extra=suite
    )
    if _image_exists(client, tag):
        return tag
    if shutil.which("mmdebstrap") is None:
        raise EngineError(
            "mmdebstrap is not installed (apt-get install mmdebstrap), or pass BASE_IMAGE"
        )
    _log(f"building {tag} with mmdebstrap ({suite}); this takes about half a minute")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    tarball = BUILD_DIR / "base.tar"
    cmd = [
        "mmdebstrap",
        "--variant=minbase",
        "--include=" + ",".join(_packages()),
        "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        "--aptopt=Acquire::Retries=3",
        "--quiet",
        suite,
        str(tarball),
        *(str(s) for s in sources),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = result.stderr.strip().splitlines()[-5:]
        raise EngineError("mmdebstrap failed: " + " | ".join(tail))
    repository, _, version = tag.partition(":")
    client.api.import_image_from_file(str(tarball), repository=repository, tag=version)
    tarball.unlink()
    rebuilt.append(tag)
    return tag


def _build(
    client: DockerClient, context: Path, tag: str, buildargs: dict[str, str], rebuilt: list[str]
) -> str:
    if _image_exists(client, tag):
        return tag
    _log(f"building {tag}")
    try:
        client.images.build(
            path=str(context),
            tag=tag,
            buildargs=buildargs,
            rm=True,
            forcerm=True,
            pull=False,
            labels={LABEL: tag.partition(":")[2]},
        )
    except docker.errors.BuildError as exc:
        lines = [str(chunk.get("stream", "")).strip() for chunk in exc.build_log]
        tail = " | ".join(line for line in lines if line)[-800:]
        raise EngineError(f"building {tag} failed: {exc.msg}: {tail}") from None
    rebuilt.append(tag)
    return tag


def _package_sources() -> list[Path]:
    """What the guard's copy of the package is made of: its code, its declared metadata
    and the pins of its dependencies."""
    code = [
        p
        for p in PACKAGE_DIR.rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and p.relative_to(PACKAGE_DIR).parts[0] != PACKAGED_DATA.name
        and p.suffix in {".py", ".json", ".typed"}
    ]
    return [*code, _declared_metadata(), images_dir() / CONSTRAINTS]


def _declared_metadata() -> Path:
    """The checkout's pyproject.toml, or the installed distribution's METADATA."""
    if CHECKOUT is not None:
        return CHECKOUT / "pyproject.toml"
    return _installed_info() / "METADATA"


def _installed_info() -> Path:
    """The installed distribution's `.dist-info` folder (the one its RECORD lists)."""
    files = importlib.metadata.distribution("sandbox").files or []
    found = [f for f in files if f.name == "METADATA" and f.parent.name.endswith(".dist-info")]
    if len(found) != 1:
        raise EngineError("the installed sandbox distribution lists no single .dist-info")
    return Path(str(found[0].locate())).parent


def _wheels(into: Path) -> None:
    """The package's wheel and its dependencies', pinned by `images/constraints.txt`;
    the dependencies are built on the host once per requirement list and pins."""
    own = _own_wheel(into)
    constraints = images_dir() / CONSTRAINTS
    deps_dir = dependency_wheels(own)
    if not deps_dir.is_dir():
        _log("building dependency wheels on the host")
        deps_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=deps_dir.parent))
        _pip(
            [
                "wheel",
                "--quiet",
                "--wheel-dir",
                str(tmp),
                "--constraint",
                str(constraints),
                str(own),
            ]
        )
        for wheel in tmp.glob("sandbox-*.whl"):
            wheel.unlink()
        try:
            tmp.rename(deps_dir)
        except OSError:  # another build renamed the same set in first
            shutil.rmtree(tmp)
    for wheel in deps_dir.iterdir():
        shutil.copy2(wheel, into / wheel.name)


def dependency_wheels(own: Path) -> Path:
    """Where the wheels of `own`'s dependencies are cached: by its requirements and pins."""
    key = _hash_files([images_dir() / CONSTRAINTS], extra="\n".join(_requires(own)))
    return BUILD_DIR / "wheels" / f"deps-{key}"


def _own_wheel(into: Path) -> Path:
    """This package's wheel in `into`: built from the checkout, or repacked from the
    installed files when there is none (they are what the installed wheel held)."""
    if CHECKOUT is not None:
        _pip(["wheel", "--quiet", "--no-deps", "--wheel-dir", str(into), str(CHECKOUT)])
        (wheel,) = into.glob("sandbox-*.whl")
        return wheel
    return _repack_installed(into)


def _requires(wheel: Path) -> list[str]:
    """The wheel's `Requires-Dist` lines."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.HeaderParser().parsestr(archive.read(name).decode())
    return sorted(metadata.get_all("Requires-Dist") or [])


def _repack_installed(into: Path) -> Path:
    """A wheel of the installed package from the files its RECORD lists (the package and
    its `.dist-info`, without what the installer added), with a RECORD of their hashes."""
    dist = importlib.metadata.distribution("sandbox")
    info = _installed_info()
    added = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
    members = sorted(
        (f for f in dist.files or []
         if (f.parts[0] == PACKAGE_DIR.name and "__pycache__" not in f.parts)
         or (f.parts[0] == info.name and f.name not in added)),
        key=str,
    )  # fmt: skip
    tags = [
        line.split(":", 1)[1].strip()
        for line in (info / "WHEEL").read_text().splitlines()
        if line.startswith("Tag:")
    ]
    tag = tags[0] if len(tags) == 1 else "py3-none-any"
    wheel = into / f"{info.name.removesuffix('.dist-info')}-{tag}.whl"
    rows: list[tuple[str, str, str]] = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for member in members:
            data = Path(str(member.locate())).read_bytes()
            archive.writestr(str(member), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append((str(member), "sha256=" + digest.decode(), str(len(data))))
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows([*rows, (f"{info.name}/RECORD", "", "")])
        archive.writestr(f"{info.name}/RECORD", record.getvalue())
    return wheel


def _mcp_servers(into: Path) -> None:
    """The MCP image's servers (`images/mcp/mcp-servers.txt`), built on the host.

    `into/mcp-wheels` (wheels and a requirements.txt, installed with no index)
    and `into/mcp-node` (an npm prefix, install scripts off), cached in build/
    by the list's hash so an unchanged list is never fetched again."""
    listing = _mcp_listing()
    entries = [ln.split() for ln in listing.read_text().splitlines() if ln.strip()]
    pypi = [e[1] for e in entries if e[0] == "pypi" and len(e) == 2]
    npm = [e[1] for e in entries if e[0] == "npm" and len(e) == 2]
    cache = mcp_servers_cache()
    if not cache.is_dir():
        _log("fetching the MCP servers on the host (pip wheel, npm install)")
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=BUILD_DIR))
        (tmp / "mcp-wheels").mkdir()
        if pypi:
            _pip(["wheel", "--quiet", "--wheel-dir", str(tmp / "mcp-wheels"), *pypi])
        (tmp / "mcp-wheels" / "requirements.txt").write_text("".join(f"{p}\n" for p in pypi))
        (tmp / "mcp-node").mkdir()
        (tmp / "mcp-node" / "package.json").write_text('{"name": "sandbox-mcp", "private": true}\n')
        if npm:
            if shutil.which("npm") is None:
                raise EngineError("npm is missing (apt-get install npm); it fetches MCP servers")
            result = subprocess.run(
                ["npm", "install", "--omit=dev", "--ignore-scripts", "--no-audit", "--no-fund",
                 "--prefix", str(tmp / "mcp-node"), *npm],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if result.returncode != 0:
                raise EngineError("npm install failed: " + result.stderr.strip()[-800:])
        tmp.rename(cache)
    shutil.copytree(cache / "mcp-wheels", into / "mcp-wheels")
    shutil.copytree(cache / "mcp-node", into / "mcp-node", symlinks=True)


def _mcp_listing() -> Path:
    return images_dir() / "mcp" / "mcp-servers.txt"


def mcp_servers_cache() -> Path:
    """Where the MCP servers built on the host are cached: by their list's hash
    (`mcp-wheels/` holds every wheel they need, `mcp-node/` the npm prefix)."""
    return BUILD_DIR / ("mcp-" + _hash_files([_mcp_listing()]))


def _pip(args: list[str]) -> None:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    result = subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env, check=False
    )
    if result.returncode != 0:
        raise EngineError("pip " + args[0] + " failed: " + result.stderr.strip()[-800:])


def build_all(client: DockerClient, base_image: str | None = None) -> BuiltImages:
    """Build what changed; retag `:current`. Idempotent and quick when nothing changed."""
    rebuilt: list[str] = []
    base: str = base_image or build_base(client, rebuilt)
    base_id = str(client.images.get(base).id) if _image_exists(client, base) else base

    step_inputs = [
        *(images_dir() / "step").iterdir(),
        images_dir() / "base" / "packages.txt",
        *step_side_files(),
    ]
    step_tag = "sandbox-step:" + _hash_files(step_inputs, extra=base_id)
    guard_tag = "sandbox-guard:" + _hash_files(
        [*(images_dir() / "guard").iterdir(), *_package_sources()], extra=step_tag
    )
    mcp_tag = "sandbox-mcp:" + _hash_files([*(images_dir() / "mcp").iterdir()], extra=step_tag)
    with tempfile.TemporaryDirectory(prefix="sandbox-build-") as tmp:
        step_ctx = Path(tmp) / "step"
        shutil.copytree(images_dir() / "step", step_ctx)
        shutil.copy2(images_dir() / "base" / "packages.txt", step_ctx / "packages.txt")
        stage_step_side(step_ctx / "stepside")
        _build(client, step_ctx, step_tag, {"BASE_IMAGE": base}, rebuilt)
        client.images.get(step_tag).tag(STEP_IMAGE)

        if not _image_exists(client, guard_tag):
            guard_ctx = Path(tmp) / "guard"
            shutil.copytree(images_dir() / "guard", guard_ctx)
            (guard_ctx / "wheels").mkdir()
            _wheels(guard_ctx / "wheels")
            _build(client, guard_ctx, guard_tag, {"STEP_IMAGE": step_tag}, rebuilt)
        client.images.get(guard_tag).tag(GUARD_IMAGE)

        if not _image_exists(client, mcp_tag):
            mcp_ctx = Path(tmp) / "mcp"
            shutil.copytree(images_dir() / "mcp", mcp_ctx)
            _mcp_servers(mcp_ctx)
            _build(client, mcp_ctx, mcp_tag, {"STEP_IMAGE": step_tag}, rebuilt)
        client.images.get(mcp_tag).tag(MCP_IMAGE)
    keep = {step_tag, guard_tag, mcp_tag, STEP_IMAGE, GUARD_IMAGE, MCP_IMAGE}
    _prune_stale_tags(client, keep=keep)
    return BuiltImages(base=base, step=step_tag, guard=guard_tag, mcp=mcp_tag, rebuilt=rebuilt)


_HASH_TAG = re.compile(r":[0-9a-f]{16}$")


def _prune_stale_tags(client: DockerClient, keep: set[str]) -> None:
    """Old hash tags of our images go; an image a container still uses stays, and so
    does one that another checkout's named tag (`SANDBOX_IMAGE_TAG`) still points at."""
    for repository in ("sandbox-step", "sandbox-guard", "sandbox-mcp"):
        for image in client.images.list(name=repository):
            if any(not _HASH_TAG.search(tag) for tag in image.tags if tag not in keep):
                continue
            for tag in image.tags:
                if tag not in keep:
                    with contextlib.suppress(docker.errors.APIError):
                        client.images.remove(tag)


def require(client: DockerClient, ref: str) -> str:
    """The image id of `ref`, or a clear error saying how to build it."""
    try:
        image_id = str(client.images.get(ref).id)
    except docker.errors.ImageNotFound:
        raise ImageMissingError(
            f"image {ref} is not built on this host; run `make images` (or `sandbox images build`)"
        ) from None
    return image_id
