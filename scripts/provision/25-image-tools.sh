#!/usr/bin/env bash
# Tools `prorl build-images` needs beside Apptainer: debootstrap for the
# Debian-based recipes (base, python, swe).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
if ! command -v debootstrap >/dev/null 2>&1; then
  apt-get install -y -qq --no-install-recommends debootstrap
fi
debootstrap --version | head -1
