#!/usr/bin/env bash
# Build a fio that knows FDP (dataplacement=fdp, plids=; fio >= 3.34) for tests/fdp/test_vm.py:
# Debian 12 ships fio 3.33, which predates FDP. Usage: build_fio.sh FIO_SOURCE_TREE [VERSION]
# (a checkout or release tarball of https://github.com/axboe/fio, GPL-2.0). The binary goes to
# ${XDG_CACHE_HOME:-~/.cache}/tierstore/fio-VERSION/fio, where tests/fdp/vmenv.py looks for it.
# --disable-native: the guest runs under TCG, whose CPU model may lack the host's extensions.
set -euo pipefail
src=$1; ver=${2:-$(cat "$src/FIO-VERSION-GEN" 2>/dev/null | sed -n 's/^DEF_VER=fio-//p')}
dest=${XDG_CACHE_HOME:-$HOME/.cache}/tierstore/fio-${ver:-src}
build=$(mktemp -d); trap 'rm -rf "$build"' EXIT
cp -a "$src/." "$build/"
(cd "$build" && ./configure --disable-native >/dev/null && make -j"$(nproc)" fio >/dev/null)
mkdir -p "$dest" && cp "$build/fio" "$dest/fio"
"$dest/fio" --cmdhelp=plids >/dev/null && echo "$dest/fio"
