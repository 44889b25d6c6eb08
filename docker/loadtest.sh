#!/usr/bin/env bash
# Load test for any OpenAI-compatible chat completions endpoint, with bash, curl (>= 7.75), awk and
# coreutils only.
#
# usage: docker/loadtest.sh BASE_URL MODEL REQUESTS CONCURRENCY [IMAGES_DIR]
#
#   BASE_URL     e.g. http://127.0.0.1:8000 or http://127.0.0.1:8000/v1 (/v1/chat/completions is appended)
#   MODEL        the "model" field of every request
#   REQUESTS     how many requests to send in total
#   CONCURRENCY  how many are in flight at once (curl --parallel-max, at most 300)
#   IMAGES_DIR   directory of .jpg/.jpeg/.png/.webp images to cycle over (default: tests/data/images)
#
# Environment: SHMGATE_API_KEY, else OPENAI_API_KEY, is sent as "Authorization: Bearer ..." (through
# curl's config file, so the key never shows up in `ps`). LOADTEST_TIMEOUT_S caps each request (120).
#
# Each request is one non-streaming chat completion with one text part and one image part (a base64 data
# URL; the MIME type follows the file extension). The request bodies are written once per image into a
# temporary directory, and one curl process runs all requests over reused connections.
#
# Prints a short table, then exactly one summary line, last:
#   N ok, N failed, R req/s, p50 X ms, p90 Y ms, p99 Z ms
# req/s is REQUESTS over the wall time of the whole run; latencies are curl's time_total of the successful
# requests (nearest-rank percentiles, 0 when none succeeded).
# Exit status: 0 when every request got a 2xx answer, 1 when any failed (curl error or other status),
# 2 on a usage error.

set -euo pipefail

# curl (7.66 to 8.x) caps --parallel-max at 300 and silently falls back to 50 above that.
readonly MAX_PARALLEL=300
readonly PROMPT="What is in this image?"

usage() {
    printf 'usage: %s BASE_URL MODEL REQUESTS CONCURRENCY [IMAGES_DIR]\n' "${0##*/}" >&2
    exit 2
}

die() {
    printf 'loadtest: %s\n' "$*" >&2
    exit 2
}

# The argument as the inside of a JSON string.
json_escape() {
    local s=$1
    s=${s//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\t'/\\t}
    s=${s//$'\n'/\\n}
    s=${s//$'\r'/\\r}
    printf '%s' "$s"
}

# The argument as the inside of a double-quoted curl config value.
curl_quote() {
    local s=$1
    s=${s//\\/\\\\}
    s=${s//\"/\\\"}
    printf '%s' "$s"
}

# BASE_URL (with or without a trailing /v1, or already the full path) -> the chat completions URL.
chat_endpoint() {
    local url=${1%/}
    case $url in
        */chat/completions) printf '%s' "$url" ;;
        */v1) printf '%s/chat/completions' "$url" ;;
        *) printf '%s/v1/chat/completions' "$url" ;;
    esac
}

mime_type() {
    local name=${1,,}
    case $name in
        *.jpg | *.jpeg) printf 'image/jpeg' ;;
        *.png) printf 'image/png' ;;
        *.webp) printf 'image/webp' ;;
        *) die "no MIME type for $1" ;;
    esac
}

# write_body IMAGE OUT: one chat completion request carrying IMAGE as a data URL.
write_body() {
    local image=$1 out=$2
    {
        printf '{"model":"%s","messages":[{"role":"user","content":[' "$model_json"
        printf '{"type":"text","text":"%s"},' "$(json_escape "$PROMPT")"
        printf '{"type":"image_url","image_url":{"url":"data:%s;base64,' "$(mime_type "$image")"
        base64 < "$image" | tr -d '\n'
        printf '"}}]}],"max_tokens":16}'
    } > "$out"
}

# write_config OUT: one curl config block per request, cycling over the bodies.
write_config() {
    local out=$1 i
    local url_q auth_q="" fmt
    url_q=$(curl_quote "$endpoint")
    if [[ -n $api_key ]]; then
        auth_q=$(curl_quote "Authorization: Bearer $api_key")
    fi
    # One result line per request: status, seconds, curl exit code, curl error message (may be empty).
    fmt='%{http_code} %{time_total} %{exitcode} %{errormsg}\n'
    {
        for ((i = 0; i < requests; i++)); do
            ((i == 0)) || printf 'next\n'
            printf 'url = "%s"\n' "$url_q"
            printf 'data-binary = "@%s"\n' "${bodies_q[i % ${#bodies_q[@]}]}"
            printf 'header = "Content-Type: application/json"\n'
            # No "Expect: 100-continue" round trip before large bodies.
            printf 'header = "Expect:"\n'
            if [[ -n $auth_q ]]; then
                printf 'header = "%s"\n' "$auth_q"
            fi
            printf 'output = "/dev/null"\n'
            printf 'max-time = %s\n' "$timeout_s"
            printf 'write-out = "%s"\n' "$fmt"
        done
    } > "$out"
}

# report RESULTS WALL_NS: the table and the summary line; returns 1 when any request failed.
report() {
    local results=$1 wall_ns=$2
    local latencies=$workdir/latencies
    # Successful latencies in whole milliseconds, one per line, sorted.
    LC_ALL=C awk '$3 == 0 && $1 ~ /^2[0-9][0-9]$/ { printf "%d\n", $2 * 1000 + 0.5 }' "$results" |
        LC_ALL=C sort -n > "$latencies"

    local ok failed
    ok=$(wc -l < "$latencies")
    ok=${ok// /}
    failed=$((requests - ok))

    printf '%-12s %s\n' endpoint "$endpoint" model "$model"
    printf '%-12s %s at concurrency %s, cycling over %s images\n' requests "$requests" "$concurrency" \
        "${#images[@]}"
    LC_ALL=C awk -v ns="$wall_ns" 'BEGIN { printf "%-12s %.3f s\n", "wall time", ns / 1e9 }'
    printf 'outcomes\n'
    # Outcomes: "HTTP <status>" for answers, "curl <exit code> <message>" for transfers that failed, and
    # "no result" for requests curl never reported (e.g. it could not start).
    LC_ALL=C awk -v n="$requests" '
        {
            seen++
            if ($3 != 0) { key = "curl " $3; for (i = 4; i <= NF; i++) key = key " " $i }
            else key = "HTTP " $1
            count[key]++
        }
        END {
            for (k in count) printf "%8d  %s\n", count[k], k
            if (n - seen > 0) printf "%8d  %s\n", n - seen, "no result"
        }' "$results" | LC_ALL=C sort -k2
    LC_ALL=C awk -v ok="$ok" -v failed="$failed" -v n="$requests" -v ns="$wall_ns" '
        function rank(p) { r = int((p * ok + 99) / 100); return r < 1 ? 1 : r }
        { v[NR] = $1 }
        END {
            if (ok > 0) {
                printf "%-12s min %d, p50 %d, p90 %d, p99 %d, max %d (successful requests)\n", \
                    "latency ms", v[1], v[rank(50)], v[rank(90)], v[rank(99)], v[ok]
                p50 = v[rank(50)]; p90 = v[rank(90)]; p99 = v[rank(99)]
            } else {
                p50 = p90 = p99 = 0
            }
            secs = ns / 1e9
            rps = secs > 0 ? n / secs : 0
            printf "%d ok, %d failed, %.1f req/s, p50 %d ms, p90 %d ms, p99 %d ms\n", \
                ok, failed, rps, p50, p90, p99
        }' "$latencies"
    ((failed == 0))
}

main() {
    (($# == 4 || $# == 5)) || usage
    local base_url=$1
    model=$2
    requests=$3
    concurrency=$4
    local script_dir images_dir
    script_dir=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
    images_dir=${5:-$script_dir/../tests/data/images}
    timeout_s=${LOADTEST_TIMEOUT_S:-120}

    [[ $requests =~ ^[1-9][0-9]*$ ]] || die "REQUESTS must be a positive integer, not '$requests'"
    [[ $concurrency =~ ^[1-9][0-9]*$ ]] || die "CONCURRENCY must be a positive integer, not '$concurrency'"
    [[ $timeout_s =~ ^[1-9][0-9]*$ ]] || die "LOADTEST_TIMEOUT_S must be a positive integer"
    if ((concurrency > MAX_PARALLEL)); then
        printf 'loadtest: curl runs at most %d transfers at once; using %d\n' "$MAX_PARALLEL" "$MAX_PARALLEL" >&2
        concurrency=$MAX_PARALLEL
    fi
    [[ -d $images_dir ]] || die "no such directory: $images_dir"
    command -v curl > /dev/null || die "curl is not installed"

    endpoint=$(chat_endpoint "$base_url")
    model_json=$(json_escape "$model")
    api_key=${SHMGATE_API_KEY:-${OPENAI_API_KEY:-}}

    mapfile -t images < <(find "$images_dir" -maxdepth 1 -type f \( -iname '*.jpg' -o -iname '*.jpeg' \
        -o -iname '*.png' -o -iname '*.webp' \) | LC_ALL=C sort)
    ((${#images[@]} > 0)) || die "no .jpg/.jpeg/.png/.webp images in $images_dir"

    workdir=$(mktemp -d "${TMPDIR:-/tmp}/shmgate-loadtest.XXXXXX")
    trap 'rm -rf -- "$workdir"' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM

    local i
    bodies_q=()
    for i in "${!images[@]}"; do
        write_body "${images[i]}" "$workdir/body.$i.json"
        bodies_q+=("$(curl_quote "$workdir/body.$i.json")")
    done
    write_config "$workdir/curl.conf"

    local start_ns end_ns
    start_ns=$(date +%s%N)
    # curl's exit status and its messages only repeat what the per-request lines say, except when curl
    # could not start at all: then the requests without a line count as failed and its messages are shown.
    # (--no-progress-meter: -s does not silence the parallel progress meter in curl 7.88.)
    curl --no-progress-meter --parallel --parallel-immediate --parallel-max "$concurrency" \
        --config "$workdir/curl.conf" > "$workdir/results" 2> "$workdir/curl.stderr" || true
    end_ns=$(date +%s%N)
    if [[ ! -s $workdir/results ]]; then
        head -n 5 "$workdir/curl.stderr" >&2
    fi

    report "$workdir/results" $((end_ns - start_ns))
}

main "$@"
