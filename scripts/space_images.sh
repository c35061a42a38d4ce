#!/usr/bin/env bash
# Build and boot both Space images locally, as the Hub would: render the Space folders with the
# real `sparsesync deploy env|inference --dry-run`, build each Dockerfile unmodified with buildah,
# and boot each image:
#   - env image: the HEALTHCHECK passes, /health answers, a Wordle episode (/reset, /step until
#     done) completes over HTTP from the host;
#   - replica image (embedded engine, CPU): runs as uid 1000, follows a run in a folder bucket
#     bound into the container while the host publishes versions with the real Publisher, reaches
#     the newest version, serves a completion whose weight_version is that version; HEALTHCHECK passes;
#   - vLLM-on-GPU variant: cannot be built without a GPU; its requirements.txt must resolve
#     (`pip install --dry-run --report`, in the base image, against the package index).
# Needs root, buildah, podman, debootstrap, iproute2 (apt-get install -y buildah podman debootstrap)
# and network access to deb.debian.org (base image, first run only) and the package index.
#
# The base `python:3.11-slim` is made locally (no registry here): debootstrap's bookworm minbase
# with python3 3.11 and its C headers (the official image has Python.h) in a venv at /usr/local
# (so `python`/`pip` are /usr/local/bin's, pip installs system-wide without PEP 668 errors, as in
# the official image). It is cached in
# $SPACE_BASE_CACHE (default /var/cache/sparsesync-space-base) and in container storage.
# Each image runs in its own network namespace on the Dockerfile's own port, so the HEALTHCHECK
# runs exactly as written and nothing else on the machine is in the way.
#
# If download.pytorch.org (the CPU torch index the embedded replica's requirements name) cannot
# be reached, a local torch *+cpu wheel (from $PIP_FIND_LINKS or /opt/wheels) stands in for it
# through a pip.conf bound into the build's RUN steps; the Dockerfile stays as is.
#
# Usage: sudo scripts/space_images.sh [SUMMARY_JSON]     (PYTHON=... picks the host interpreter;
#        SPACE_IMAGES_REUSE=1 boots the images already built instead of rebuilding them)
# Writes a JSON summary (build times, sizes, checks) to SUMMARY_JSON (default $WORK/summary.json).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
WORK=${SPACE_IMAGES_WORK:-$(mktemp -d /tmp/space-images-XXXX)}
SUMMARY=${1:-$WORK/summary.json}
CACHE=${SPACE_BASE_CACHE:-/var/cache/sparsesync-space-base}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
HOST_CA=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
BASE=docker.io/library/python:3.11-slim
TAG=$$
NICE="nice -n 10"
mkdir -p "$WORK" "$CACHE"
T_START=$(date +%s.%N)
declare -A RESULT=()   # key -> JSON value
CLEANUP=()
cleanup() { local c; for c in "${CLEANUP[@]}"; do eval "$c" >/dev/null 2>&1 || true; done; }
trap cleanup EXIT
log() { printf '[space_images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
now() { date +%s.%N; }
since() { "$PY" -c "import sys; print(round($(now) - $1, 1))"; }
die() { log "FAILED: $*"; RESULT[error]=$("$PY" -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$*"); write_summary false; exit 1; }
write_summary() {
  local ok=$1 body="" k
  for k in "${!RESULT[@]}"; do body+="\"$k\": ${RESULT[$k]}, "; done
  printf '{%s"ok": %s, "total_s": %s}\n' "$body" "$ok" "$(since "$T_START")" | "$PY" -m json.tool --sort-keys > "$SUMMARY"
  log "summary: $SUMMARY"
}
for tool in buildah podman debootstrap ip; do command -v "$tool" >/dev/null || die "$tool not installed (apt-get install -y buildah podman debootstrap iproute2)"; done
[ "$(id -u)" = 0 ] || die "run as root (buildah --isolation chroot, debootstrap, ip netns)"
[ -x "$PY" ] || die "no host python at $PY (set PYTHON=/path/to/venv/bin/python)"

# -- 1. the base image --------------------------------------------------------------------------
make_base_rootfs() {
  local r=$CACHE/rootfs.tmp
  if [ ! -f "$CACHE/debootstrap.done" ]; then  # resumable: a finished debootstrap is kept
    rm -rf "$r"
    log "debootstrap bookworm minbase into $r"
    $NICE debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,libpython3.11-dev,ca-certificates,netbase \
      bookworm "$r" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 || die "debootstrap failed: see $WORK/debootstrap.log"
    touch "$CACHE/debootstrap.done"
  fi
  # the official image's apt sources (bookworm, -updates, -security)
  rm -f "$r/etc/apt/sources.list"
  cat > "$r/etc/apt/sources.list.d/debian.sources" <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  cp /etc/resolv.conf "$r/etc/resolv.conf"
  cp "$HOST_CA" "$r/tmp/host-ca.crt"
  # python/pip in /usr/local/bin, installing into /usr/local (a venv there, isolated from Debian's
  # own python3-* packages), with the pip that Python 3.11's own ensurepip (the official image) ships
  env -i PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 PIP_CERT=/tmp/host-ca.crt chroot "$r" sh -ec '
    python3 -m venv /usr/local
    /usr/local/bin/pip install -q --no-cache-dir --disable-pip-version-check -U pip==24.0 wheel
    apt-get clean; rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /root/.cache /tmp/host-ca.crt' > "$WORK/base-python.log" 2>&1 \
    || die "python setup in the base failed: see $WORK/base-python.log"
  : > "$r/etc/resolv.conf"
  tar -C "$r" --numeric-owner -cf "$CACHE/rootfs.tar.tmp" . && mv "$CACHE/rootfs.tar.tmp" "$CACHE/rootfs.tar"
  rm -rf "$r" "$CACHE/debootstrap.done"
}
t0=$(now)
if buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  base_how=cached-image
else
  base_how=cached-rootfs
  [ -f "$CACHE/rootfs.tar" ] || { base_how=debootstrap; make_base_rootfs; }
  log "importing $CACHE/rootfs.tar as $BASE"
  podman import --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'ENV PYTHON_VERSION=3.11' --change 'CMD ["python3"]' \
    --change 'LABEL io.sparsesync.base=debootstrap-bookworm-minbase' \
    "$CACHE/rootfs.tar" "$BASE" > /dev/null || die "podman import of the base failed"
fi
RESULT[base]="{\"how\": \"$base_how\", \"seconds\": $(since "$t0")}"
log "base $BASE ready ($base_how, $(since "$t0") s)"

# -- 2. render the Space folders with the real CLI ------------------------------------------------
deploy() { (cd "$ROOT" && "$PY" -c 'import sys; from sparsesync.cli import app; sys.argv[0] = "sparsesync"; app()' deploy "$@"); }
rm -rf "$WORK/env" "$WORK/inference" "$WORK/inference-vllm" "$WORK/bucket" "$WORK/tiny"
deploy env --space local/env-space --dry-run --out "$WORK/env" > "$WORK/render-env.log" 2>&1 \
  || die "deploy env --dry-run failed: $(tail -3 "$WORK/render-env.log")"
(cd "$ROOT" && "$PY" -m sparsesync.tiny_model "$WORK/tiny" 0 > /dev/null) || die "tiny model build failed"
deploy inference --space local/replica --bucket file:///bucket --model "$WORK/tiny" --engine embedded \
  --poll-interval 0.2 --dry-run --out "$WORK/inference" > "$WORK/render-inference.log" 2>&1 \
  || die "deploy inference --dry-run failed: $(tail -3 "$WORK/render-inference.log")"
deploy inference --space local/replica-gpu --bucket s3://bucket/run --model "$WORK/tiny" --engine vllm \
  --dry-run --out "$WORK/inference-vllm" > "$WORK/render-vllm.log" 2>&1 \
  || die "deploy inference --engine vllm --dry-run failed: $(tail -3 "$WORK/render-vllm.log")"
# the Space variables the Hub would set (from the plan the dry run printed)
space_vars() { grep -o 'set variable [A-Z_]*=.*' "$1" | sed 's/^set variable //'; }

# -- 3. build -------------------------------------------------------------------------------------
# The build's RUN steps see this machine's trust store (a TLS-inspecting proxy's CA, if any) and,
# where download.pytorch.org is out of reach, a local copy of its CPU torch wheel, through a
# pip.conf bound at /etc/pip.conf: the build environment, not the Dockerfile, differs from the Hub.
mkdir -p "$WORK/buildenv"
cp "$HOST_CA" "$WORK/buildenv/ca.crt"
printf '[global]\ncert = /run/sparsesync-buildenv/ca.crt\n' > "$WORK/buildenv/pip.conf"
BUILDENV=(--volume "$WORK/buildenv:/run/sparsesync-buildenv:ro" --volume "$WORK/buildenv/pip.conf:/etc/pip.conf:ro")
if grep -q 'download.pytorch.org' "$WORK/inference/requirements.txt" && \
   ! "$PY" -c 'import urllib.request as u; u.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=10)' 2>/dev/null; then
  wheel=$(ls ${PIP_FIND_LINKS:-/opt/wheels}/torch-*+cpu-cp311-*.whl /opt/wheels/torch-*+cpu-cp311-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$wheel" ]; then
    cp -f "$wheel" "$WORK/buildenv/"
    printf 'find-links = /run/sparsesync-buildenv\nretries = 1\n' >> "$WORK/buildenv/pip.conf"
    log "download.pytorch.org unreachable: $(basename "$wheel") stands in for the CPU torch index"
    RESULT[torch_cpu_index]="\"local stand-in: $(basename "$wheel")\""
  else
    log "WARNING: download.pytorch.org unreachable and no local torch +cpu wheel: the build gets the index's CUDA torch"
    RESULT[torch_cpu_index]='"unreachable: CUDA torch from the index"'
  fi
fi
build() {  # name folder [extra bud args]
  local name=$1 dir=$2; shift 2
  local t=$(now)
  if [ "${SPACE_IMAGES_REUSE:-0}" = 1 ] && buildah inspect --type image "localhost/$name:latest" >/dev/null 2>&1; then
    log "reusing localhost/$name:latest (SPACE_IMAGES_REUSE=1: not rebuilt)"
    RESULT[build_$name]="{\"seconds\": null, \"size_bytes\": $(podman image inspect --format '{{.Size}}' "localhost/$name:latest"), \"reused\": true}"
    return
  fi
  log "building $name from $dir"
  local old
  old=$(podman image inspect --format '{{.Id}}' "localhost/$name:latest" 2>/dev/null || true)
  $NICE buildah bud --isolation chroot --format docker --layers=false -t "localhost/$name:latest" "$@" "$dir" \
    > "$WORK/build-$name.log" 2>&1 || die "build of $name failed: $(tail -5 "$WORK/build-$name.log")"
  [ -z "$old" ] || buildah rmi "$old" >/dev/null 2>&1 || true  # the previous run's image, now untagged
  local secs size
  secs=$(since "$t")
  size=$(podman image inspect --format '{{.Size}}' "localhost/$name:latest")
  log "built $name in ${secs} s: $(( size / 1000000 )) MB"
  RESULT[build_$name]="{\"seconds\": $secs, \"size_bytes\": $size}"
}
build env-space "$WORK/env" "${BUILDENV[@]}"
build replica-space "$WORK/inference" "${BUILDENV[@]}"
RESULT[base_size_bytes]=$(podman image inspect --format '{{.Size}}' "$BASE")

# -- 4. boot --------------------------------------------------------------------------------------
# image_cfg IMAGE FIELD: a field of the image's Docker config as JSON
image_cfg() { buildah inspect --type image "$1" | "$PY" -c "import json,sys; print(json.dumps(json.load(sys.stdin)['Docker']['config'].get('$2')))"; }
start() {  # name image netns logfile env-args... -> sets CTR, PID (runs the image's CMD)
  local name=$1 image=$2 ns=$3 logf=$4; shift 4
  local ctr cmd
  ctr=$(buildah from --name "$name-$TAG" "$image") || die "buildah from $image failed"
  CLEANUP+=("buildah rm $ctr")
  CTR=$ctr
  ip netns add "$ns" && CLEANUP+=("ip netns del $ns")
  ip netns exec "$ns" ip link set lo up
  local entry argv
  entry=$(image_cfg "$image" Entrypoint) && argv=$(image_cfg "$image" Cmd) || die "cannot read the config of $image"
  mapfile -t cmd < <("$PY" -c 'import json,sys; print("\n".join((json.loads(sys.argv[1]) or []) + (json.loads(sys.argv[2]) or [])))' "$entry" "$argv")
  [ -n "${cmd[0]}" ] || die "$image has no CMD"
  setsid ip netns exec "$ns" buildah run --isolation chroot "$@" "$ctr" -- "${cmd[@]}" > "$logf" 2>&1 &
  PID=$!
  CLEANUP=("kill -TERM -- -$PID; sleep 2; kill -KILL -- -$PID" "${CLEANUP[@]}")
}
healthcheck() {  # ctr image netns -> runs the HEALTHCHECK command in the running container
  local ctr=$1 image=$2 ns=$3 test
  test=$(image_cfg "$image" Healthcheck) || die "cannot read the config of $image"
  [ "$test" != null ] || die "$image has no HEALTHCHECK (built with --format docker?)"
  local kind cmdline
  kind=$("$PY" -c 'import json,sys; print(json.loads(sys.argv[1])["Test"][0])' "$test")
  [ "$kind" = CMD-SHELL ] || [ "$kind" = CMD ] || die "HEALTHCHECK of $image: unexpected $kind"
  if [ "$kind" = CMD-SHELL ]; then
    cmdline=$("$PY" -c 'import json,sys; print(json.loads(sys.argv[1])["Test"][1])' "$test")
    timeout 10 ip netns exec "$ns" buildah run --isolation chroot "$ctr" -- /bin/sh -c "$cmdline"
  else
    mapfile -t args < <("$PY" -c 'import json,sys; print("\n".join(json.loads(sys.argv[1])["Test"][1:]))' "$test")
    timeout 10 ip netns exec "$ns" buildah run --isolation chroot "$ctr" -- "${args[@]}"
  fi
}
wait_health() {  # ns url pid logfile seconds
  local t=$(now)
  ip netns exec "$1" "$PY" - "$2" "$5" <<'EOF' || { log "$(tail -30 "$4")"; die "$2 did not answer within $5 s"; }
import sys, time, urllib.request
url, limit = sys.argv[1], float(sys.argv[2])
deadline = time.monotonic() + limit
while True:
    try:
        urllib.request.urlopen(url, timeout=2)
        break
    except Exception:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.5)
EOF
  kill -0 "$3" 2>/dev/null || die "container exited: $(tail -20 "$4")"
  since "$t"
}
server_pid() {  # ns port -> pid of the process listening on the port
  local pid
  pid=$(ip netns exec "$1" ss -Hltnp "sport = :$2" | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2)
  [ -n "$pid" ] || die "nobody listens on port $2"
  echo "$pid"
}
stop() {  # server-pid run-pid: SIGTERM to the server (as the Hub stops a Space); true if it exits within 20 s
  kill -TERM "$1" 2>/dev/null || true
  local i
  for i in $(seq 1 40); do kill -0 "$2" 2>/dev/null || { echo true; return; }; sleep 0.5; done
  echo false
}
env_args() { local a=() kv; while read -r kv; do [ -n "$kv" ] && a+=(--env "$kv"); done < <(space_vars "$1"); printf '%s\n' "${a[@]}"; }

# env image
mapfile -t args < <(env_args "$WORK/render-env.log")
start env-space localhost/env-space:latest "sps-env-$TAG" "$WORK/boot-env.log" "${args[@]}" --env SPACE_ID=local/env-space
ctr=$CTR pid=$PID
up=$(wait_health "sps-env-$TAG" http://127.0.0.1:8000/health "$pid" "$WORK/boot-env.log" 120)
log "env image up in $up s"
spid=$(server_pid "sps-env-$TAG" 8000)
uid=$(awk '/^Uid:/ {print $2}' "/proc/$spid/status")
healthcheck "$ctr" localhost/env-space:latest "sps-env-$TAG" || die "env image HEALTHCHECK failed"
episode=$(ip netns exec "sps-env-$TAG" "$PY" - "$WORK/env/env_space/words/allowed.txt" <<'EOF'
import json, sys, urllib.request
def call(path, body):
    req = urllib.request.Request("http://127.0.0.1:8000" + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)
words = [w.strip() for w in open(sys.argv[1]) if len(w.strip()) == 5][:50]
r = call("/reset", {"task": "wordle", "seed": 7})
sid, turns, rewards = r["session_id"], 0, []
assert "prompt" in r["observation"] and not r["done"], r
while not r["done"]:
    r = call("/step", {"action": {"text": words[turns]}, "session_id": sid})
    turns += 1
    rewards.append(r["reward"])
    assert turns <= 6, "the episode did not end after 6 guesses"
print(json.dumps({"turns": turns, "rewards": rewards, "message": r["observation"].get("message")}))
EOF
) || die "the Wordle episode failed: $(tail -20 "$WORK/boot-env.log")"
stopped=$(stop "$spid" "$pid")
RESULT[boot_env]="{\"up_s\": $up, \"uid\": $uid, \"healthcheck\": true, \"wordle\": $episode, \"stopped_on_sigterm\": $stopped}"
log "env image: uid $uid, HEALTHCHECK ok, Wordle episode $episode"

# replica image: a folder bucket bound at /bucket; the host publishes into it
mkdir -p "$WORK/bucket" && chmod 0777 "$WORK/bucket"   # the replica (uid 1000) writes its heartbeat there
mapfile -t args < <(env_args "$WORK/render-inference.log")
start replica-space localhost/replica-space:latest "sps-rep-$TAG" "$WORK/boot-replica.log" \
  "${args[@]}" --env SPACE_ID=local/replica --volume "$WORK/bucket:/bucket"
ctr=$CTR pid=$PID
up=$(wait_health "sps-rep-$TAG" http://127.0.0.1:7860/health "$pid" "$WORK/boot-replica.log" 300)
log "replica image up in $up s"
spid=$(server_pid "sps-rep-$TAG" 7860)
uid=$(awk '/^Uid:/ {print $2}' "/proc/$spid/status")
[ "$uid" = 1000 ] || die "the replica runs as uid $uid, not 1000"
healthcheck "$ctr" localhost/replica-space:latest "sps-rep-$TAG" || die "replica image HEALTHCHECK failed"
follow=$(cd "$ROOT" && ip netns exec "sps-rep-$TAG" "$PY" - "$WORK/tiny" "$WORK/bucket" <<'EOF'
import json, sys, time, urllib.request
from tests.support.model_steps import PROMPTS, Trainer
from sparsesync.protocol.writer.publisher import Publisher
url = "http://127.0.0.1:7860"
def get(path):
    with urllib.request.urlopen(url + path, timeout=10) as r:
        return json.load(r)
assert get("/sync")["serving_version"] is None
trainer, t0 = Trainer(sys.argv[1], seed=3), time.monotonic()
with Publisher(sys.argv[2], anchor_every=0) as pub:
    for step in (1, 2, 3, 4):
        pub.publish(trainer.step(), step)
        pub.flush()
while (s := get("/sync"))["current_version"] != 4:
    assert time.monotonic() - t0 < 120, s
    time.sleep(0.2)
reached = round(time.monotonic() - t0, 1)
req = urllib.request.Request(url + "/v1/completions", headers={"content-type": "application/json"},
                             data=json.dumps({"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}).encode())
with urllib.request.urlopen(req, timeout=60) as r:
    c = json.load(r)
assert c["weight_version"] == 4 and c["choices"][0]["weight_version"] == 4, c
print(json.dumps({"newest": 4, "reached_s": reached, "weight_version": c["weight_version"],
                  "state": s["state"], "fleet": (s.get("fleet") or {}).get("heartbeat")}))
EOF
) || die "the replica did not follow the bucket: $(tail -30 "$WORK/boot-replica.log")"
torch=$(ip netns exec "sps-rep-$TAG" buildah run --isolation chroot "$ctr" -- python -c 'import torch; print(torch.__version__)') \
  || die "torch does not import in the replica image"
stopped=$(stop "$spid" "$pid")
RESULT[boot_replica]="{\"up_s\": $up, \"uid\": $uid, \"healthcheck\": true, \"follow\": $follow, \"torch\": \"$torch\", \"stopped_on_sigterm\": $stopped}"
log "replica image: uid $uid, HEALTHCHECK ok, followed: $follow"

# -- 5. the vLLM-on-GPU variant: its requirements resolve against the package index --------------
t=$(now)
ctr=$(buildah from --name "resolve-$TAG" "$BASE") && CLEANUP+=("buildah rm $ctr")
mkdir -p "$WORK/resolve"
mkdir -p "$WORK/resolveenv" && cp "$HOST_CA" "$WORK/resolveenv/ca.crt"
printf '[global]\ncert = /run/sparsesync-buildenv/ca.crt\n' > "$WORK/resolveenv/pip.conf"  # the index only: no stand-in wheel
$NICE buildah run --isolation chroot --volume "$WORK/resolveenv:/run/sparsesync-buildenv:ro" \
  --volume "$WORK/resolveenv/pip.conf:/etc/pip.conf:ro" --volume "$WORK/inference-vllm:/space:ro" --volume "$WORK/resolve:/out" "$ctr" -- \
  pip install --dry-run --ignore-installed --quiet --report /out/report.json -r /space/requirements.txt \
  > "$WORK/resolve.log" 2>&1 || die "vLLM requirements do not resolve: $(tail -5 "$WORK/resolve.log")"
vllm=$("$PY" - "$WORK/resolve/report.json" <<'EOF'
import json, sys
items = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
print(json.dumps({"packages": len(items), "vllm": items.get("vllm"), "torch": items.get("torch"),
                  "transformers": items.get("transformers")}))
EOF
)
RESULT[resolve_vllm]="{\"seconds\": $(since "$t"), \"resolved\": $vllm}"
log "vLLM variant requirements resolve: $vllm"
write_summary true
cat "$SUMMARY"
