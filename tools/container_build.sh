#!/usr/bin/env bash
# Build FedUQ's image (docker/Containerfile) on a machine of this project's kind (podman; no CUDA).
#
#   tools/container_build.sh [TAG]          # default feduq:<setup.cfg version>; prints each step's seconds
#
# FedUQ's wheel is built first (pip wheel --no-deps into dist/). BASE (default localhost/feduq-debian-base) is made
# from Debian's archive with mmdebstrap when it is missing. The host's pip configuration reaches the build as build
# secrets, never as a layer: its CA bundle (pip's `cert`, here the TLS proxy's) as `pipca`, the other global keys
# (find-links, timeout, index-url) as a pip.conf `pipconf`; a find-links folder is mounted read-only for the build's
# RUN steps only (podman build -v). Environment: PYTHON (a Python with pip for the wheel, default python3), BASE,
# TORCH_INDEX (PyTorch's CUDA index for a GPU build), ENGINE (podman), CONTAINERS_CONF, NO_CACHE=1 (a cold build).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="$(sed -n 's/^version *= *//p' "$REPO/setup.cfg")"
TAG="${1:-feduq:$VERSION}"
PYTHON="${PYTHON:-python3}"
ENGINE="${ENGINE:-podman}"
BASE="${BASE:-localhost/feduq-debian-base}"
WORK="$(mktemp -d /tmp/feduq-build.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
t() { local s=$SECONDS; "$@"; echo "[container_build] $(( SECONDS - s )) s: $*" | cut -c1-160 >&2; }

if [[ "$BASE" == localhost/feduq-debian-base ]] && ! "$ENGINE" image exists "$BASE"; then
  sources=/etc/apt/sources.list.d/debian.sources; [[ -f $sources ]] || sources=/etc/apt/sources.list
  t mmdebstrap --variant=minbase bookworm "$WORK/rootfs.tar" "$sources"
  t "$ENGINE" import --change 'CMD ["/bin/bash"]' "$WORK/rootfs.tar" feduq-debian-base
  rm -f "$WORK/rootfs.tar"
fi

rm -f "$REPO"/dist/feduq-*.whl
t "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$REPO/dist" "$REPO"

# the host's pip configuration as build secrets: `pip config list` ("global.key='value'", ":env:.key='value'"); its CA
# bundle (cert) as pipca, the other keys as one pip.conf (pipconf); local folders it names are mounted read-only
secrets=() mounts=()
"$PYTHON" - "$WORK" > "$WORK/mounts" <<'PY'
import os, re, subprocess, sys
work, conf = sys.argv[1], {}
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
for line in listed.splitlines():
    m = re.match(r"^(global|:env:)\.([a-z-]+)='(.*)'$", line)
    if m:
        conf[m.group(2)] = m.group(3)
ca = conf.pop("cert", "")
for key in ("constraint", "client-cert", "disable-pip-version-check"):
    conf.pop(key, None)
with open(os.path.join(work, "pip.conf"), "w") as f:
    f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in conf.items()))
if ca and os.path.isfile(ca):
    print(f"--secret=id=pipca,src={ca}")
seen = set()
for key in ("find-links", "extra-index-url", "index-url"):
    for item in conf.get(key, "").split():
        path = item[len("file://"):] if item.startswith("file://") else item
        path = path.rstrip("/").removesuffix("/simple")
        if path.startswith("/") and os.path.isdir(path) and path not in seen:
            seen.add(path)
            print(f"--volume={path}:{path}:ro")
PY
mapfile -t mounts < "$WORK/mounts"
secrets+=(--secret "id=pipconf,src=$WORK/pip.conf")
echo "[container_build] pip configuration for the build: $(grep -v '^\[' "$WORK/pip.conf" | tr '\n' ';')" >&2

t "$ENGINE" build ${NO_CACHE:+--no-cache} --network host -f "$REPO/docker/Containerfile" -t "$TAG" --build-arg "BASE=$BASE" \
  --build-arg "FEDUQ_VERSION=$VERSION" ${TORCH_INDEX:+--build-arg "TORCH_INDEX=$TORCH_INDEX"} \
  "${secrets[@]}" "${mounts[@]}" "$REPO"
"$ENGINE" image inspect "$TAG" --format '[container_build] {{.Id}} {{.Size}} bytes' >&2
