#!/usr/bin/env bash
# Build, once, everything the local test cluster runs, into build/kubernetes/<version>/:
#   bin/   kube-apiserver kube-controller-manager kube-scheduler kubelet (from Debian's
#          `kubernetes` source package: Debian ships no binaries of them), the static
#          `pause` (the tree's build/pause/linux/pause.c), and etcd, containerd, its
#          runc shim, ctr and runc, unpacked from their Debian packages;
#   cni/   Debian's containernetworking-plugins;
#   VERSIONS  the exact Debian versions used.
# A complete folder is reused as it is: the second run costs nothing and touches no network.
#
# What it changes on the host: it installs the build tools (golang-go, rsync, jq, gcc,
# libc6-dev, dpkg-dev) with apt-get when missing. The run-time packages are NOT installed:
# `apt-get download` plus `dpkg-deb -x` into the cache, so no service (a system etcd or
# containerd) is enabled or started by a package script. Apt's view of the source
# packages is private (own sources list, lists and cache under the work folder), so the
# system's apt configuration and lists stay as they are.
# Prints the version folder on stdout; everything else goes to stderr.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-1.20.2}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${K8S_BUILD_CACHE:-$ROOT/build/kubernetes}
OUT=$CACHE/$K8S_VERSION
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet)
DEBS=(etcd-server containerd runc containernetworking-plugins)

log() { echo "kubernetes-build: $*" >&2; }

complete() {
  [ -f "$OUT/VERSIONS" ] || return 1
  local b
  for b in "${BINARIES[@]}" pause etcd containerd containerd-shim-runc-v2 ctr runc; do
    [ -x "$OUT/bin/$b" ] || return 1
  done
  [ -x "$OUT/cni/bridge" ] && [ -x "$OUT/cni/host-local" ] && [ -x "$OUT/cni/loopback" ]
}

if complete; then echo "$OUT"; exit 0; fi

[ "$(id -u)" -eq 0 ] || { log "needs root (apt-get, and the cluster itself)"; exit 2; }
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if complete; then echo "$OUT"; exit 0; fi

need=()
command -v go >/dev/null 2>&1 || need+=(golang-go)
command -v rsync >/dev/null 2>&1 || need+=(rsync)
command -v jq >/dev/null 2>&1 || need+=(jq)
command -v gcc >/dev/null 2>&1 || need+=(gcc)
[ -f /usr/lib/x86_64-linux-gnu/libc.a ] || [ -n "$(find /usr/lib -name libc.a -print -quit)" ] || need+=(libc6-dev)
command -v dpkg-source >/dev/null 2>&1 || need+=(dpkg-dev)
command -v make >/dev/null 2>&1 || need+=(make)
if [ "${#need[@]}" -gt 0 ]; then
  log "installing build tools: ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

WORK=$CACHE/.work-$K8S_VERSION
rm -rf "$WORK"
mkdir -p "$WORK/apt/lists/partial" "$WORK/apt/cache/archives/partial" "$WORK/src" "$WORK/debs"
. /etc/os-release
SUITE=${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}
KEY=/usr/share/keyrings/debian-archive-keyring.gpg
{
  for suite in "$SUITE" "$SUITE-updates"; do
    echo "deb     [signed-by=$KEY] http://deb.debian.org/debian $suite main"
    echo "deb-src [signed-by=$KEY] http://deb.debian.org/debian $suite main"
  done
  echo "deb     [signed-by=$KEY] http://deb.debian.org/debian-security $SUITE-security main"
  echo "deb-src [signed-by=$KEY] http://deb.debian.org/debian-security $SUITE-security main"
} >"$WORK/apt/sources.list"
APT=(apt-get -q
  -o "Dir::Etc::SourceList=$WORK/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$WORK/apt/lists" -o "Dir::Cache=$WORK/apt/cache"
  -o APT::Sandbox::User=root)
log "reading Debian's package lists (private copy)"
"${APT[@]}" update >/dev/null

log "fetching the kubernetes source and the run-time packages"
(cd "$WORK/src" && "${APT[@]}" source kubernetes >/dev/null 2>"$WORK/src/apt-source.log") ||
  { tail -n 20 "$WORK/src/apt-source.log" >&2; exit 1; }
(cd "$WORK/debs" && "${APT[@]}" download "${DEBS[@]}" >/dev/null)
TREE=$(find "$WORK/src" -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -n 1)
[ -n "$TREE" ] || { log "no source tree was unpacked"; exit 1; }
DSC_VERSION=$(basename "$(ls "$WORK"/src/kubernetes_*.dsc)" .dsc | sed 's/^kubernetes_//')
case "$DSC_VERSION" in
  *"$K8S_VERSION"-*) ;;
  *) log "Debian's kubernetes source is $DSC_VERSION, not $K8S_VERSION: set K8S_VERSION"; exit 1 ;;
esac

STAGE=$CACHE/.stage-$K8S_VERSION
rm -rf "$STAGE"
mkdir -p "$STAGE/bin" "$STAGE/cni"
for deb in "$WORK"/debs/*.deb; do dpkg-deb -x "$deb" "$WORK/debs/root"; done
R=$WORK/debs/root
cp "$R/usr/bin/etcd" "$R/usr/bin/containerd" "$R/usr/bin/containerd-shim-runc-v2" \
  "$R/usr/bin/ctr" "$R/usr/sbin/runc" "$STAGE/bin/"
cp "$R"/usr/lib/cni/* "$STAGE/cni/"

log "building ${BINARIES[*]} (GOPATH mode, offline; several minutes)"
mkdir -p "$TREE/.go/src/k8s.io"
ln -sfn ../../.. "$TREE/.go/src/k8s.io/kubernetes"
WHAT=""
for b in "${BINARIES[@]}"; do WHAT+="cmd/$b "; done
(
  cd "$TREE/.go/src/k8s.io/kubernetes"
  export GOPATH=$TREE/.go GOCACHE=$WORK/gocache GOPROXY=off CGO_ENABLED=0
  export GO111MODULE=off KUBE_GIT_VERSION=v$K8S_VERSION KUBE_GIT_TREE_STATE=clean
  nice -n 10 make WHAT="$WHAT" >"$WORK/make.log" 2>&1
) || { tail -n 30 "$WORK/make.log" >&2; exit 1; }
for b in "${BINARIES[@]}"; do
  cp "$TREE/_output/local/bin/linux/amd64/$b" "$STAGE/bin/$b"
done

log "building the static pause"
gcc -Os -static -o "$STAGE/bin/pause" "$TREE/build/pause/linux/pause.c"
strip "$STAGE/bin/pause" 2>/dev/null || true

{
  echo "kubernetes $DSC_VERSION"
  for deb in "$WORK"/debs/*.deb; do dpkg-deb --show --showformat='${Package} ${Version}\n' "$deb"; done
} >"$STAGE/VERSIONS"
rm -rf "$OUT"
mv "$STAGE" "$OUT"
rm -rf "$WORK"
log "done: $OUT ($(du -sh "$OUT" | cut -f1))"
echo "$OUT"
