# Sourced by the docker scripts (compose_smoke.sh, two_hosts.sh): a dockerd of our own when none
# answers, and its stop. Needs the caller's `say`, `die` and `$work`; sets `started_dockerd`
# (empty when a dockerd was already running, which is then left alone).
started_dockerd=""

# Starts dockerd (no iptables rules, no IP forwarding, no masquerading: containers talk to each
# other on their bridge and to the host, published ports go through docker-proxy on 127.0.0.1)
# unless one answers already; returns once it answers.
ensure_dockerd() {
    timeout 20 docker info >/dev/null 2>&1 && return 0
    command -v dockerd >/dev/null || die "no dockerd (apt-get install docker.io) and none running"
    say "starting dockerd (log: $work/dockerd.log)"
    dockerd --iptables=false --ip-forward=false --ip-masq=false \
        --pidfile "$work/dockerd.pid" >"$work/dockerd.log" 2>&1 &
    started_dockerd=$!
    for _ in $(seq 1 120); do
        timeout 5 docker info >/dev/null 2>&1 && break
        kill -0 "$started_dockerd" 2>/dev/null || { tail -n 20 "$work/dockerd.log" >&2; die "dockerd exited"; }
        sleep 0.5
    done
    timeout 5 docker info >/dev/null 2>&1 || die "dockerd did not answer within 60 s"
}

# Stops the dockerd ensure_dockerd started, if it started one (waits up to 30 s).
stop_started_dockerd() {
    [[ -n "$started_dockerd" ]] || return 0
    kill "$started_dockerd" 2>/dev/null
    for _ in $(seq 1 60); do kill -0 "$started_dockerd" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$started_dockerd" 2>/dev/null && say "dockerd $started_dockerd did not stop"
    return 0
}
