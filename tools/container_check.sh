#!/usr/bin/env bash
# A provisioned FedUQ federation in containers, end to end, on one machine of this project's kind (developer tool;
# not part of .ci/run). Run as root (it installs podman from Debian's archive when missing):
#
#   tools/container_check.sh                  # reuses feduq:<version> when present; REBUILD=1 builds it again
#
# Steps (each one's seconds are printed at the end): install podman; build or reuse the image
# (tools/container_build.sh); provision a project with mutual TLS inside the image (feduq project --docker-image,
# nvflare provision, feduq prepare-site); a private podman network (--internal: no route out, no published port);
# the server and two polyp sites started with `feduq container start` (data read-only at /data); a tiny FedAvg job
# submitted from an admin container (feduq run --env prod), its per-client table printed; a second job in which one
# site's container is killed in round 1: the server must name the site within the round timeout; then the refusals
# of `feduq container check` (missing data, image without FedUQ, another project's kit, a GPU where none is).
# Everything it made (containers, network, kits) is removed on exit, also on failure; images stay.
#
# Environment: DATA (the data root holding polyp/<center>/, default ../shared/data of the clone), IMAGE
# (default feduq:<version>), PYTHON (a Python for the feduq verb on the host, default python3), REBUILD=1,
# ROUND_TIMEOUT (seconds, default 60), KEEP=1 (keep the kits for a look).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="$(sed -n 's/^version *= *//p' "$REPO/setup.cfg")"
IMAGE="${IMAGE:-feduq:$VERSION}"
DATA="$(cd "${DATA:-$REPO/../shared/data}" && pwd)"
PYTHON="${PYTHON:-python3}"
ROUND_TIMEOUT="${ROUND_TIMEOUT:-60}"
SITES=(CVC-ClinicDB ETIS-LaribPolypDB)
KILLED=ETIS-LaribPolypDB
PROJECT=feduq_check
SERVER=feduq-server.check
ADMIN=admin@feduq.check
TAG="cc$$"
NET="feduq-check-$$"
WORK="$(mktemp -d /tmp/feduq-container-check.XXXXXX)"
KITS="$WORK/prov/$PROJECT/prod_00"
UIDGID=10001:10001  # the image's user (docker/Containerfile): owns the kits, so the containers run as it
declare -a TIMES=()
STEP_T0=$SECONDS
step() { TIMES+=("$(printf '%5d s  %s' $((SECONDS - STEP_T0)) "$1")"); STEP_T0=$SECONDS; }
say() { echo "[container_check] $*"; }

if [[ -z "${CONTAINERS_CONF:-}" ]]; then  # this kind of machine: runc, cgroupfs, ulimits FLARE's gRPC needs
  export CONTAINERS_CONF="$WORK/containers.conf"
  printf '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n' \
    > "$CONTAINERS_CONF"
fi
FORWARD0="$(sysctl -n net.ipv4.ip_forward 2>/dev/null || echo 1)"
cleanup() {
  local rc=$?
  podman ps -a --format '{{.Names}}' 2>/dev/null | grep "^$TAG-" | xargs -r podman rm -f -t 0 >/dev/null 2>&1 || true
  podman network rm -f "$NET" >/dev/null 2>&1 || true
  # netavark turned ip_forward on for the network: back to what it was when no other podman network is left
  if [[ "$FORWARD0" == 0 ]] && [[ "$(podman network ls --format '{{.Name}}' 2>/dev/null | grep -vc '^podman$')" == 0 ]]; then
    sysctl -qw net.ipv4.ip_forward=0 || true
  fi
  if [[ "${KEEP:-0}" == 1 ]]; then say "kept $WORK"; else rm -rf "$WORK"; fi
  exit $rc
}
trap cleanup EXIT

if ! command -v podman >/dev/null || ! command -v iptables >/dev/null; then
  apt-get install -y -q podman buildah runc crun netavark aardvark-dns catatonit mmdebstrap iptables uidmap >/dev/null
fi
step "install podman (apt, when missing)"

if [[ "${REBUILD:-0}" == 1 ]] || ! podman image exists "$IMAGE"; then
  PYTHON="$PYTHON" "$REPO/tools/container_build.sh" "$IMAGE"
fi
podman image inspect "$IMAGE" --format "[container_check] image $IMAGE: {{.Size}} bytes, FedUQ {{index .Config.Labels \"io.feduq.version\"}}"
step "build or reuse the image $IMAGE"

# the image holds none of this host's own CA certificates (a TLS proxy's, given to pip only as a build secret)
podman run --rm --network none "$IMAGE" sh -c 'cat /etc/ssl/certs/ca-certificates.crt
  for f in /etc/pip.conf /etc/xdg/pip /root/.config/pip /run/secrets/pipca /run/secrets/pipconf; do
    [ -e "$f" ] && echo "PRESENT $f"; done; true' > "$WORK/image_ca.txt"
"$PYTHON" - "$WORK/image_ca.txt" /usr/local/share/ca-certificates/*.crt <<'PY'
import re, sys
pem = lambda text: set(re.findall(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", text, re.S))
image = open(sys.argv[1]).read()
host = [p for p in sys.argv[2:] if not p.endswith("*.crt")]
leaked = [p for p in host if pem(open(p).read()) & pem(image)]
extra = re.findall(r"^PRESENT (\S+)$", image, re.M)
if leaked or extra:
    sys.exit(f"[container_check] the image holds the host's {leaked + extra}")
print(f"[container_check] the image holds none of the host's {len(host)} local CA certificate(s), no pip configuration")
PY
step "the image holds no host CA certificate and no pip configuration"

# the project, provisioned inside the image (the host needs no FLARE): the template with docker_image, two sites
chown "$UIDGID" "$WORK"
in_image() { podman run --rm --network none --user "$UIDGID" -v "$WORK:/work" -w /work "$IMAGE" "$@"; }
in_image bash -c "feduq project --docker-image $IMAGE --out /work/project.yml >/dev/null && python3 -c '
import yaml
p = yaml.safe_load(open(\"/work/project.yml\"))
p[\"name\"] = \"$PROJECT\"
p[\"participants\"] = [{\"name\": \"$SERVER\", \"type\": \"server\", \"org\": \"hub\", \"fed_learn_port\": 8002}] + [
    {\"name\": s, \"type\": \"client\", \"org\": f\"org{i}\"} for i, s in enumerate(\"${SITES[*]}\".split())] + [
    {\"name\": \"$ADMIN\", \"type\": \"admin\", \"org\": \"hub\", \"role\": \"project_admin\"}]
yaml.safe_dump(p, open(\"/work/project.yml\", \"w\"), sort_keys=False)
' && nvflare provision -p /work/project.yml -w /work/prov >/dev/null \
  && feduq prepare-site /work/prov/$PROJECT/prod_00/$SERVER --server >/dev/null \
  && for s in ${SITES[*]}; do feduq prepare-site /work/prov/$PROJECT/prod_00/\$s >/dev/null; done"
grep -q "DOCKER_IMAGE=$IMAGE" "$KITS/${SITES[0]}/startup/docker.sh"
say "kits: $(ls "$KITS" | tr '\n' ' ')(each with startup/docker.sh naming $IMAGE)"
step "provision the project with mutual TLS (in the image)"

podman network create --internal "$NET" >/dev/null
step "private podman network $NET (--internal, nothing published)"

# the feduq verb on the host: this clone's package (a folder named feduq -> custom/), standard library + podman
mkdir -p "$WORK/pkg" && ln -s "$REPO/custom" "$WORK/pkg/feduq"
verb() { PYTHONPATH="$WORK/pkg" "$PYTHON" -m feduq container "$@"; }
verb start "$KITS/$SERVER" --network "$NET" --project "$PROJECT" --name "$TAG-server" | tail -1
for s in "${SITES[@]}"; do
  verb start "$KITS/$s" --data "$DATA" --network "$NET" --project "$PROJECT" --name "$TAG-$s" | tail -1
done
joined() { grep -c "Client: New client .* joined" "$KITS/$SERVER/log.txt" 2>/dev/null || true; }
for _ in $(seq 1 120); do [[ "$(joined)" -ge ${#SITES[@]} ]] && break; sleep 1; done
[[ "$(joined)" -ge ${#SITES[@]} ]] || { say "sites did not join in 120 s"; tail -20 "$KITS/$SERVER/log.txt"; exit 1; }
step "server and ${#SITES[@]} sites started in containers, sites joined"

admin() {
  podman run --rm --name "$TAG-admin-$1" --network "$NET" --user "$UIDGID" -v "$KITS/$ADMIN:/workspace/admin" \
    -w /workspace/admin "$IMAGE" feduq run fedavg --env prod --startup-kit /workspace/admin --username "$ADMIN" \
    --sites "$(IFS=,; echo "${SITES[*]}")" --image-size 32 --max-items 6 --allow-listed "${@:2}"
}
admin job1 --num-rounds 1 --timeout 600 > "$WORK/job1.txt" 2>&1 || { tail -40 "$WORK/job1.txt"; exit 1; }
say "per-client table of the FedAvg job (from the admin container):"
grep '^|' "$WORK/job1.txt"
step "tiny FedAvg job (1 round, 32 px, 6 items) submitted from the admin container, FINISHED"

# a site's container killed in round 1: the server must name it within the round timeout
job2="$(admin job2 --num-rounds 3 --min-clients 1 --train-timeout "$ROUND_TIMEOUT" --no-wait 2>&1 \
  | sed -n 's/^submitted job //p')"
[[ -n "$job2" ]] || { say "the second job was not submitted"; exit 1; }
log2="$KITS/$SERVER/$job2/log.txt"
# why a job ended: FEDUQ_JOB_FAILED in its stored workspace (the server keeps the job store in <kit>/storage/)
job_failure() {
  podman exec "$TAG-server" python3 -c "import io, re, sys, zipfile
z = zipfile.ZipFile(io.BytesIO(open('/tmp/nvflare/jobs-storage/$1/workspace', 'rb').read()))
print(''.join(re.findall(r'FEDUQ_JOB_FAILED .*', z.read('log.txt').decode()))[:600])" 2>/dev/null || true
}
seen=0
for _ in $(seq 1 300); do
  grep -q "FedAvg round 1 started" "$log2" 2>/dev/null && break
  if [[ -f "$log2" ]]; then seen=1; elif (( seen )); then break; fi  # the job's folder went: it ended
  sleep 1
done
grep -q "FedAvg round 1 started" "$log2" 2>/dev/null || { say "job $job2 ended before round 1: $(job_failure "$job2")"; exit 1; }
podman kill "$TAG-$KILLED" >/dev/null
killed_at=$SECONDS
named=""
while (( SECONDS - killed_at < ROUND_TIMEOUT + 60 )); do
  named="$(grep -m1 -E "FEDUQ_SITE_GONE site '$KILLED'|no valid answer from \[.*'$KILLED'" "$log2" || true)"
  [[ -n "$named" ]] && break
  sleep 1
done
[[ -n "$named" ]] || { say "the server did not name $KILLED within $((ROUND_TIMEOUT + 60)) s"; exit 1; }
say "site container $KILLED killed; the server named it after $((SECONDS - killed_at)) s (round timeout $ROUND_TIMEOUT s):"
named="${named#*] - }"; echo "    ${named:0:300}"
step "site container killed in round 1, named by the server"

# bad input: one line each, before any container starts (exit 2)
refused() { local out; if out="$(verb check "$@" 2>&1)"; then say "NOT refused: $*"; exit 1; fi; echo "    ${out}"; }
say "refusals of feduq container check:"
refused "$KITS/${SITES[0]}" --data "$WORK/no-such-folder" --network "$NET"
refused "$KITS/${SITES[0]}" --data "$DATA" --image feduq-debian-base
refused "$KITS/${SITES[0]}" --data "$DATA" --project feduq_polyp
if ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then refused "$KITS/${SITES[0]}" --data "$DATA" --gpus all; fi
step "refusals (missing data, image without FedUQ, another project's kit, GPU where none is)"

podman ps -a --format '{{.Names}}' | grep "^$TAG-" | xargs -r podman rm -f -t 0 >/dev/null
podman network rm -f "$NET" >/dev/null
step "containers and network removed"

say "step timings:"
printf '  %s\n' "${TIMES[@]}"
