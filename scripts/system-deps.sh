#!/usr/bin/env bash
# System packages the sandbox and browser tests use. Needs root (apt-get); a no-op otherwise.
set -euo pipefail
need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
[ -e /usr/lib/python3/dist-packages/numpy ] || need+=(python3-numpy)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "note: not root or no apt-get; tests needing ${need[*]} will be skipped" >&2
  exit 0
fi
echo "== apt-get install ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
