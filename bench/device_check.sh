#!/usr/bin/env bash
# bash bench/device_check.sh OUTDIR [bench.device_check options]: the device check on a CUDA host whose python3 has
# torch but that reaches no registry (the lent H200: docs/device-check.md). In about 8 minutes at most:
#  1. installs the carried wheels (.whl/*.whl, from make device-bundle) into /tmp with pip --no-index --no-deps,
#     for Python 3.12 only (another Python keeps its own packages);
#  2. unpacks Debian's redis-server (.whl/deb/*.deb) under /tmp and puts it on PATH, unless none is carried;
#  3. runs python3 -m bench.device_check from this tree (the project is not installed: PYTHONPATH), with the time that
#     is left as its deadline. OUTDIR gets device_check.json, device_check.log and install.log; the models,
#     checkpoints and the ring's run stay under /tmp.
# Environment: PYTHON (python3), DEVICE_BUNDLE (.whl), DEVICE_CHECK_WORK (/tmp/rlhf-device-check),
# DEVICE_CHECK_TOTAL_S (480: the whole run, install included). Exit status: bench.device_check's.
set -uo pipefail
T0=$SECONDS
OUTDIR=${1:?usage: bash bench/device_check.sh OUTDIR [bench.device_check options]}
shift
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=${DEVICE_BUNDLE:-$REPO/.whl}
WORK=${DEVICE_CHECK_WORK:-/tmp/rlhf-device-check}
SITE=$WORK/site
PY=${PYTHON:-python3}
TOTAL_S=${DEVICE_CHECK_TOTAL_S:-480}
mkdir -p "$OUTDIR" "$WORK"
OUTDIR=$(cd "$OUTDIR" && pwd)
INSTALL_LOG=$OUTDIR/install.log
: >"$INSTALL_LOG"
say() { echo "[device_check.sh +$((SECONDS - T0))s] $*" | tee -a "$INSTALL_LOG" >&2; }

# 1. the wheels
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>>"$INSTALL_LOG") || {
	say "$PY does not run"
	exit 2
}
rm -rf "$SITE"
if ! compgen -G "$BUNDLE/*.whl" >/dev/null; then
	say "no wheels in $BUNDLE (make device-bundle): $PY ($pyver) uses its own packages"
elif [ "$pyver" != 3.12 ]; then
	say "the wheels in $BUNDLE are for Python 3.12; $PY is $pyver and uses its own packages"
elif "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	--target "$SITE" "$BUNDLE"/*.whl >>"$INSTALL_LOG" 2>&1; then
	say "installed $(ls "$BUNDLE"/*.whl | wc -l) wheels into $SITE"
else
	say "pip install of $BUNDLE failed (install.log): $PY uses its own packages"
	rm -rf "$SITE"
fi

# 2. redis-server: the carried one, with its libraries for it alone (LD_LIBRARY_PATH in its wrapper only)
if compgen -G "$BUNDLE/deb/*.deb" >/dev/null; then
	root=$WORK/redis-root
	rm -rf "$root" "$WORK/bin"
	mkdir -p "$root" "$WORK/bin"
	for f in "$BUNDLE"/deb/*.deb; do
		dpkg -x "$f" "$root" >>"$INSTALL_LOG" 2>&1 || say "dpkg -x $f failed"
	done
	libs=$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu
	cat >"$WORK/bin/redis-server" <<EOF
#!/bin/sh
LD_LIBRARY_PATH=$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH} exec $root/usr/bin/redis-server "\$@"
EOF
	chmod +x "$WORK/bin/redis-server"
	if version=$("$WORK/bin/redis-server" --version 2>&1); then
		export PATH=$WORK/bin:$PATH
		say "redis-server (carried): $version"
	else
		say "the carried redis-server does not run here: $(echo "$version" | head -3)"
	fi
elif command -v redis-server >/dev/null; then
	say "no redis-server carried; using $(command -v redis-server)"
else
	say "no redis-server carried or on PATH: the ring phase will fail"
fi

# 3. the check, from the tree
export PYTHONPATH=${SITE}:${REPO}${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export RLHF_CACHE_DIR=${RLHF_CACHE_DIR:-$WORK/cache}
# phases start only before the deadline and stop at it; 40 s are kept for the last one's stop and the JSON
left=$((TOTAL_S - (SECONDS - T0) - 40))
say "running bench.device_check with $PY ($pyver), deadline ${left}s"
cd "$REPO"
"$PY" -m bench.device_check --out "$OUTDIR" --work "$WORK" --deadline-s "$left" "$@"
rc=$?
say "bench.device_check exited $rc; $((SECONDS - T0))s in all"
exit $rc
