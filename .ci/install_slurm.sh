#!/usr/bin/env bash
# Install the Debian packages the single-host test SLURM cluster needs (tests/slurm_cluster.py).
# Idempotent: returns at once when everything is already installed. Needs root (or sudo) and apt.
set -euo pipefail

PKGS=(slurm-wlm slurm-client slurmdbd munge mariadb-server)

missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "install_slurm: already installed (${PKGS[*]})"
    exit 0
fi

command -v apt-get >/dev/null || { echo "install_slurm: apt-get not found (Debian/Ubuntu only)" >&2; exit 1; }
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    # never prompt for a password (make test must not hang): passwordless sudo or nothing
    sudo -n true 2>/dev/null || { echo "install_slurm: needs root or passwordless sudo" >&2; exit 1; }
    SUDO="sudo -n"
fi

echo "install_slurm: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d 101: packages must not start their daemons (no systemd here; the tests start their own).
prc=/usr/sbin/policy-rc.d
created_prc=0
if [ ! -e "$prc" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$prc" >/dev/null && $SUDO chmod +x "$prc" && created_prc=1
fi
trap '[ $created_prc -eq 1 ] && $SUDO rm -f "$prc"' EXIT

$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install_slurm: done"
