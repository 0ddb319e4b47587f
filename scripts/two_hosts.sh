#!/usr/bin/env bash
# docs/two-hosts.md run for real: two containers on a user-defined Docker network stand for the
# two hosts, CPU-only and offline.
#
#   bash scripts/two_hosts.sh            # as root, from the repo root's venv (pip install -e .)
#
# 1. starts dockerd if none answers (no iptables, no forwarding, no NAT; stopped again at the
#    end; a daemon that was already running is left alone);
# 2. the local base image (scripts/base_image.sh; when another run is making it, waits for it),
#    the wheels (scripts/gather_wheels.sh, when missing or stale) and `docker build --network
#    none -t $TWO_HOSTS_IMAGE` (kvhandoff-twohosts:local; its build stage is tagged -build, the
#    cache of the next run);
# 3. the certificates: the doc's `two_hosts.sh: certs` block, run as written (PREFILL_HOST=
#    prefill-a, DECODE_HOST=decode-b: the containers' names on the network), twice: the
#    cluster's CA and a rogue one; each "host" gets only the files the doc says to copy to it;
# 4. container A (prefill-a) runs the doc's `prefill` block, container B (decode-b) the
#    `decode` block, each with the doc's `health` line as its --health-cmd; only B's 50051 is
#    published, on the host's 127.0.0.1;
# 5. checks: health of A inside A over mTLS and of B from the host over TLS; the doc's `client`
#    block streams a generation from the host through B's published port (TLS + a token from
#    tokens.txt); B handed off inline; a call without the token is UNAUTHENTICATED;
# 6. the TLS mistakes of the doc's section 7, each of which must print or log its cause: the
#    host's client with the rogue CA; decode with the rogue CA; decode dialling a second prefill
#    as prefill-c (A's certificate lists prefill-a); decode without --tls-*; health of A
#    without a client certificate;
# 7. removes its containers, network, certificates and the dockerd it started; the image stays
#    as the build cache (TWO_HOSTS_CLEAN=all removes it too).
#
# Names: every container and network is kvhandoff-twohosts-<pid>-*, so a compose smoke may run
# at the same time. Traffic: the host's loopback <-> the containers' bridge only.
# Environment: PYTHON (host Python with this package; default .venv/bin/python),
# KVHANDOFF_BASE_IMAGE (kvhandoff-base:bookworm), TWO_HOSTS_IMAGE, TWO_HOSTS_REPORT (write the
# checks as JSON there), TWO_HOSTS_CLEAN, TWO_HOSTS_BASE_WAIT_S (900: how long to wait for a
# base image another run is making).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'two_hosts: %s\n' "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }
now() { date +%s; }

t_start=$(now)
tag="kvhandoff-twohosts-$$"
net="$tag-net"
base=${KVHANDOFF_BASE_IMAGE:-kvhandoff-base:bookworm}
image=${TWO_HOSTS_IMAGE:-kvhandoff-twohosts:local}
work=$(mktemp -d /tmp/kvhandoff-twohosts.XXXXXX)
doc=$(pwd)/docs/two-hosts.md
. scripts/dockerd.sh  # ensure_dockerd, stop_started_dockerd (we are at the repository root)
network_made=""
containers=()
checks=()

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
PYTHON=$(command -v "$PYTHON")
PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")"  # absolute, venv kept
"$PYTHON" -c "import grpc, kvhandoff_cli.generate" 2>/dev/null \
    || die "$PYTHON cannot import grpc and this package: pip install -e . first"

cleanup() {
    local status=$?
    set +e
    if [[ $status -ne 0 ]]; then
        for c in "${containers[@]}"; do
            say "last lines of $c:"
            docker logs --tail 6 "$c" 2>&1 | cut -c1-400 >&2
        done
    fi
    for c in "${containers[@]}"; do docker rm -f "$c" >/dev/null 2>&1; done
    if [[ -n "$network_made" ]]; then docker network rm "$net" >/dev/null 2>&1; fi
    if [[ -n "$(docker ps -aq --filter "name=^$tag-" 2>/dev/null)" ]]; then
        say "containers of $tag are left over"
        status=1
    fi
    if [[ "${TWO_HOSTS_CLEAN:-}" == all ]]; then
        docker image rm -f "$image" "$image-build" >/dev/null 2>&1
    fi
    stop_started_dockerd
    if [[ -n "${TWO_HOSTS_REPORT:-}" ]]; then
        printf '%s\n' "${checks[@]}" | "$PYTHON" -c 'import json, sys
json.dump({"passed": sys.argv[1] == "0", "checks": sys.stdin.read().splitlines()},
          open(sys.argv[2], "w"), indent=1)' "$status" "$TWO_HOSTS_REPORT"
    fi
    rm -rf "$work"
    if [[ $status -eq 0 ]]; then say "PASS in $(( $(now) - t_start )) s"
    else say "FAILED (status $status) after $(( $(now) - t_start )) s"; fi
    exit $status
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The fenced block after the doc's '<!-- two_hosts.sh: NAME -->' marker, as written there.
block() {
    awk -v marker="<!-- two_hosts.sh: $1 -->" '
        $0 == marker { found = 1; next }
        found && /^```/ { if (inside) exit; inside = 1; next }
        inside { print }' "$doc"
}
for name in certs prefill decode client health; do
    [[ -n "$(block "$name")" ]] || die "$doc has no '<!-- two_hosts.sh: $name -->' block"
done

# 1. dockerd ------------------------------------------------------------------------------
ensure_dockerd

# 2. base image, wheels, image ------------------------------------------------------------
if ! docker image inspect "$base" >/dev/null 2>&1; then
    if pgrep -f 'scripts/base_image.sh' >/dev/null; then
        say "another run is making $base: waiting for it"
        for _ in $(seq 1 "$(( ${TWO_HOSTS_BASE_WAIT_S:-900} / 5 ))"); do
            docker image inspect "$base" >/dev/null 2>&1 && break
            sleep 5
        done
    fi
    if ! docker image inspect "$base" >/dev/null 2>&1; then
        [[ "$base" == kvhandoff-base:* ]] || die "base image $base is not here (and nothing is pulled)"
        bash scripts/base_image.sh "$base"
    fi
fi
# the same stamp as compose_smoke.sh: both reuse wheels/ when it was gathered for this base
stamp="$(docker image inspect -f '{{.Id}}' "$base") $(sha256sum pyproject.toml | cut -c1-16) ${TORCH_VERSION:-2.13.0}"
if [[ ! -f wheels/requirements.txt || "$(cat wheels/.stamp 2>/dev/null)" != "$stamp" ]]; then
    while pgrep -f 'scripts/gather_wheels.sh' >/dev/null; do sleep 5; done  # another run's
    if [[ ! -f wheels/requirements.txt || "$(cat wheels/.stamp 2>/dev/null)" != "$stamp" ]]; then
        bash scripts/gather_wheels.sh "$base"
        echo "$stamp" >wheels/.stamp
    fi
fi
t=$(now)
say "building $image from $base (docker build --network none; log: $work/build.log)"
for target in build final; do
    if [[ $target == build ]]; then args=(--target build -t "$image-build"); else args=(-t "$image"); fi
    timeout 1500 docker build --network none "${args[@]}" --build-arg BASE_IMAGE="$base" \
        --build-arg WITH_COMPILER=0 . >>"$work/build.log" 2>&1 \
        || { tail -n 30 "$work/build.log" >&2; die "docker build failed"; }
done
say "built $image in $(( $(now) - t )) s"

# 3. certificates: the doc's recipe, as written --------------------------------------------
for pki in cluster rogue; do
    mkdir -p "$work/$pki"
    (cd "$work/$pki" && PREFILL_HOST=prefill-a DECODE_HOST=decode-b bash -euo pipefail \
        -c "$(block certs)") >"$work/$pki.log" 2>&1 \
        || { cat "$work/$pki.log" >&2; die "the doc's certificate recipe failed ($pki)"; }
done
grep -q 'DNS:prefill-a' <(openssl x509 -in "$work/cluster/certs/prefill.pem" -noout -text) \
    || die "prefill.pem does not list DNS:prefill-a"
# What the doc says to copy to each host (and the rogue CA, for the mistakes below).
copy_to() {  # host dir, files...
    local dir=$work/$1/certs
    shift
    mkdir -p "$dir"
    for f in "$@"; do cp "$work/cluster/certs/$f" "$dir/"; done
}
copy_to host-a ca.pem prefill.pem prefill.key client.pem client.key
copy_to host-b ca.pem decode.pem decode.key tokens.txt
copy_to host-b-rogue-ca decode.pem decode.key tokens.txt
cp "$work/rogue/certs/ca.pem" "$work/host-b-rogue-ca/certs/ca.pem"
copy_to client ca.pem
# the image's user (uid 10001) reads its keys; they stay 0600
chown -R 10001:10001 "$work"/host-*
token=$(awk 'NR == 1 {print $2}' "$work/cluster/certs/tokens.txt")
checks+=("certificates made by the doc's recipe: prefill.pem lists DNS:prefill-a, decode.pem DNS:decode-b")

# 4. the two hosts -------------------------------------------------------------------------
docker network create "$net" >/dev/null
network_made=1
# the doc's health checks: A's on A itself, B's with DECODE_HOST=127.0.0.1 (B's certificate
# lists it) as each container's --health-cmd
health_a=$(block health | grep -- ':50061')
health_b=$(block health | grep -- ':50051')
[[ -n "$health_a" && -n "$health_b" ]] || die "the doc's health block lacks A's or B's check"
run_host() {  # name (network alias), certs dir, health command, extra docker args..., -- command
    local name=$1 certs=$2 health=$3
    shift 3
    local extra=()
    while [[ $1 != -- ]]; do extra+=("$1"); shift; done
    shift
    containers+=("$tag-$name")
    docker run -d --name "$tag-$name" --hostname "$name" --network "$net" \
        --network-alias "$name" --label "org.kvhandoff.twohosts=$tag" \
        -v "$certs:/home/kvhandoff/certs:ro" \
        -e MODEL=demo -e PREFILL_HOST=prefill-a -e DECODE_HOST=127.0.0.1 -e KVHANDOFF_DEVICE=cpu \
        -e KVHANDOFF_POOL_TOKENS=4096 -e KVHANDOFF_TORCH_THREADS=1 \
        --health-cmd "$health" --health-interval 3s --health-timeout 10s --health-retries 3 \
        --health-start-period 10m "${extra[@]}" "$image" sh -c "$*" >/dev/null \
        2>>"$work/docker-run.log" || { cat "$work/docker-run.log" >&2; die "docker run $name failed"; }
    # (the log keeps docker's "IPv4 forwarding is disabled" warning: forwarding is off on purpose;
    # the containers talk over their bridge and the host through docker-proxy)
}
prefill_cmd=$(block prefill)
decode_cmd=$(block decode)
# decode without --tls-*: the doc's command less its line of peer certificates
decode_plain=$(grep -v -- '--tls-cert certs/decode.pem' <<<"$decode_cmd")
[[ "$decode_plain" != "$decode_cmd" ]] || die "cannot find the --tls-* line of the decode block"
t=$(now)
run_host prefill-a "$work/host-a/certs" "$health_a" -- "$prefill_cmd"
run_host decode-b "$work/host-b/certs" "$health_b" -p 127.0.0.1::50051 -- "$decode_cmd"
# the mistakes start alongside (each decode retries its handshake until it gets an answer)
run_host prefill-c "$work/host-a/certs" "$health_a" -- "$prefill_cmd"
run_host decode-rogue-ca "$work/host-b-rogue-ca/certs" "$health_b" -- "$decode_cmd"
run_host decode-dials-c "$work/host-b/certs" "$health_b" -e PREFILL_HOST=prefill-c -- "$decode_cmd"
run_host decode-no-tls "$work/host-b/certs" "true" -- "$decode_plain"

wait_healthy() {  # container, seconds
    local status=""
    for _ in $(seq 1 "$2"); do
        status=$(docker inspect -f '{{.State.Health.Status}}' "$1")
        [[ "$status" == healthy ]] && return 0
        [[ "$(docker inspect -f '{{.State.Running}}' "$1")" == true ]] || die "$1 stopped"
        sleep 1
    done
    die "$1 not healthy after $2 s (status $status)"
}
wait_healthy "$tag-prefill-a" 400
wait_healthy "$tag-decode-b" 300
say "A and B healthy $(( $(now) - t )) s after docker run"
checks+=("A (prefill-a) and B (decode-b) healthy by the doc's health commands (--health-cmd)")

# 5. the recipe works ----------------------------------------------------------------------
kvh() { "$PYTHON" -m kvhandoff_cli.main "$@"; }
api=$(docker port "$tag-decode-b" 50051/tcp | head -n1)
[[ "$api" == 127.0.0.1:* ]] || die "B's API is published on '$api', not on 127.0.0.1"
out=$(docker exec "$tag-prefill-a" sh -c "$health_a") || die "health of A inside A: $out"
[[ "$out" == *" SERVING" ]] || die "health of A inside A: $out"
out=$(kvh health "$api" --tls-ca "$work/client/certs/ca.pem") || die "health of B: $out"
[[ "$out" == *" SERVING" ]] || die "health of B from the host: $out"
checks+=("health: A over mTLS inside A, B over TLS from the host ($api): SERVING")

# the doc's client block, from the host: B is reached at its published port on 127.0.0.1
client_cmd=$(block client | sed "s/\"\$DECODE_HOST:50051\"/\"\$DECODE_HOST:${api#*:}\"/")
text=$(cd "$work/client" && DECODE_HOST=127.0.0.1 TOKEN=$token PATH="$(dirname "$PYTHON"):$PATH" \
    timeout 120 bash -euo pipefail -c "$client_cmd" 2>"$work/client.err") \
    || die "the doc's client block failed: $(cat "$work/client.err")"
[[ -n "$text" ]] || die "the doc's client block printed no text"
summary=$(kvh generate --target "$api" --tls-ca "$work/client/certs/ca.pem" --token "$token" \
    --max-tokens 16 --ignore-eos --json "Hello again") || die "generate --json failed: $summary"
summary=$(tail -n1 <<<"$summary")
"$PYTHON" -c 'import json, sys; s = json.loads(sys.argv[1]); sys.exit(0 if s.get("completion_tokens") == 16 else f"not 16 tokens: {s}")' "$summary" \
    || die "the JSON generation did not stream 16 tokens"
docker logs "$tag-decode-b" 2>&1 | grep '"handoff_verified"' | grep -q '"plane": "inline"' \
    || die "B did not hand off inline"
if docker logs "$tag-decode-b" 2>&1 | grep '"handoff_verified"' | grep -vq '"plane": "inline"'; then
    die "B handed off over another plane than inline"
fi
checks+=("a generation streamed from the host through B ($api) over TLS with a token: '${text:0:40}'; 16 tokens with --json; every handoff handed off inline")
if out=$(kvh generate --target "$api" --tls-ca "$work/client/certs/ca.pem" --max-tokens 4 hi 2>&1); then
    die "a call without the token was served"
fi
[[ "$out" == *UNAUTHENTICATED* ]] || die "a call without the token: $out"
checks+=("a call without the token: UNAUTHENTICATED")

# 6. the TLS mistakes ----------------------------------------------------------------------
expect_line() {  # what, output, text it must contain...
    local what=$1 out=$2
    shift 2
    for text in "$@"; do
        [[ "$out" == *"$text"* ]] || die "$what: no '$text' in: $out"
    done
    [[ "$out" != *UNREACHABLE* ]] || die "$what says UNREACHABLE: $out"
}
out=$(kvh generate --target "$api" --tls-ca "$work/rogue/certs/ca.pem" --token "$token" hi 2>&1) \
    && die "a client with the rogue CA was served"
expect_line "client with another CA" "$out" "TLS handshake with $api failed" \
    "not signed by the CA in --tls-ca"
checks+=("client with another CA: ${out:0:160}")
out=$(docker exec "$tag-prefill-a" kvhandoff health 127.0.0.1:50061 --tls-ca certs/ca.pem) \
    && die "health without a client certificate said SERVING"
expect_line "health of A without a client certificate" "$out" \
    "TLS_FAILED (client_certificate_refused)" "requires a client certificate"
checks+=("health of A without a client certificate: ${out:0:160}")

tls_failed() {  # container, cause, text: waits for its prefill_tls_failed line with that cause
    local line=""
    for _ in $(seq 1 240); do
        line=$(docker logs "$1" 2>&1 | grep '"prefill_tls_failed"' | tail -n1 || true)
        [[ -n "$line" ]] && break
        [[ "$(docker inspect -f '{{.State.Running}}' "$1")" == true ]] || die "$1 stopped"
        sleep 1
    done
    [[ -n "$line" ]] || die "$1 logged no prefill_tls_failed in 240 s"
    [[ "$line" == *"\"cause\": \"$2\""* && "$line" == *"$3"* ]] \
        || die "$1: expected cause $2 and '$3' in: $line"
    docker logs "$1" 2>&1 | grep -q '"prefill_agreed"' && die "$1 agreed with a prefill"
    "$PYTHON" -c 'import json, sys; print(json.loads(sys.argv[1])["message"])' "$line"
}
msg=$(tls_failed "$tag-decode-rogue-ca" server_certificate_not_trusted "is not signed by the CA")
checks+=("decode with a CA that did not sign prefill logs prefill_tls_failed: $msg")
msg=$(tls_failed "$tag-decode-dials-c" server_name_not_in_certificate "'prefill-c'")
checks+=("decode dialling prefill-c (the certificate lists prefill-a) logs prefill_tls_failed: $msg")
msg=$(tls_failed "$tag-decode-no-tls" client_not_tls "requires client certificates")
checks+=("decode without a client certificate logs prefill_tls_failed: $msg")
# (the rogue-CA decode's certs/ca.pem cannot check its own API's certificate: not asked)
for c in decode-dials-c decode-no-tls; do
    state=$(docker exec "$tag-$c" kvhandoff health 127.0.0.1:50051 --tls-ca certs/ca.pem || true)
    [[ "$state" == *" NOT_SERVING" ]] || die "$c: $state (expected NOT_SERVING)"
done
checks+=("the decodes with a TLS mistake never agreed with a prefill and stay NOT_SERVING")
for c in "${checks[@]}"; do say "ok: $c"; done
