#!/usr/bin/env bash
# Test images for the sandbox tests, built once into a cache readable by the
# unprivileged test user (a later run reuses them):
#   busybox.sif          Bootstrap: scratch + busybox-static (no python3: the
#                        tool server must refuse it with a clear error)
#   python.sif, python/  Bootstrap: scratch + busybox + this host's python3
#                        and its stdlib and shared libraries (seconds to build,
#                        no network; as a SIF and as a sandbox directory)
#   python-rootfs/       the same tree unpacked, for bubblewrap
set -euo pipefail
. /etc/os-release
CACHE=${PRORL_TEST_IMAGES:-/var/cache/prorl-test}
mkdir -p "$CACHE"
chmod 755 "$CACHE"
stamp="$CACHE/.built-v3"
if [ -f "$stamp" ]; then
  echo "test images cached in $CACHE"
  exit 0
fi
work=$(mktemp -d /tmp/prorl-images.XXXXXX)
trap 'rm -rf "$work"' EXIT

# --- busybox scratch image -------------------------------------------------
mkdir -p "$work/busybox"
cp /bin/busybox "$work/busybox/busybox"
cat >"$work/busybox.def" <<DEF
Bootstrap: scratch
%setup
    mkdir -p \${APPTAINER_ROOTFS}/bin \${APPTAINER_ROOTFS}/tmp \${APPTAINER_ROOTFS}/etc
    cp $work/busybox/busybox \${APPTAINER_ROOTFS}/bin/busybox
    for tool in \$(\${APPTAINER_ROOTFS}/bin/busybox --list); do
      [ -e \${APPTAINER_ROOTFS}/bin/\$tool ] || ln -s busybox \${APPTAINER_ROOTFS}/bin/\$tool
    done
%runscript
    exec /bin/sh "\$@"
DEF

# --- python3 rootfs from the host's own files -------------------------------
root="$work/rootfs"
py=$(readlink -f /usr/bin/python3)   # the system python (python3.11 on Debian 12), not a pyenv shim
pyver=$(basename "$py")                          # python3.11
mkdir -p "$root"/{bin,usr/bin,usr/lib,tmp,etc,root,proc,sys,dev,home}
chmod 1777 "$root/tmp"
cp /bin/busybox "$root/bin/busybox"
for tool in $("$root/bin/busybox" --list); do
  [ -e "$root/bin/$tool" ] || ln -s busybox "$root/bin/$tool"
done
cp -a "$(readlink -f /bin/bash)" "$root/usr/bin/bash"
ln -sf ../usr/bin/bash "$root/bin/bash" 2>/dev/null || true
cp -a "$py" "$root/usr/bin/$pyver"
ln -s "$pyver" "$root/usr/bin/python3"
# The stdlib (without test suites and third-party packages).
tar -C / --exclude="usr/lib/$pyver/test" --exclude="usr/lib/$pyver/dist-packages" \
    --exclude="usr/lib/$pyver/site-packages" --exclude='__pycache__' \
    -cf - "usr/lib/$pyver" | tar -C "$root" -xf -
# Shared libraries of python, bash and the stdlib's extension modules.
libs=$( { ldd "$py"; ldd /bin/bash; for so in /usr/lib/"$pyver"/lib-dynload/*.so; do ldd "$so"; done; } 2>/dev/null \
        | awk '/=> \// {print $3} /^\t\/lib/ {print $1}' | sort -u)
for lib in $libs; do
  real=$(readlink -f "$lib")
  mkdir -p "$root$(dirname "$lib")" "$root$(dirname "$real")"
  cp -a "$real" "$root$real"
  [ "$real" = "$lib" ] || ln -sf "$real" "$root$lib"
done
# The dynamic loader at its canonical path (/lib64 may be a link on merged-/usr systems).
mkdir -p "$root/lib64"
[ -e "$root/lib64/ld-linux-x86-64.so.2" ] || cp -a "$(readlink -f /lib64/ld-linux-x86-64.so.2)" "$root/lib64/ld-linux-x86-64.so.2"
echo "root:x:0:0:root:/root:/bin/sh" >"$root/etc/passwd"
echo "root:x:0:" >"$root/etc/group"
cat >"$work/python.def" <<DEF
Bootstrap: scratch
%setup
    cp -a $root/. \${APPTAINER_ROOTFS}/
DEF

# --- build (as root: --fakeroot needs root's subuid line from 40-testuser.sh) -
export APPTAINER_CACHEDIR="$work/cache" APPTAINER_TMPDIR="$work"
build() {  # quiet unless it fails
  if ! apptainer build --force "$@" >"$work/build.log" 2>&1; then
    tail -n 30 "$work/build.log" >&2
    echo "45-test-images.sh: apptainer build $* failed" >&2
    exit 1
  fi
}
# lz4, not the default gzip: squashing costs a fraction of a CPU-second instead of tens (test images only).
build --mksquashfs-args "-comp lz4" "$work/busybox.sif" "$work/busybox.def"
build --mksquashfs-args "-comp lz4" "$work/python.sif" "$work/python.def"
rm -rf "$CACHE/python" "$CACHE/python-rootfs"
build --sandbox "$CACHE/python" "$work/python.sif"
cp -a "$root" "$CACHE/python-rootfs"
mv -f "$work/busybox.sif" "$CACHE/busybox.sif"
mv -f "$work/python.sif" "$CACHE/python.sif"
chmod -R a+rX "$CACHE"
# A sandbox directory must belong to the user who runs it with --fakeroot
# (files of unmapped owners are read-only there): it is the test user's.
if id -u prorl-test >/dev/null 2>&1; then
  chown -R prorl-test: "$CACHE/python" "$CACHE/python-rootfs"
fi
touch "$stamp"
ls -la "$CACHE"
