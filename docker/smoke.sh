#!/usr/bin/env bash
# Deployment smoke test against any Docker engine (not run in CI: CI has no engine).
#
#   docker/smoke.sh                         # build, compose up, classify, add, down/up, check
#   KEEP=1 docker/smoke.sh                  # leave the stack and its volumes up afterwards
#   SKIP_BUILD=1 docker/smoke.sh            # use the snca:cpu image already built
#   BUILD_ARGS="--network host --build-arg BASE_IMAGE=local/python:3.11-bookworm --build-arg TORCH_INDEX_URL=" \
#   SNCA_DATASET_DIR=/usr/share/datasets docker/smoke.sh        # the sandbox of ../shared/tools
#   COMPOSE_HTTP_TIMEOUT=600 docker/smoke.sh   # Compose v1 on slow storage (its 60 s default
#                                              # times out while large images start)
#
# Checks, in order: `config` of every profile; the image builds (size reported); `up` runs the
# bootstrap job (trains + indexes) and the api turns healthy (cold start reported); /classify
# and /gallery/add answer through the published port; `down` then `up` keeps the added label;
# `stop` is graceful. Exit status 0 only if every check passed.
set -euo pipefail
cd "$(dirname "$0")/.."
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-sncasmoke}
export SNCA_PORT=${SNCA_PORT:-8000}
URL="http://127.0.0.1:${SNCA_PORT}"
TIMEOUT=${TIMEOUT:-1800}
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
KEY_HEADER=()
[ -n "${SNCA_API_KEY:-}" ] && KEY_HEADER=(-H "X-API-Key: ${SNCA_API_KEY}")
tmp=$(mktemp -d)
step() { printf '\n== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }
fail() { echo "SMOKE FAILED: $*" >&2; "${COMPOSE[@]}" logs --tail 50 >&2 || true; exit 1; }
cleanup() { rm -rf "$tmp"; [ -n "${KEEP:-}" ] || "${COMPOSE[@]}" down -v >/dev/null 2>&1 || true; }
trap cleanup EXIT

bootstrap_state() {  # "<exit code> <status>" of the bootstrap container, if there is one
    "${COMPOSE[@]}" ps -a -q bootstrap | xargs -r docker inspect --format '{{.State.ExitCode}} {{.State.Status}}'
}
bootstrap_failed() {  # exited with any non-zero code
    local st
    st=$(bootstrap_state)
    [ -n "$st" ] && [ "${st#* }" = exited ] && [ "${st%% *}" != 0 ]
}

wait_healthy() {  # seconds it took for the api container to report healthy
    local start=$SECONDS id status
    while (( SECONDS - start < TIMEOUT )); do
        id=$("${COMPOSE[@]}" ps -q api || true)
        if [ -n "$id" ]; then
            status=$(docker inspect --format '{{.State.Health.Status}}' "$id" 2>/dev/null || echo starting)
            [ "$status" = healthy ] && { echo $((SECONDS - start)); return 0; }
        fi
        bootstrap_failed && fail "the bootstrap job failed (exit code $(bootstrap_state))"
        sleep 2
    done
    fail "api not healthy after ${TIMEOUT}s"
}

step "compose config, every profile"
for profile in "" gpu train; do
    "${COMPOSE[@]}" ${profile:+--profile $profile} config -q && echo "config ok: ${profile:-default}"
done

step "build the CPU image"
if [ -z "${SKIP_BUILD:-}" ]; then
    # shellcheck disable=SC2086
    docker build ${BUILD_ARGS:-} -f docker/Dockerfile -t snca:cpu .
fi
size=$(docker image inspect snca:cpu --format '{{.Size}}')
echo "image snca:cpu: $((size / 1024 / 1024)) MiB"

step "compose up (bootstrap trains the default model, then api)"
"${COMPOSE[@]}" down -v >/dev/null 2>&1 || true
t0=$SECONDS
# `up -d` itself fails when bootstrap does (api depends on its success): say so, with its logs
"${COMPOSE[@]}" up -d || fail "compose up failed; bootstrap: $(bootstrap_state)"
wait_healthy >/dev/null
cold=$((SECONDS - t0))  # `up -d` itself waits for bootstrap (depends_on: completed)
echo "api healthy ${cold}s after up (cold start, including bootstrap training)"
"${COMPOSE[@]}" logs bootstrap | tail -n 8
"${COMPOSE[@]}" ps

step "example images from the container's test split"
"${COMPOSE[@]}" exec -T -e SNCA_DATA_DIR=/datasets api python3 -m service.tools.examples /tmp/examples >/dev/null
for name in sneaker logo logo-2; do
    "${COMPOSE[@]}" exec -T api cat "/tmp/examples/$name.png" >"$tmp/$name.png"
done

step "POST /classify through the published port"
out=$(curl -sS -f -F image=@"$tmp/sneaker.png" "$URL/classify") || fail "/classify"
echo "$out"
grep -q '"label"' <<<"$out" || fail "/classify has no label"

step "POST /gallery/add a new label"
out=$(curl -sS -f "${KEY_HEADER[@]}" -F label=smoke-logo -F images=@"$tmp/logo.png" "$URL/gallery/add") || fail "/gallery/add"
echo "$out"
curl -sS -f "$URL/gallery/labels" | grep -q '"smoke-logo"' || fail "label not listed"

step "compose down, then up: the label survives"
"${COMPOSE[@]}" down
t0=$SECONDS
"${COMPOSE[@]}" up -d || fail "compose up (second) failed; bootstrap: $(bootstrap_state)"
wait_healthy >/dev/null
warm=$((SECONDS - t0))
echo "api healthy ${warm}s after up (warm start: bootstrap finds the model)"
"${COMPOSE[@]}" logs bootstrap | grep -q "nothing to do" || fail "bootstrap retrained on the second up"
labels=$(curl -sS -f "$URL/gallery/labels")
grep -q '"smoke-logo"' <<<"$labels" || fail "smoke-logo lost after down/up: $labels"
echo "smoke-logo still registered: $(grep -o '{[^}]*smoke-logo[^}]*}' <<<"$labels")"
out=$(curl -sS -f -F image=@"$tmp/logo-2.png" "$URL/classify") || fail "/classify after restart"
echo "$out"
grep -q '"label":"smoke-logo"' <<<"$out" || fail "a second drawing of the logo is not smoke-logo"

step "graceful stop (SIGTERM)"
t1=$SECONDS
"${COMPOSE[@]}" stop api
echo "api stopped in $((SECONDS - t1))s; exit code $(docker inspect --format '{{.State.ExitCode}}' "$("${COMPOSE[@]}" ps -q api)")"

echo
echo "SMOKE PASSED: image $((size / 1024 / 1024)) MiB, cold start ${cold}s, warm start ${warm}s"
