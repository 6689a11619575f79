#!/usr/bin/env bash
# Fetches NIXL's libraries for `ferry serve --kv-transport nixl` (a build with `--features
# nixl`) and prints the folder to pass as --nixl-lib-dir (ferry also finds it there by itself).
# Idempotent: an unpacked copy is kept.
#
# What it does: `pip download --no-deps` of PyPI's nixl-cu12 wheel, pinned to the wheel's
# own tags, then unpacks its two library folders into the cache folder, the same one the
# model goes to (${FERRY_CACHE:-$HOME/.cache/ferry}/nixl/<version>). Nothing is installed into
# any Python. The wheel (~69 MB) carries libnixl_capi.so, libnixl.so, the UCX plugin and UCX
# itself, and none of them needs CUDA to load, so the UCX backend runs on a CPU-only machine.
# Their run paths ($ORIGIN/...) need the wheel's layout, which the unpacked copy keeps:
#   nixl/<version>/lib             .nixl_cu12.mesonpy.libs (libnixl_capi.so, plugins/)
#   nixl/<version>/nixl_cu12.libs  UCX and the other bundled libraries
# PYTHON picks the interpreter whose pip is used (default python3).
set -euo pipefail

version=1.5.1
cache="${FERRY_CACHE:-$HOME/.cache/ferry}/nixl/$version"
if [ -f "$cache/lib/libnixl_capi.so" ] && [ -f "$cache/lib/plugins/libplugin_UCX.so" ]; then
    echo "$cache/lib"
    exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"${PYTHON:-python3}" -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 \
    --platform manylinux_2_28_x86_64 -d "$tmp" "nixl-cu12==$version" >&2
wheel="$(ls "$tmp"/nixl_cu12-"$version"-*.whl)"
"${PYTHON:-python3}" - "$wheel" "$tmp/unpacked" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith((".nixl_cu12.mesonpy.libs/", "nixl_cu12.libs/")):
            z.extract(name, out)
PY
rm -rf "$cache.partial"
mkdir -p "$cache.partial"
mv "$tmp/unpacked/.nixl_cu12.mesonpy.libs" "$cache.partial/lib"
mv "$tmp/unpacked/nixl_cu12.libs" "$cache.partial/nixl_cu12.libs"
rm -rf "$cache"
mv "$cache.partial" "$cache"
echo "$cache/lib"
