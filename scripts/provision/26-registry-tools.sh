#!/usr/bin/env bash
# A local OCI registry for the published-image tests (`build-images --swe
# --images-from docker://127.0.0.1:PORT/...`): Debian's docker-registry (the
# test starts its own on a free loopback port with a temporary storage
# folder, never the packaged service) and skopeo (pushes the test image).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
missing=()
command -v skopeo >/dev/null 2>&1 || missing+=(skopeo)
command -v docker-registry >/dev/null 2>&1 || missing+=(docker-registry)
if [ ${#missing[@]} -gt 0 ]; then
  # policy-rc.d 101: the package's own service is not started here (tests run their own registry).
  policy=/usr/sbin/policy-rc.d
  had_policy=0
  [ -e "$policy" ] && had_policy=1
  if [ "$had_policy" = 0 ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
  fi
  status=0
  apt-get install -y -qq --no-install-recommends "${missing[@]}" || status=$?
  [ "$had_policy" = 1 ] || rm -f "$policy"
  [ "$status" = 0 ] || exit "$status"
fi
skopeo --version
docker-registry --version
