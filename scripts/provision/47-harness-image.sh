#!/usr/bin/env bash
# The harness test image $CACHE/harness (a sandbox directory; tests/domains/test_mini_swe_agent.py,
# tests/domains/test_harness_image.py): the domain test image (46-domain-images.sh: python3, git,
# sympy, pytest) plus what the shipped harness recipe installs, sif_recipes/harness-requirements.txt
# (mini-swe-agent, the openai and anthropic SDKs, the OpenAI Agents SDK), unmodified, in the image's
# /usr/lib/python3/dist-packages, with mini-swe-agent's console scripts in /usr/local/bin.
#
# Offline-friendly: the wheels are downloaded once into $CACHE/wheels/harness
# (pip download, from the package index) and installed from there with
# --no-index, so a rebuild needs no network. Idempotent: the stamp names a hash
# of the requirements file and of this script, so changing either rebuilds the
# image and anything else keeps the cached one.
set -euo pipefail
CACHE=${PRORL_TEST_IMAGES:-/var/cache/prorl-test}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
requirements="$here/../../sif_recipes/harness-requirements.txt"
if [ ! -f "$requirements" ]; then
  echo "47-harness-image.sh: $requirements missing" >&2
  exit 1
fi
definition=$(cat "$requirements" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)
stamp="$CACHE/.built-harness-$definition"
if [ -f "$stamp" ] && [ -d "$CACHE/harness" ]; then
  echo "harness test image cached in $CACHE ($stamp)"
  exit 0
fi
if [ ! -f "$CACHE/domains.sif" ]; then
  echo "47-harness-image.sh: $CACHE/domains.sif missing (46-domain-images.sh builds it)" >&2
  exit 1
fi
started=$(date +%s)
# The image's python3 decides the wheels' tags (the test images' Debian python3).
pyver=$(apptainer exec "$CACHE/domains.sif" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
wheels="$CACHE/wheels/harness"
mkdir -p "$wheels"
if [ ! -f "$wheels/.complete-$definition" ]; then
  python3 -m pip download -q -d "$wheels" --python-version "$pyver" --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -r "$requirements"
  touch "$wheels/.complete-$definition"
fi
work=$(mktemp -d /tmp/prorl-harness.XXXXXX)
trap 'rm -rf "$work"' EXIT
export APPTAINER_CACHEDIR="$work/cache" APPTAINER_TMPDIR="$work"
apptainer build --sandbox "$work/rootfs" "$CACHE/domains.sif" >"$work/unpack.log" 2>&1
root="$work/rootfs"
python3 -m pip install -q --no-warn-conflicts --no-compile --no-index --find-links "$wheels" --python-version "$pyver" \
  --only-binary=:all: --target "$root/usr/lib/python3/dist-packages" --upgrade -r "$requirements"
# Compiled wheels (pydantic-core, tiktoken, ...) need libraries the minimal rootfs lacks
# (libgcc_s, libstdc++): copy what their ldd names from this host (same architecture).
find "$root/usr/lib/python3/dist-packages" -name '*.so*' -type f | while read -r so; do
  { ldd "$so" 2>/dev/null || true; } | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  real=$(readlink -f "$lib")
  [ -e "$root$lib" ] || [ -e "$root$real" ] && continue
  mkdir -p "$root$(dirname "$lib")" "$root$(dirname "$real")"
  cp -a "$real" "$root$real"
  [ "$real" = "$lib" ] || ln -sf "$real" "$root$lib"
done
# pip --target leaves console scripts in <target>/bin with this host's interpreter: write the image's own.
rm -rf "$root/usr/lib/python3/dist-packages/bin"
mkdir -p "$root/usr/local/bin"
for script in mini mini-swe-agent; do
  printf '#!/usr/bin/python3\nimport sys\nfrom minisweagent.run.mini import app\nsys.exit(app())\n' \
    >"$root/usr/local/bin/$script"
  chmod 755 "$root/usr/local/bin/$script"
done
# A sandbox directory, not a SIF: Apptainer runs it as is, and squashing 500 MB of
# site-packages on a busy 2-core VM took a quarter of an hour.
chmod -R a+rX "$root"
env -i PATH=/usr/bin:/bin apptainer exec --containall --env LITELLM_LOCAL_MODEL_COST_MAP=True "$root" \
  python3 -c "import minisweagent.run.mini, litellm, openai, anthropic, agents"
rm -rf "$CACHE/harness"
mv "$root" "$CACHE/harness"
rm -f "$CACHE"/.built-harness-*
touch "$stamp"
echo "harness test image built in $(( $(date +%s) - started )) s: $(du -sh "$CACHE/harness" | cut -f1) ($stamp)"
