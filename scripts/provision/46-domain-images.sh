#!/usr/bin/env bash
# The test image of the task domains (tests/domains, benchmarks/domains.py),
# built once into the test image cache, offline, in seconds:
#   domains.sif   the python-rootfs test image (45-test-images.sh) plus this
#                 host's git (for swe) and, pip-installed into
#                 /usr/lib/python3/dist-packages, sympy (the math tool) and
#                 pytest (swe's test runs)
# Real deployments build the shipped recipes instead (sif_recipes/images.yaml:
# math, code, swe), which need a Debian mirror.
set -euo pipefail
CACHE=${PRORL_TEST_IMAGES:-/var/cache/prorl-test}
stamp="$CACHE/.built-domains-v1"
if [ -f "$stamp" ]; then
  echo "domain test image cached in $CACHE"
  exit 0
fi
if [ ! -d "$CACHE/python-rootfs" ]; then
  echo "46-domain-images.sh: $CACHE/python-rootfs missing (45-test-images.sh builds it)" >&2
  exit 1
fi
work=$(mktemp -d /tmp/prorl-domains.XXXXXX)
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"
cp -a "$CACHE/python-rootfs" "$root"
chown -R root: "$root"
# git and its helpers, with their shared libraries.
cp -a /usr/bin/git "$root/usr/bin/git"
mkdir -p "$root/usr/lib" "$root/usr/share"
cp -a /usr/lib/git-core "$root/usr/lib/git-core"
[ -d /usr/share/git-core ] && cp -a /usr/share/git-core "$root/usr/share/git-core"
for lib in $(ldd /usr/bin/git | awk '/=> \// {print $3}' | sort -u); do
  real=$(readlink -f "$lib")
  mkdir -p "$root$(dirname "$lib")" "$root$(dirname "$real")"
  [ -e "$root$real" ] || cp -a "$real" "$root$real"
  [ "$real" = "$lib" ] || ln -sf "$real" "$root$lib"
done
printf '[safe]\n\tdirectory = *\n[user]\n\tname = prorl\n\temail = prorl@example.invalid\n' >"$root/etc/gitconfig"
# Pure-Python packages for the image's python3 (the system python's dist-packages path).
python3 -m pip install -q --no-compile --target "$root/usr/lib/python3/dist-packages" sympy pytest
cat >"$work/domains.def" <<DEF
Bootstrap: scratch
%setup
    cp -a $root/. \${APPTAINER_ROOTFS}/
DEF
export APPTAINER_CACHEDIR="$work/cache" APPTAINER_TMPDIR="$work"
# lz4, not the default gzip: squashing the ~130 MB tree costs under a CPU-second instead of ~25.
if ! apptainer build --force --mksquashfs-args "-comp lz4" "$work/domains.sif" "$work/domains.def" >"$work/build.log" 2>&1; then
  tail -n 30 "$work/build.log" >&2
  echo "46-domain-images.sh: apptainer build failed" >&2
  exit 1
fi
mv -f "$work/domains.sif" "$CACHE/domains.sif"
chmod a+r "$CACHE/domains.sif"
touch "$stamp"
ls -la "$CACHE/domains.sif"
