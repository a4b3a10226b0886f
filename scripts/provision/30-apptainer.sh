#!/usr/bin/env bash
# A real Apptainer (rootless) on Debian 12 or 13.
#
# Debian 12 ships no apptainer; Debian's "sid" suite has 1.4.x, built against
# glibc >= 2.38. We fetch the .deb from sid through the mirror this machine
# already uses (read from its apt configuration; no host is named here):
#   Debian 13: install the .deb with its dependencies.
#   Debian 12: unpack it at /, unpack trixie's libc6 into a private directory
#              and point apptainer's two ELF executables at that libc with
#              patchelf (--force-rpath: RUNPATH is ignored when apptainer
#              re-executes itself).
# Finally, as this machine's container lacks a capability root's default set
# needs, set "root default capabilities = no" (root then runs with --userns
# or --fakeroot; ordinary users are unaffected).
set -euo pipefail
. /etc/os-release
export DEBIAN_FRONTEND=noninteractive
PRIVATE_LIBC=/opt/prorl-apptainer-libc

apptainer_works() {
  command -v apptainer >/dev/null 2>&1 && apptainer --version >/dev/null 2>&1
}

# The URI of the Debian archive this machine uses for its own release.
debian_mirror() {
  local f uri
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -e "$f" ] || continue
    # deb822 stanzas: take the URIs of a stanza whose Suites name our codename.
    uri=$(awk -v code="$VERSION_CODENAME" '
      BEGIN { RS=""; FS="\n" }
      {
        uris=""; ok=0
        for (i=1;i<=NF;i++) {
          if ($i ~ /^URIs:/) { sub(/^URIs:[ \t]*/, "", $i); split($i, u, /[ \t]+/); uris=u[1] }
          if ($i ~ /^Suites:/) { n=split($i, s, /[ \t]+/); for (j=2;j<=n;j++) if (s[j]==code) ok=1 }
        }
        if (ok && uris != "") { print uris; exit }
      }' "$f")
    if [ -n "$uri" ]; then echo "$uri"; return 0; fi
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -e "$f" ] || continue
    uri=$(awk -v code="$VERSION_CODENAME" '
      $1=="deb" { for (i=2;i<=NF;i++) if ($i !~ /^\[/ && $i ~ /:\/\//) { if ($(i+1)==code) { print $i; exit } } }' "$f")
    if [ -n "$uri" ]; then echo "$uri"; return 0; fi
  done
  echo "30-apptainer.sh: no apt source for ${VERSION_CODENAME} found in /etc/apt" >&2
  return 1
}

configure() {
  local conf=/etc/apptainer/apptainer.conf
  if [ -f "$conf" ] && ! grep -q '^root default capabilities = no' "$conf"; then
    sed -i 's/^root default capabilities = .*/root default capabilities = no/' "$conf"
    grep -q '^root default capabilities = no' "$conf" || echo 'root default capabilities = no' >>"$conf"
  fi
}

if apptainer_works; then
  configure
  apptainer --version
  exit 0
fi

case "${ID}:${VERSION_ID:-}" in
  debian:12|debian:13) ;;
  *) echo "30-apptainer.sh: only Debian 12 and 13 are supported (found ${PRETTY_NAME:-$ID})" >&2; exit 1 ;;
esac

mirror=$(debian_mirror)
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
work=$(mktemp -d /tmp/prorl-apptainer.XXXXXX)
chmod 755 "$work"  # apt downloads as the _apt user
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/archives/partial"
cat >"$work/sources.list" <<SOURCES
deb [signed-by=$keyring] $mirror sid main
deb [signed-by=$keyring] $mirror trixie main
SOURCES
# A throwaway apt state: the machine's own lists and sources stay untouched.
apt_extra=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
           -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::Archives=$work/archives"
           -o "APT::Default-Release=" -o "Debug::NoLocking=1")
apt-get "${apt_extra[@]}" update -qq
cd "$work"
apt-get "${apt_extra[@]}" download "apptainer/sid"
deb=$(ls "$work"/apptainer_*.deb)

# Runtime dependencies available in both releases.
deps=(squashfs-tools uidmap libseccomp2 libsqlite3-0 fuse2fs squashfuse fuse-overlayfs ca-certificates)
if [ "$VERSION_ID" = 13 ]; then
  apt-get install -y -qq --no-install-recommends "$deb" containernetworking-plugins "${deps[@]}"
else
  apt-get install -y -qq --no-install-recommends patchelf "${deps[@]}"
  apt-get "${apt_extra[@]}" download "libc6/trixie"
  dpkg -x "$deb" /
  rm -rf "$work/libc" && mkdir -p "$work/libc"
  dpkg -x "$work"/libc6_*.deb "$work/libc"
  rm -rf "$PRIVATE_LIBC" && mkdir -p "$PRIVATE_LIBC"
  cp -a "$work/libc/usr/lib/x86_64-linux-gnu/." "$PRIVATE_LIBC/"
  for elf in /usr/bin/apptainer /usr/lib/x86_64-linux-gnu/apptainer/bin/starter /usr/libexec/apptainer/bin/starter; do
    [ -f "$elf" ] || continue
    patchelf --set-interpreter "$PRIVATE_LIBC/ld-linux-x86-64.so.2" \
      --force-rpath --set-rpath "$PRIVATE_LIBC:/usr/lib/x86_64-linux-gnu" "$elf"
  done
fi
configure
apptainer --version
