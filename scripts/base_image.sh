#!/usr/bin/env bash
# Build the image's base locally, for machines that reach Debian's package archive but no image
# registry: debootstrap a minimal Debian with its python3 (+ venv), then `docker import` it.
#
#   bash scripts/base_image.sh [TAG]        # default tag: kvhandoff-base:bookworm
#   docker build --build-arg BASE_IMAGE=kvhandoff-base:bookworm ...
#
# Environment: SUITE (bookworm), MIRROR (the first deb.debian.org-style URI apt uses here),
# BASE_INCLUDE (extra packages, comma separated, e.g. gcc,libc6-dev for Triton on CUDA).
# Does nothing when TAG already exists (FORCE=1 rebuilds). Needs root, debootstrap, docker.
# The image has what the Dockerfile expects of python:3.11-slim: python3 (also as `python`),
# `python3 -m venv` with an offline pip (ensurepip), useradd.
set -euo pipefail

TAG=${1:-kvhandoff-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-}
INCLUDE="python3,python3-venv,python-is-python3,passwd${BASE_INCLUDE:+,$BASE_INCLUDE}"

if [[ -z "${FORCE:-}" ]] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "base_image: $TAG exists (FORCE=1 to rebuild)"
    exit 0
fi
if [[ -z "$MIRROR" ]]; then
    # The archive apt already uses here (deb822 or one-line sources), else Debian's default.
    MIRROR=$(grep -hoE '(URIs:|^deb) +https?://[^ ]+/debian/?( |$)' \
        /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
        | head -n1 | awk '{print $2}' || true)
    MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi
command -v debootstrap >/dev/null || {
    echo "base_image: debootstrap missing (apt-get install debootstrap)" >&2
    exit 1
}

root=$(mktemp -d /var/tmp/kvhandoff-base.XXXXXX)
cleanup() {
    # A debootstrap that failed half-way may leave /proc or /sys mounted inside the root.
    awk -v r="$root/" 'index($2, r) == 1 {print $2}' /proc/mounts | sort -r \
        | while read -r mount; do umount -l "$mount" || true; done
    rm -rf --one-file-system "$root" "$root.log"
}
trap cleanup EXIT
echo "base_image: debootstrap $SUITE from $MIRROR (packages: $INCLUDE)"
debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$root" "$MIRROR" \
    >"$root.log" 2>&1 || { tail -n 30 "$root.log" >&2; exit 1; }
# Slim like the python:*-slim images: no apt lists, caches, docs or man pages.
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* \
    "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/tmp/* "$root"/var/tmp/*
tar --numeric-owner -C "$root" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --message "debootstrap $SUITE minbase + $INCLUDE" - "$TAG" >/dev/null
docker run --rm --network none "$TAG" python3 -c \
    'import sys, venv, ensurepip; print("base_image: python", sys.version.split()[0])'
docker image ls "$TAG" --format 'base_image: {{.Repository}}:{{.Tag}} {{.Size}}'
