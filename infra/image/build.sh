#!/bin/bash
# Builds the registry-free Triton CPU image (no Docker Hub/NGC here):
#   debootstrap bookworm minbase (cached) -> chroot: venv + pytriton + torch CPU
#   -> docker import with ENTRYPOINT tritonserver -> smoke test -> tag.
#
# Usage: infra/image/build.sh [IMAGE]        (default stoker/triton-cpu:2.51.0-cpu)
#        infra/image/build.sh --print-recipe  (print the recipe digest and exit)
# Env:   STOKER_CACHE_DIR  cache for the base rootfs and pip downloads
#                          (default $STOKER_HOME/cache, else /var/cache/stoker)
#        STOKER_WHEELS_DIR folder holding the torch CPU wheel (default /opt/wheels)
#        PIP_CERT          CA bundle pip uses inside the chroot (default: the host's
#                          /etc/ssl/certs/ca-certificates.crt, which may hold a proxy's CA)
#        STOKER_PYTHON     interpreter whose `pip config list` names the package index (default python3)
#        DOCKER_HOST       honoured by the docker CLI
# Mirrors: the Debian mirror is the one this machine's apt uses for $SUITE main, and pip in the chroot
# uses this machine's index settings (stoker/stack/mirrors.py): the repository names no package host.
# Prints "[build  Ns] ..." progress lines; exits non-zero with a one-line cause.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
image=${1:-stoker/triton-cpu:2.51.0-cpu}
# shellcheck source=versions.env
. "$here/versions.env"
if [ -n "${STOKER_CACHE_DIR:-}" ]; then cache=$STOKER_CACHE_DIR
elif [ -n "${STOKER_HOME:-}" ]; then cache=$STOKER_HOME/cache
else cache=/var/cache/stoker; fi
wheels_dir=${STOKER_WHEELS_DIR:-/opt/wheels}
pip_cert=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
py=${STOKER_PYTHON:-python3}
mirrors_py=$here/../../stoker/stack/mirrors.py
site=/opt/venv/lib/python${PYTHON_VERSION}/site-packages

t0=$SECONDS
step() { printf '[build %4ds] %s\n' $((SECONDS - t0)) "$*"; }
die() { echo "build.sh: $*" >&2; exit 1; }

# The recipe digest: sha256 over "sha256  relative/path" lines of every file in
# this folder (C-sorted). stoker/stack/image.py computes the same value.
recipe_digest() {
    (cd "$here" && find . -type f ! -path '*/__pycache__/*' ! -name '*.pyc' \
        | sed 's|^\./||' | LC_ALL=C sort | while IFS= read -r f; do sha256sum "$f"; done) \
        | sha256sum | cut -d' ' -f1
}

if [ "$image" = "--print-recipe" ]; then
    recipe_digest
    exit 0
fi

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap and chroot need it)"
for tool in debootstrap docker chroot flock "$py"; do
    command -v "$tool" >/dev/null || die "$tool not found (apt-get install -y debootstrap docker.io)"
done
[ -f "$wheels_dir/$TORCH_WHEEL" ] || die "torch CPU wheel missing: $wheels_dir/$TORCH_WHEEL"
docker info >/dev/null 2>&1 || die "docker daemon not reachable (run infra/dockerd.sh)"
debian_mirror=$("$py" "$mirrors_py" debian "$SUITE" 2>&1) || die "Debian mirror: ${debian_mirror#mirrors: }"
# NAME=VALUE lines (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST); none means pip's default index.
mapfile -t pip_env < <("$py" "$mirrors_py" pip-env)

recipe=$(recipe_digest)
step "building $image (recipe ${recipe:0:16}…, cache $cache)"

mkdir -p "$cache"
exec 9>"$cache/build.lock"
flock -w 1800 9 || die "another build holds $cache/build.lock"

base_key=$(printf '%s\n' "$SUITE" "$debian_mirror" "$ROOTFS_PACKAGES" minbase | sha256sum | cut -c1-16)
base_tar=$cache/rootfs-$SUITE-minbase-$base_key.tar
work=$(mktemp -d "$cache/work.XXXXXX")
rootfs=$work/rootfs
wheelhouse=$cache/wheels
smoke_name=stoker-image-smoke-$$
tmp_tag=stoker/triton-cpu-build:$$

cleanup() {
    set +e
    # Unmount anything left under the work dir (deepest first) before deleting it.
    grep -o " $work[^ ]*" /proc/mounts | sort -r | while read -r m; do umount -l "$m" || true; done
    [ -d "$rootfs/tmp/stoker-wheels" ] && rm -rf "$wheelhouse" && mv "$rootfs/tmp/stoker-wheels" "$wheelhouse"
    rm -rf "$work"
    docker rm -f "$smoke_name" >/dev/null 2>&1 || true
    docker rmi "$tmp_tag" >/dev/null 2>&1 || true
}
trap cleanup EXIT

mkdir "$rootfs"
if [ -f "$base_tar" ]; then
    step "base rootfs: reusing $base_tar"
    tar -C "$rootfs" -xf "$base_tar"
else
    step "base rootfs: debootstrap --variant=minbase $SUITE (+$ROOTFS_PACKAGES) from $debian_mirror, ~2 min"
    # Only the phase lines of debootstrap; per-package lines go to the log.
    if ! debootstrap --variant=minbase --include="$ROOTFS_PACKAGES" "$SUITE" "$rootfs" "$debian_mirror" \
            > "$work/debootstrap.log" 2>&1; then
        tail -n 20 "$work/debootstrap.log" >&2
        die "debootstrap failed (see lines above)"
    fi
    grep -E '^I: (Retrieving Release|Resolving|Found|Checking component|Installing core|Unpacking the|Configuring the|Base system)' \
        "$work/debootstrap.log" | sed 's/^I: /    debootstrap: /' | awk '!seen[$0]++'
    tar -C "$rootfs" -cf "$base_tar.tmp" . && mv "$base_tar.tmp" "$base_tar"
    step "base rootfs cached at $base_tar"
fi

step "chroot: venv + Python packages"
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
mkdir -p "$rootfs/tmp/stoker-build" "$wheelhouse"
cp "$here/versions.env" "$here/rootfs-setup.sh" "$rootfs/tmp/stoker-build/"
# Build-time only (deleted with /tmp/stoker-build): the host's CA bundle, since
# HTTPS here may go through an intercepting proxy the image's bundle does not trust.
cp "$pip_cert" "$rootfs/tmp/stoker-build/host-ca.crt"
cp -l "$wheels_dir/$TORCH_WHEEL" "$rootfs/tmp/stoker-build/" 2>/dev/null \
    || cp "$wheels_dir/$TORCH_WHEEL" "$rootfs/tmp/stoker-build/"
# The wheelhouse lives outside the image; moving it in and out is a rename.
mv "$wheelhouse" "$rootfs/tmp/stoker-wheels"
mount -t proc proc "$rootfs/proc"
# The host's index settings, minus what names host folders: find-links (the torch wheel is copied in
# above) and file:// indexes (their pages link files elsewhere on the host). pip skips a missing file://
# index silently, so leaving one in would only hide that it was never used.
chroot_pip_env=()
for kv in "${pip_env[@]}"; do
    urls=()
    read -ra values <<<"${kv#*=}"
    for url in "${values[@]}"; do
        case $url in
            file:*) step "pip: not using host-only index $url in the chroot" ;;
            *) urls+=("$url") ;;
        esac
    done
    if [ ${#urls[@]} -gt 0 ]; then chroot_pip_env+=("${kv%%=*}=${urls[*]}"); fi
done
step "pip index: ${chroot_pip_env[*]:-the default of pip}"
chroot "$rootfs" /usr/bin/env -i HOME=/root LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_NO_CACHE_DIR=1 PIP_CERT=/tmp/stoker-build/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 \
    "${chroot_pip_env[@]}" \
    /bin/bash /tmp/stoker-build/rootfs-setup.sh 2>&1 | sed 's/^/    /'
umount "$rootfs/proc"
mv "$rootfs/tmp/stoker-wheels" "$wheelhouse"
: > "$rootfs/etc/resolv.conf"   # docker provides its own at run time

step "docker import"
tar -C "$rootfs" --numeric-owner -c . | docker import \
    --change "ENV PATH=/opt/tritonserver/bin:/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV LD_LIBRARY_PATH=$site/nvidia_pytriton.libs" \
    --change "ENV LANG=C.UTF-8" \
    --change 'ENTRYPOINT ["/opt/tritonserver/bin/tritonserver"]' \
    --change "LABEL ai.stoker.recipe=$recipe" \
    --change "LABEL ai.stoker.triton-version=$TRITON_VERSION" \
    - "$tmp_tag" >/dev/null

step "smoke test: python-backend model importing torch, numpy, safetensors, tokenizers"
# create + cp + start (not a bind mount) so this also works against a remote DOCKER_HOST.
docker create --name "$smoke_name" "$tmp_tag" --model-repository=/models >/dev/null
docker cp "$here/smoke/." "$smoke_name:/models"
docker start "$smoke_name" >/dev/null
if ! docker exec -i "$smoke_name" python3 - < "$here/smoke_check.py" | sed 's/^/    /'; then
    docker logs --tail 30 "$smoke_name" 2>&1 | sed 's/^/    triton: /' >&2
    die "smoke test failed: the image cannot serve a python-backend model"
fi
docker rm -f "$smoke_name" >/dev/null

old_id=$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)
docker tag "$tmp_tag" "$image"
docker rmi "$tmp_tag" >/dev/null
new_id=$(docker image inspect -f '{{.Id}}' "$image")
if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ]; then
    # Best effort: fails (harmlessly) while a container still uses the old image.
    docker rmi "$old_id" >/dev/null 2>&1 || true
fi
size=$(docker image inspect -f '{{.Size}}' "$image")
step "done: $image $new_id ($((size / 1000000)) MB)"
