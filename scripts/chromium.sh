#!/bin/bash
# Put Debian's Chromium on this machine for the dashboard's browser tests.
#
#   bash scripts/chromium.sh             # installs it (apt-get, as root or with sudo)
#   bash scripts/chromium.sh --optional  # as the first, but where it cannot be installed
#                                        # (no apt-get, no root) only prints a note (exit 0)
#
# The tests drive it with Playwright (a test dependency), launched with this binary:
# Playwright's own browser download is never used.
set -euo pipefail

for name in chromium chromium-browser; do
  if command -v "$name" >/dev/null; then
    exit 0
  fi
done
optional=${1:-}
if ! command -v apt-get >/dev/null; then
  echo "chromium.sh: no apt-get to install Chromium with; the dashboard's browser tests will skip" >&2
  [ "$optional" = "--optional" ] && exit 0
  exit 1
fi
if [ "$(id -u)" = 0 ]; then
  sudo=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  echo "chromium.sh: installing Chromium needs root; the dashboard's browser tests will skip" >&2
  [ "$optional" = "--optional" ] && exit 0
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
if ! { "${sudo[@]}" apt-get install -y -q chromium >/dev/null 2>&1 \
       || { "${sudo[@]}" apt-get update -q >/dev/null 2>&1 \
            && "${sudo[@]}" apt-get install -y -q chromium >/dev/null 2>&1; }; }; then
  echo "chromium.sh: apt-get could not install chromium; the dashboard's browser tests will skip" >&2
  [ "$optional" = "--optional" ] && exit 0
  exit 1
fi
