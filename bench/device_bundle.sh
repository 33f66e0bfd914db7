#!/usr/bin/env bash
# bash bench/device_bundle.sh (make device-bundle): fill .whl/ with what bench/device_check.sh needs on a GPU host that
# reaches no registry (docs/device-check.md), on a machine that reaches PyPI and Debian's mirrors:
#   .whl/*.whl       bench/device-wheels.txt, for CPython 3.12 on x86-64 (manylinux or pure Python), no dependencies
#   .whl/deb/*.deb   Debian's redis-server and redis-tools and the libraries redis-server links (apt-get download)
# then print every file's size and check that the bundle plus the working tree that travels with it (tracked and
# untracked-not-ignored files) stays under the device tool's 64 MiB. .whl/ is git-ignored: name it in `carry`.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=${DEVICE_BUNDLE:-$REPO/.whl}
PY=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))
# redis-tools holds the binary (redis-server is a link to redis-check-rdb); the rest are its libraries, carried whole so
# that it needs nothing from the host but glibc and libstdc++ (bench/device_check.sh points it, and it alone, at them)
DEBS=(redis-server redis-tools libjemalloc2 liblzf1 libatomic1 libssl3 libsystemd0 libcap2 libgcrypt20 libgpg-error0
	liblzma5 libzstd1 liblz4-1)

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/deb"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
	--implementation cp --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 -d "$BUNDLE" -r "$REPO/bench/device-wheels.txt"
(cd "$BUNDLE/deb" && apt-get download -q "${DEBS[@]}" >/dev/null) || {
	echo "device-bundle: apt-get download failed (Debian/Ubuntu with package lists: apt-get update first)" >&2
	exit 1
}

# one file per package: two versions of one wheel would stop pip install on the host
dups=$(ls "$BUNDLE" | grep '\.whl$' | cut -d- -f1 | tr 'A-Z_.' 'a-z--' | sort | uniq -d)
if [ -n "$dups" ]; then
	echo "device-bundle: more than one wheel of: $dups" >&2
	exit 1
fi
want=$(grep -cE '^[A-Za-z]' "$REPO/bench/device-wheels.txt")
got=$(ls "$BUNDLE"/*.whl | wc -l)
if [ "$got" -ne "$want" ]; then
	echo "device-bundle: $got wheels for $want lines of bench/device-wheels.txt" >&2
	exit 1
fi

cd "$REPO"
bundle=0
while IFS= read -r f; do
	size=$(stat -c %s "$f")
	bundle=$((bundle + size))
	awk -v s="$size" -v f="${f#"$REPO"/}" 'BEGIN {printf "%10.1f KiB  %s\n", s / 1024, f}'
done < <(find "$BUNDLE" -type f | sort)
# what travels besides the carried bundle: tracked files and untracked ones git does not ignore
tree=$(git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
total=$((bundle + tree))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
echo "bundle $(mib $bundle) MiB ($got wheels, ${#DEBS[@]} debs) + working tree $(mib $tree) MiB = $(mib $total) MiB" \
	"of the device tool's 64 MiB"
if [ "$total" -ge "$LIMIT" ]; then
	echo "device-bundle: over 64 MiB: the device tool would refuse the call" >&2
	exit 1
fi
