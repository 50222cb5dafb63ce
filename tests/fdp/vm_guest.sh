#!/bin/bash
# Inside the FDP VM guest (started by tests/fdp/vmenv.py through ../shared/tools/fdp-vm/run):
# mount the Python image (stdlib + the venv's packages, one squashfs file read over 9p instead of
# thousands of small files), then run the in-guest checks (or SCRIPT, a path ending in .py relative
# to REPO, e.g. bench/fdp_vm_handles.py) with that Python and this checkout.
# usage: vm_guest.sh PYTHON IMAGE REPO OUT [SCRIPT.py] [its args...]
set -u
py=$1 img=$2 repo=$3 out=$4; shift 4
script=tests/fdp/vm_checks.py
case "${1:-}" in *.py) script=$1; shift;; esac
cd "$repo" || exit 95
if [ "$img" != "-" ]; then
  modprobe loop 2>/dev/null; modprobe squashfs 2>/dev/null
  mkdir -p /tmp/tierstore-py && mount -t squashfs -o loop,ro "$img" /tmp/tierstore-py \
    || { echo "vm_guest: cannot mount $img" > "$out/driver.log"; exit 96; }
  export PYTHONHOME=/tmp/tierstore-py
fi
export PYTHONPATH="$repo" PYTHONDONTWRITEBYTECODE=1 LC_ALL=C
"$py" "$script" --out "$out" "$@" > "$out/driver.log" 2>&1
rc=$?
# the guest kernel's log (an NVMe timeout, abort or reset shows only here), for the host-side tests
dmesg > "$out/dmesg.log" 2>&1
sync
exit $rc
