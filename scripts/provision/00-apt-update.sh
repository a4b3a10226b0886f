#!/usr/bin/env bash
# One apt index refresh for the steps after this one.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
