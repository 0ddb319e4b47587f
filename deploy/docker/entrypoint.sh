#!/bin/sh
# The image's ENTRYPOINT: runs its arguments (the CMD, or compose's `command`) unchanged, except
# that `kvhandoff prefill|decode` gets its role's documented port (50061 / 50051) when
# KVHANDOFF_PORT is unset, so a plain `docker run IMAGE kvhandoff decode` listens where the
# image's HEALTHCHECK looks (the same ports as the CLI's defaults, set explicitly so that the
# HEALTHCHECK does not depend on them).
# Kubernetes' `command` replaces this entrypoint; the manifests set KVHANDOFF_PORT themselves.
set -eu
if [ "${1:-}" = kvhandoff ] && [ -z "${KVHANDOFF_PORT:-}" ]; then
    case "${2:-}" in
        prefill) KVHANDOFF_PORT=50061; export KVHANDOFF_PORT ;;
        decode) KVHANDOFF_PORT=50051; export KVHANDOFF_PORT ;;
    esac
fi
exec "$@"
