#!/usr/bin/env bash
# The compose `scale` profile end to end against any Docker engine (not run in CI: no engine):
# PostgreSQL, the bootstrap job, SNCA_REPLICAS replicas, nginx on SNCA_SCALE_PORT.
#
#   docker/scale-smoke.sh                   # build snca:cpu, up the profile, check, down -v
#   SKIP_BUILD=1 KEEP=1 docker/scale-smoke.sh
#   LEAN=1 docker/scale-smoke.sh           # (the default on vfs storage, a full image copy per
#                                           # container): the bootstrap job runs with `run --rm` first
#   LOCAL_IMAGES=1 BUILD_ARGS="--network host --build-arg BASE_IMAGE=local/python:3.11-bookworm \
#     --build-arg TORCH_INDEX_URL=" SNCA_DATASET_DIR=/usr/share/datasets docker/scale-smoke.sh
#                                           # the sandbox of ../shared/tools: no registry, so
#                                           # postgres and nginx are built from Debian packages
#                                           # (docker/sandbox/) under the official images' tags
#
# Checks: every replica healthy and behind the balancer; an add through the balancer, then a
# classify through it with X-Min-Gallery-Version on each replica in turn answers the new label;
# every replica reports the same gallery_version and checksum; the gallery is in PostgreSQL.
set -euo pipefail
cd "$(dirname "$0")/.."
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-sncascale}
export SNCA_SCALE_PORT=${SNCA_SCALE_PORT:-8080} SNCA_REPLICAS=${SNCA_REPLICAS:-3}
URL="http://127.0.0.1:${SNCA_SCALE_PORT}"
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
COMPOSE+=(--profile scale)
step() { printf '\n== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }
fail() { echo "SCALE SMOKE FAILED: $*" >&2; "${COMPOSE[@]}" logs --tail 40 >&2 || true; exit 1; }
cleanup() { [ -n "${KEEP:-}" ] || "${COMPOSE[@]}" down -v >/dev/null 2>&1 || true; }
trap cleanup EXIT

step "compose config (profile scale)"
"${COMPOSE[@]}" config -q && echo "config ok"

if [ -n "${LOCAL_IMAGES:-}" ]; then
    step "stand-ins for the official postgres and nginx images (Debian packages)"
    base=$(sed -n 's/.*BASE_IMAGE=\([^ ]*\).*/\1/p' <<<"${BUILD_ARGS:-}")
    docker build --network host ${base:+--build-arg BASE_IMAGE=$base} -f docker/sandbox/postgres.Dockerfile \
        -t postgres:15-bookworm docker/sandbox
    docker build --network host ${base:+--build-arg BASE_IMAGE=$base} -f docker/sandbox/nginx.Dockerfile \
        -t nginx:1.27-bookworm docker/sandbox
fi
if [ -z "${SKIP_BUILD:-}" ]; then
    step "build snca:cpu"
    # shellcheck disable=SC2086
    docker build ${BUILD_ARGS:-} -f docker/Dockerfile -t snca:cpu .
fi

step "up: postgres, bootstrap, $SNCA_REPLICAS replicas, lb"
start=$SECONDS
[ "$(docker info --format '{{.Driver}}' 2>/dev/null)" = vfs ] && LEAN=${LEAN:-1}
if [ -n "${LEAN:-}" ]; then
    # vfs engines copy the whole image per container: run the one-shot job and remove it
    # before the replicas start (the same order `up lb` follows, one container fewer at a time)
    "${COMPOSE[@]}" up -d postgres || fail "postgres"
    "${COMPOSE[@]}" run --rm bootstrap || fail "bootstrap"
    "${COMPOSE[@]}" up -d --no-deps --scale replica="$SNCA_REPLICAS" replica || fail "replicas"
    "${COMPOSE[@]}" up -d --no-deps lb || fail "lb"
else
    "${COMPOSE[@]}" up -d --scale replica="$SNCA_REPLICAS" lb || fail "compose up"
fi
until curl -sf "$URL/readyz" >/dev/null; do
    (( SECONDS - start < ${TIMEOUT:-1800} )) || fail "the balancer did not answer /readyz"
    sleep 3
done
echo "ready through the balancer after $((SECONDS - start)) s"

hosts() {  # the replicas the balancer reaches, each once at version >= $1: hostname, version, checksum
    # (/readyz ignores X-Min-Gallery-Version, so a replica behind is asked again)
    for _ in $(seq $((SNCA_REPLICAS * 4))); do
        for _try in $(seq 100); do
            line=$(curl -sf "$URL/readyz" | python3 -c 'import json,sys; d=json.load(sys.stdin); d["gallery_version"] >= int(sys.argv[1]) or sys.exit(1); print(d["hostname"], d["gallery_version"], d["gallery_checksum"], d["store"])' "${1:-0}") && break
            sleep 0.1
        done
        echo "$line"
    done | sort -u
}
step "replicas behind the balancer"
hosts 0
n=$(hosts 0 | cut -d' ' -f1 | sort -u | wc -l)
[ "$n" = "$SNCA_REPLICAS" ] || fail "$n replicas answered, expected $SNCA_REPLICAS"

step "add through the balancer, classify on every replica"
img=$(mktemp --suffix=.png)
python3 - "$img" <<'PY'
import struct, sys, zlib
w = h = 28  # a white square on black: an image no trained class looks like
rows = b"".join(b"\0" + bytes(255 if 8 <= x < 20 and 8 <= y < 20 else 0 for x in range(w)) for y in range(h))
def chunk(t, d): return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
open(sys.argv[1], "wb").write(png)
PY
add=$(curl -sf -F label=scale-square -F "images=@$img" "$URL/gallery/add") || fail "add"
v=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["gallery_version"])' "$add")
echo "added: $add"
for i in $(seq $((SNCA_REPLICAS * 2))); do
    got=$(curl -sf -H "X-Min-Gallery-Version: $v" -F "image=@$img" "$URL/classify?labels=scale-square&labels=Bag") || fail "classify"
    label=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["label"])' "$got")
    echo "classify $i: $label"
    [ "$label" = scale-square ] || fail "classify answered $label"
done
after=$(hosts "$v")
echo "$after"
[ "$(cut -d' ' -f2,3 <<<"$after" | sort -u | wc -l)" = 1 ] || fail "replicas differ"
rm -f "$img"
echo "SCALE SMOKE PASSED"
