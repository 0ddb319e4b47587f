#!/usr/bin/env bash
# Gather every wheel the image needs into wheels/ on the host, so `docker build` installs them
# with `pip install --no-index` and needs no network inside the build.
#
#   bash scripts/gather_wheels.sh [BASE_IMAGE]      # default: kvhandoff-base:bookworm
#
# The wheels are chosen for the base image's Python (version and glibc, asked of the image
# itself with --network none), not for the host's: a cp311 image gets cp311 wheels even when
# the host runs another Python. Writes wheels/requirements.txt: the exact pins (name==version)
# the build installs, i.e. the lock of this image. Environment: TORCH_VERSION (2.13.0; pip
# finds it where pip is configured to look, e.g. a local CPU build), WHEELS_DIR (wheels),
# PY_TAG/GLIBC to skip asking the image (e.g. PY_TAG=3.11 GLIBC=2.36).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=${1:-kvhandoff-base:bookworm}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
WHEELS_DIR=${WHEELS_DIR:-wheels}
PIP=${PIP:-python3 -m pip}

if [[ -z "${PY_TAG:-}" || -z "${GLIBC:-}" ]]; then
    read -r PY_TAG GLIBC < <(docker run --rm --network none "$BASE" python3 -c \
        'import platform, sys; print("%d.%d" % sys.version_info[:2], platform.libc_ver()[1])')
fi
abi="cp${PY_TAG/./}"
arch=$(uname -m)
# Every manylinux tag the image's glibc accepts (older pips do not expand one into the rest).
platforms=(--platform any)
for ((minor = ${GLIBC#*.}; minor >= 17; minor--)); do
    platforms+=(--platform "manylinux_2_${minor}_$arch")
done
platforms+=(--platform "manylinux2014_$arch" --platform "manylinux2010_$arch" \
    --platform "manylinux1_$arch")
echo "gather_wheels: for $BASE: python $PY_TAG ($abi), glibc $GLIBC, $arch"

# The project's runtime requirements, read from pyproject.toml (markers kept for pip).
mapfile -t deps < <(python3 - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
for dep in project["dependencies"]:
    if not dep.replace(" ", "").startswith("torch>") and dep.split()[0] != "torch":
        print(dep)
PY
)
build_deps=$(python3 -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')

mkdir -p "$WHEELS_DIR"
find "$WHEELS_DIR" -maxdepth 1 -name '*.whl' -delete
rm -f "$WHEELS_DIR/requirements.txt"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! $PIP download -q --dest "$WHEELS_DIR" --only-binary=:all: \
        --python-version "$PY_TAG" --implementation cp --abi "$abi" --abi abi3 --abi none \
        "${platforms[@]}" "torch==$TORCH_VERSION" "${deps[@]}" $build_deps >"$log" 2>&1; then
    grep -v "^WARNING: Location 'file:" "$log" >&2
    exit 1
fi
# Every wheel pinned: the build installs exactly these (torch needs setuptools at run time too).
python3 - "$WHEELS_DIR" <<'PY'
import pathlib, sys
wheels = sorted(pathlib.Path(sys.argv[1]).glob("*.whl"))
pins = ["==".join(w.name.split("-")[:2]) for w in wheels]
if not any(p.lower().startswith("torch==") for p in pins):
    sys.exit("gather_wheels: no torch wheel was gathered")
(pathlib.Path(sys.argv[1]) / "requirements.txt").write_text("\n".join(pins) + "\n")
print(f"gather_wheels: {len(pins)} wheels, pinned in {sys.argv[1]}/requirements.txt")
PY
du -sh "$WHEELS_DIR" | sed 's/^/gather_wheels: /'
