#!/usr/bin/env bash
# The headless Chromium that tests/tracking/test_mlflow_browser.py drives: Debian's `chromium` package,
# pinned. `make test` runs this once; it never fails the build. It writes one line to $1:
#   ok <path> <version>     the browser is there (already on PATH, or installed now)
#   skip: <why>             the browser test skips with this reason (pytest -rs prints it)
set -u
out="$1"
pin="$2"
note() { echo "$1" > "$out"; echo "moerl: browser: $1"; }
if path="$(command -v chromium)"; then
  note "ok $path $(chromium --version 2>/dev/null | head -1)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  note "skip: no apt-get here, and the test drives Debian's chromium package; install chromium $pin yourself"
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  if sudo -n true 2>/dev/null; then sudo="sudo -n"; else
    note "skip: installing chromium $pin needs root or passwordless sudo, and this user has neither"
    exit 0
  fi
fi
install() {
  DEBIAN_FRONTEND=noninteractive timeout 900 $sudo apt-get install -y -q --no-install-recommends \
    "chromium=$pin" "chromium-common=$pin" 2>&1
}
# the package lists may be missing or stale on a fresh machine: update once and retry
if log="$(install)" || { $sudo apt-get update -q >/dev/null 2>&1 && log="$(install)"; }; then
  note "ok $(command -v chromium) $(chromium --version 2>/dev/null | head -1)"
else
  note "skip: apt-get could not install chromium=$pin: $(echo "$log" | grep -E '^E:' | tail -1)"
fi
exit 0
